"""ftctl.throttle on a real busy process: held near its CPU share by a cgroup where this machine has
one and by the SIGSTOP/SIGCONT duty cycle otherwise, and free again afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ftctl import throttle
from ftd.ftctl.throttle import CpuThrottle, tree_pids
from ftd.waiting import wait_for


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share(pid: int, seconds: float = 1.5) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)  # a measurement over a fixed interval, not a wait for a condition
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


SPIN = "while True: pass"
# A worker of a node leads a session of its own: the throttle must hold it through its parent.
PARENT = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SPIN!r}], start_new_session=True)\n{SPIN}"


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    try:
        wait_for(lambda: len(tree_pids(proc.pid)) == 2, 20, "the busy child started")
        yield proc
    finally:
        for pid in tree_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.parametrize("way", ["cgroup", "duty-cycle"])
def test_a_busy_process_group_is_held_to_its_share(busy: subprocess.Popen[bytes], way: str,
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if way == "duty-cycle":
        monkeypatch.setattr(throttle, "CGROUP_ROOT", tmp_path / "no-cgroupfs")
    child = next(p for p in tree_pids(busy.pid) if p != busy.pid)
    with CpuThrottle(busy.pid, 0.25) as held:
        if way == "cgroup" and not held.how.startswith("cgroup"):
            pytest.skip(f"no writable CPU cgroup on this machine (fell back to {held.how})")
        assert held.how.startswith("cgroup" if way == "cgroup" else "SIGSTOP")
        assert share(busy.pid) + share(child, 0.5) < 1.0, "a quarter of a CPU each, generously bounded"
    state = Path(f"/proc/{busy.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state in ("R", "S"), f"the process runs again after the throttle (state {state})"
    if held.how.startswith("cgroup"):
        assert not any(p.name.startswith(f"ftd-throttle-{os.getpid()}-") for base in
                       (throttle.CGROUP_ROOT, throttle.CGROUP_ROOT / "cpu") if base.is_dir() for p in base.iterdir())


def test_the_schedule_spreads_the_groups_slices_over_the_period() -> None:
    plan = [(round(offset * 1e3, 3), group, sig) for offset, group, sig in throttle.schedule(2, 0.35, 0.01)]
    assert plan == [(0.0, 0, signal.SIGCONT), (3.5, 0, signal.SIGSTOP), (5.0, 1, signal.SIGCONT),
                    (8.5, 1, signal.SIGSTOP)]
    # A slice longer than the gap wraps into the next period; a stop due when another group starts comes first.
    wrapped = [(round(offset * 1e3, 3), group, sig) for offset, group, sig in throttle.schedule(2, 0.5, 0.01)]
    assert wrapped == [(0.0, 1, signal.SIGSTOP), (0.0, 0, signal.SIGCONT), (5.0, 0, signal.SIGSTOP),
                       (5.0, 1, signal.SIGCONT)]


def test_groups_held_alike_get_the_same_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two "nodes" (busy processes) under one duty cycle: each near the share, and alike."""
    monkeypatch.setattr(throttle, "CGROUP_ROOT", tmp_path / "no-cgroupfs")
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(2)]
    try:
        with CpuThrottle.alike([[p.pid] for p in procs], 0.3) as held:
            assert held.how.startswith("SIGSTOP")
            c0, t0 = [cpu_seconds(p.pid) for p in procs], time.monotonic()
            time.sleep(2.0)  # a measurement over a fixed interval, not a wait for a condition
            got = [(cpu_seconds(p.pid) - c) / (time.monotonic() - t0) for p, c in zip(procs, c0, strict=True)]
        assert all(0.05 < g < 0.6 for g in got), f"shares {got} (0.3 each, generously bounded)"
        assert max(got) < 1.6 * min(got), f"shares {got}: held alike"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_fraction_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        CpuThrottle(1, 1.0)


# A training step in miniature: a burst of compute (about 15 ms, calibrated) after a 20 ms wait. A
# throttle with a long period lets the burst run whole inside its slice (the wait absorbs the stopped
# part) and slows nothing; the throttle must stretch the burst itself, as a slow GPU stretches a kernel.
BURSTY = """
import sys, time
def burst(n):
    t, c = time.perf_counter(), time.process_time(); x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - t, time.process_time() - c
n = 10000
while burst(n)[1] < 0.015:
    n *= 2
out = open(sys.argv[1], "a")
while True:
    time.sleep(0.02)
    wall, cpu = burst(n)
    out.write(f"{time.time()} {wall} {cpu}\\n"); out.flush()
"""


def bursts_between(path: Path, since: float, until: float) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each burst logged in [since, until]."""
    rows = [line.split() for line in path.read_text().splitlines() if len(line.split()) == 3]
    return [(float(w), float(c)) for t, w, c in rows if since <= float(t) <= until]


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


@pytest.mark.parametrize("way", ["cgroup", "duty-cycle"])
def test_a_burst_of_compute_between_waits_is_stretched(way: str, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    if way == "duty-cycle":
        monkeypatch.setattr(throttle, "CGROUP_ROOT", tmp_path / "no-cgroupfs")
    log = tmp_path / "bursts"
    proc = subprocess.Popen([sys.executable, "-c", BURSTY, str(log)], start_new_session=True)
    try:
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 20, 30, "the bursts calibrated")
        t0 = time.time()
        wait_for(lambda: len(bursts_between(log, t0, time.time())) >= 15, 30, "15 free bursts")
        free = bursts_between(log, t0, time.time())
        with CpuThrottle(proc.pid, 0.25) as held:
            if way == "cgroup" and not held.how.startswith("cgroup"):
                pytest.skip(f"no writable CPU cgroup on this machine (fell back to {held.how})")
            t1 = time.time()
            wait_for(lambda: len(bursts_between(log, t1, time.time())) >= 15, 60, "15 throttled bursts")
            held_bursts = bursts_between(log, t1, time.time())
        # The burst's own CPU time is its work; wall time is what the throttle stretches. A shared box's
        # contention stretches wall time too (free bursts here have run 2x their CPU time), so the bound
        # compares the throttled wall time with the work, not with the free wall time: a quarter of a CPU
        # stretches a burst about 4x its work; 2x is the generous bound.
        work = median([c for _, c in free])
        median_held = median([w for w, _ in held_bursts])
        stretch = median([w / c for w, c in held_bursts if c > 0])
        assert median_held > 2 * work and stretch > 2, \
            f"bursts of {work * 1e3:.1f} ms CPU took {median([w for w, _ in free]) * 1e3:.1f} ms free, " \
            f"{median_held * 1e3:.1f} ms throttled, {stretch:.1f}x their CPU ({held.how})"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
