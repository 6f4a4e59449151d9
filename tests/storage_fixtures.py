"""Test helpers for the storage tiers: moto's standalone S3 server as a real HTTP endpoint on a free
loopback port (boto3 talks to it over a socket, as to a real store), a proxy in front of it that
checks request regions as AWS does, a small tmpfs for disk-full tests, and the blobs, sizes and S3
backends the storage tests share."""

from __future__ import annotations

import contextlib
import http.client
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3

from ftd.ftctl.etcd_server import free_port
from ftd.storage_backends.s3 import S3Backend, make_client
from ftd.waiting import wait_for


def moto_server_binary() -> str | None:
    """``moto_server`` next to this interpreter first (the venv in use), then on ``PATH``."""
    beside = Path(sys.executable).with_name("moto_server")
    if beside.exists():
        return str(beside)
    return shutil.which("moto_server")


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT`` as a subprocess; :meth:`start` returns once it answers."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._session = boto3.session.Session()  # one session: a client from it takes ms, not 0.15 s

    def start(self, timeout_s: float = 20.0) -> MotoServer:
        binary = moto_server_binary()
        if binary is None:
            raise RuntimeError("moto_server not found next to the interpreter nor on PATH: "
                               "pip install 'moto[s3,server]'")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._answers, timeout_s, f"moto_server on {self.endpoint} (log: {self.log_path})")
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {self.proc.returncode}; see {self.log_path}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
            return True
        return False

    def client(self, region: str = "us-east-1") -> Any:
        """A client configured as :class:`S3Backend` makes its own (no botocore retries)."""
        return make_client(self.endpoint, region, aws_access_key_id="testing",
                           aws_secret_access_key="testing", session=self._session)

    def new_bucket(self, region: str = "us-east-1") -> str:
        name = f"ftd-test-{uuid.uuid4().hex[:16]}"
        where = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        self.client(region).create_bucket(Bucket=name, **where)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class RegionCheckingProxy:
    """An HTTP proxy in front of moto (which serves any region) that refuses every request signed for
    another region than the bucket's, with ``AuthorizationHeaderMalformed`` (HTTP 400), and does not
    name the right region, so botocore cannot redirect: like a store that enforces its region, it
    works only for a client configured with the bucket's region. ``refused`` lists what it turned
    away."""

    _SCOPE = re.compile(r"Credential=[^/,]+/\d{8}/([^/,]+)/s3/aws4_request")

    def __init__(self, upstream_port: int, region: str) -> None:
        self.upstream_port = upstream_port
        self.region = region
        self.refused: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                scope = proxy._SCOPE.search(self.headers.get("Authorization", ""))
                signed = scope.group(1) if scope else ""
                if signed != proxy.region:
                    proxy.refused.append(f"{self.command} {self.path} signed for {signed!r}")
                    error = (f"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region '{signed}' is "
                             "wrong for this bucket</Message></Error>")
                    self._answer(400, "Bad Request", [("Content-Type", "application/xml")], error.encode())
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    skip = ("expect", "connection", "transfer-encoding", "content-length")
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                    headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    resp = upstream.getresponse()
                    data = resp.read()
                    kept = [(k, v) for k, v in resp.getheaders()
                            if k.lower() not in ("connection", "transfer-encoding", "content-length")]
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self._answer(resp.status, resp.reason, kept, data, length)
                finally:
                    upstream.close()

            def _answer(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes,
                        length: str | None = None) -> None:
                self.send_response(status, reason)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> RegionCheckingProxy:
        threading.Thread(target=self._server.serve_forever, name="region-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def small_tmpfs(mountpoint: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mountpoint`` (needs root), unmounted on exit. Raises
    ``PermissionError`` with mount's message when mounting is not permitted here."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise PermissionError(f"cannot mount a tmpfs at {mountpoint}: no mount command ({exc})") from exc
    if res.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs at {mountpoint}: {res.stderr.strip() or res.returncode}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=30)


# ---- shared by the storage tests ----------------------------------------------------------------

MiB = 1 << 20
PART = 5 * MiB  # the S3 tier's part size here: S3's minimum, so 13-28 MiB objects are multipart
MARKER = "SHARD.json"


class Interrupt(Exception):
    """Raised by a progress callback to cut a transfer short."""


def blob(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def s3_backend(moto: MotoServer, tmp_path: Path, **kw: Any) -> S3Backend:
    return S3Backend(moto.new_bucket(), prefix="tier", endpoint_url=moto.endpoint, part_size=PART,
                     state_dir=tmp_path / "uploads", client=moto.client(), **kw)


def count_sends(backend: S3Backend) -> list[str]:
    """The HTTP requests the backend's client sends, as 'METHOD url'."""
    sent: list[str] = []
    backend.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        f"{request.method} {request.url}"))
    return sent
