"""``ftctl up --s3``: moto's standalone S3 server as the cold tier of a local cluster (a test double
of S3 that speaks the real HTTP API; moto is a dev dependency: ``./install.sh --dev``).

``python -m ftd.ftctl.s3_server --workdir DIR --host H --port P`` runs it with the workdir on its
command line, so ``ftctl down`` can tell our process from a reused pid as for every other daemon
(:func:`ftd.ftctl.localcluster.stop`). In an isolated cluster it runs in the lab host ``s3``.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

# moto accepts any key; the agents and boto3 need *some* credentials to sign requests.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
PORT = 9000  # in an isolated cluster (its own address); on loopback a free port


class S3ServerError(RuntimeError):
    pass


def available() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


def command(workdir: Path, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "ftd.ftctl.s3_server", "--workdir", str(workdir), "--host", host,
            "--port", str(port)]


def wait_serving(proc: subprocess.Popen[bytes], host: str, port: int, timeout_s: float, log: Path) -> None:
    """Returns once ``host:port`` accepts connections; raises naming the log when the server exits or
    does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise S3ServerError(f"the S3 server (moto) exited with code {proc.returncode}; see {log}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.1)
    raise S3ServerError(f"the S3 server (moto) did not answer on {host}:{port} within {timeout_s:g}s; see {log}")


def create_bucket(endpoint: str, bucket: str) -> None:
    from ftd.storage_backends.s3 import make_client

    client = make_client(endpoint, "us-east-1", aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workdir", required=True, help="the cluster's workdir (names this process for ftctl down)")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    if not available():
        sys.exit("ftctl: --s3 needs moto's server: ./install.sh --dev (pip install 'moto[s3,server]')")
    from moto.server import main as moto_main

    moto_main(["-H", args.host, "-p", str(args.port)])


if __name__ == "__main__":
    main()
