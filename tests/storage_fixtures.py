"""Test helpers for the storage tiers: moto's standalone S3 server as a real HTTP endpoint on a free
loopback port (boto3 talks to it over a socket, as to a real store), and a small tmpfs for disk-full
tests."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3

from ftd.ftctl.etcd_server import free_port
from ftd.storage_backends.s3 import make_client
from ftd.testing import wait_for


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

    def client(self) -> Any:
        """A client configured as :class:`S3Backend` makes its own (no botocore retries)."""
        return make_client(self.endpoint, "us-east-1", aws_access_key_id="testing",
                           aws_secret_access_key="testing", session=self._session)

    def new_bucket(self) -> str:
        name = f"ftd-test-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


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
