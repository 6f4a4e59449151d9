"""The systemd units pass ``systemd-analyze verify``, and each daemon speaks the notify protocol:
READY=1 only once its gRPC port accepts connections, WATCHDOG=1 from its main loop, STOPPING=1 on
SIGTERM — checked with a notify socket this test owns."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ftctl.etcd_server import EtcdCluster, free_port

UNITS = Path(__file__).resolve().parents[1] / "deploy" / "systemd"


@pytest.mark.parametrize("unit", ["ftd-coordinator.service", "ftd-agent.service"])
def test_units_pass_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze not found: apt-get install -y systemd (CI installs it)"
    text = (UNITS / unit).read_text()
    daemon = unit.removesuffix(".service")
    installed = shutil.which(daemon) or str(Path(sys.executable).with_name(daemon))
    assert Path(installed).exists(), f"{daemon} is not installed"
    local = tmp_path / unit
    local.write_text(text.replace(f"/opt/ftd/.venv/bin/{daemon}", installed))
    out = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                   "PrivateTmp=yes", "User=ftd"):
        assert needed in text, f"{unit} lacks {needed}"


def test_a_broken_unit_fails_verification(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze
    bad = tmp_path / "ftd-broken.service"
    bad.write_text("[Service]\nType=notify\nExecStart=/nonexistent/ftd-coordinator\n")
    assert subprocess.run([analyze, "verify", str(bad)], capture_output=True, timeout=60).returncode != 0


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    yield sock, path
    sock.close()


def receive(sock: socket.socket, deadline: float, until: str) -> list[str]:
    """Datagrams until one contains ``until`` (bounded by ``deadline``)."""
    got: list[str] = []
    while time.monotonic() < deadline:
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
        if until in got[-1]:
            return got
    raise AssertionError(f"no {until!r} before the deadline; got {got}")


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def daemon_argv(kind: str, port: int, etcd: EtcdCluster, workdir: Path) -> list[str]:
    if kind == "coordinator":
        return [sys.executable, "-m", "ftd.coordinator.main", "--listen", f"127.0.0.1:{port}",
                "--etcd-endpoints", etcd.endpoints, "--metrics-listen", ""]
    return [sys.executable, "-m", "ftd.agent.main", "--listen", f"127.0.0.1:{port}", "--node-id", "n1",
            "--host", "127.0.0.1", "--coordinators", f"127.0.0.1:{free_port()}", "--workdir", str(workdir),
            "--metrics-listen", ""]


@pytest.mark.etcd
@pytest.mark.parametrize("kind", ["coordinator", "agent"])
def test_ready_after_listening_watchdog_and_stopping(kind: str, etcd: EtcdCluster, tmp_path: Path,
                                                     notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen(daemon_argv(kind, port, etcd, tmp_path / "agent"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        messages = receive(sock, time.monotonic() + 30, "READY=1")
        assert accepts(port), "READY=1 arrived before the gRPC port accepted connections"
        assert not any("READY=1" in m for m in messages[:-1])
        pings = [m for m in receive(sock, time.monotonic() + 10, "WATCHDOG=1") if "WATCHDOG=1" in m]
        for _ in range(2):
            pings += [m for m in receive(sock, time.monotonic() + 5, "WATCHDOG=1") if "WATCHDOG=1" in m]
        assert len(pings) >= 3, "the watchdog must keep being pinged"
        proc.send_signal(signal.SIGTERM)
        receive(sock, time.monotonic() + 15, "STOPPING=1")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
