"""Starts real etcd server processes on free loopback ports: the embedded default of ``ftctl up``
and the fixture of every test that claims to exercise etcd.

etcd 3.4 from Debian (``apt-get install -y etcd-server``); the binary is found on ``PATH`` or
through ``FTD_ETCD_BINARY``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    path = os.environ.get("FTD_ETCD_BINARY") or shutil.which("etcd") or "/usr/bin/etcd"
    if not Path(path).exists():
        raise EtcdNotFound(
            "etcd server binary not found (looked at $FTD_ETCD_BINARY, PATH, /usr/bin/etcd): "
            "install it with 'apt-get install -y etcd-server'"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=0.5) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on loopback with their own data dirs under ``workdir``.

    ``fast=True`` uses short raft timings (50 ms heartbeat, 250 ms election) so chaos tests see
    re-election in well under a second.
    """

    workdir: Path
    size: int = 1
    fast: bool = False
    detach: bool = False  # start in a new session so the members outlive the caller (ftctl up)
    members: list[EtcdMember] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def _command(self, m: EtcdMember, initial_cluster: str, state: str) -> list[str]:
        cmd = [
            etcd_binary(),
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"ftd-{os.getpid()}-{id(self)}",
        ]
        if self.fast:
            cmd += ["--heartbeat-interval", "50", "--election-timeout", "250"]
        return cmd

    def start(self, timeout_s: float = 20.0) -> EtcdCluster:
        for attempt in range(3):  # a free port can be taken between probing and binding
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.members = [
                EtcdMember(f"etcd{i}", free_port(), free_port(), self.workdir / f"etcd{i}.data",
                           self.workdir / f"etcd{i}.log")
                for i in range(self.size)
            ]
            for m in self.members:
                self._spawn(m, "new")
            if self.wait_healthy(timeout_s):
                return self
            self.stop()
            if attempt == 2:
                tails = "; ".join(f"{m.name}: {_tail(m.log_path)}" for m in self.members)
                raise RuntimeError(f"etcd did not become healthy within {timeout_s}s: {tails}")
            for m in self.members:
                shutil.rmtree(m.data_dir, ignore_errors=True)
        return self

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _spawn(self, m: EtcdMember, state: str) -> None:
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(
                self._command(m, self._initial_cluster(), state),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=self.detach,
            )

    def wait_healthy(self, timeout_s: float, members: list[EtcdMember] | None = None) -> bool:
        deadline = time.monotonic() + timeout_s
        targets = members if members is not None else self.members
        while time.monotonic() < deadline:
            if all(m.running() and m.healthy() for m in targets):
                return True
            if any(m.proc is not None and m.proc.poll() is not None for m in targets):
                return False
            time.sleep(0.05)
        return False

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        m = self.members[index]
        if m.running():
            assert m.proc is not None
            m.proc.send_signal(sig)
            m.proc.wait(timeout=10)

    def restart(self, index: int, timeout_s: float = 20.0) -> None:
        """Starts a stopped member again on its old ports and data dir (it rejoins its cluster)."""
        m = self.members[index]
        if m.running():
            return
        self._spawn(m, "existing" if (m.data_dir / "member").exists() else "new")
        if not self.wait_healthy(timeout_s, [m]):
            raise RuntimeError(f"etcd member {m.name} did not come back: {_tail(m.log_path)}")

    def stop(self) -> None:
        for m in self.members:
            if m.running():
                assert m.proc is not None
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(timeout=5)


def _tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"
