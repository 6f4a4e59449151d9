"""ftctl.throttle on a real busy process: held near its CPU share by a cgroup where this machine has
one and by the SIGSTOP/SIGCONT duty cycle otherwise, and free again afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ftctl import throttle
from ftd.ftctl.throttle import CpuThrottle, group_pids


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share(pid: int, seconds: float = 1.5) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)  # a measurement over a fixed interval, not a wait for a condition
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("way", ["cgroup", "duty-cycle"])
def test_a_busy_process_group_is_held_to_its_share(busy: subprocess.Popen[bytes], way: str,
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if way == "duty-cycle":
        monkeypatch.setattr(throttle, "CGROUP_ROOT", tmp_path / "no-cgroupfs")
    assert group_pids(busy.pid) == [busy.pid]
    with CpuThrottle(busy.pid, 0.25) as held:
        if way == "cgroup" and not held.how.startswith("cgroup"):
            pytest.skip(f"no writable CPU cgroup on this machine (fell back to {held.how})")
        assert held.how.startswith("cgroup" if way == "cgroup" else "SIGSTOP")
        assert share(busy.pid) < 0.5, "a quarter of a CPU, generously bounded"
    state = Path(f"/proc/{busy.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state in ("R", "S"), f"the process runs again after the throttle (state {state})"
    if held.how.startswith("cgroup"):
        assert not any(p.name.startswith(f"ftd-throttle-{os.getpid()}-") for base in
                       (throttle.CGROUP_ROOT, throttle.CGROUP_ROOT / "cpu") if base.is_dir() for p in base.iterdir())


def test_a_fraction_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        CpuThrottle(1, 1.0)
