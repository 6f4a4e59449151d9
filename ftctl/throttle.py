"""A slow node, for real: processes of one local node (a node's training workers, as a throttled GPU
slows them, or its agent and every descendant) and whatever they start later held to a fraction of
one CPU.

The throttle is a CPU cgroup: cgroup v2's ``cpu.max`` where the unified hierarchy has the cpu
controller, else cgroup v1's ``cpu.cfs_quota_us``. Without either (no root, a read-only cgroupfs)
it falls back to duty-cycling the group with SIGSTOP/SIGCONT, the same average share in slices of
``period_s``.

The period is short (10 ms, where the kernel's default CFS period is 100 ms) for a reason: a training
step is a burst of compute between waits (a data load, a collective, a paced sleep). With a long
period a short burst fits inside the slice the group may run in, the waits absorb the stopped part,
and the "throttled" node computes at full speed. A short period stretches every burst of more than a
few milliseconds by about ``1 / fraction``, as a throttled GPU stretches every kernel.
``FTD_CGROUP_ROOT`` names another cgroupfs mount (a path with none forces the duty cycle).

Used by ``ftctl demo --straggler`` and the chaos matrix's slow-node scenarios; only process trees
this tool's cluster started are ever touched (the caller passes their root).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("ftd.ftctl.throttle")
CGROUP_ROOT = Path(os.environ.get("FTD_CGROUP_ROOT", "/sys/fs/cgroup"))
PERIOD_US = 10_000
PIDS_EVERY_S = 0.5  # the duty cycle looks for new descendants this often (a /proc scan per slice costs a core)


def tree_pids(root: int | Sequence[int]) -> list[int]:
    """The roots and every live descendant (from /proc: the parent in field 4 of ``stat``). Workers
    lead sessions of their own, so a process group would miss them; a cgroup keeps whatever they
    start later."""
    roots = [root] if isinstance(root, int) else list(root)
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    out, todo = [], [r for r in roots if r in parents]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return sorted(out)


class CpuThrottle:
    """``with CpuThrottle(pids, 0.3): ...`` (one root pid or several, with their descendants);
    :attr:`how` says which mechanism held it."""

    def __init__(self, root: int | Sequence[int], fraction: float, period_s: float = PERIOD_US / 1e6) -> None:
        if not 0.01 <= fraction < 1.0:
            raise ValueError(f"a throttle keeps a fraction in [0.01, 1) of a CPU, got {fraction}")
        self.root, self.fraction, self.period_s = root, fraction, period_s
        self.how = ""
        self._cgroup: Path | None = None
        self._back: Path | None = None  # where the processes go when the throttle ends
        self._cycler: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CpuThrottle:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        period_us = max(1000, int(self.period_s * 1e6))  # the kernel's least CFS period is 1 ms
        quota = max(1000, int(self.fraction * period_us))
        first = self.root if isinstance(self.root, int) else min(self.root, default=0)
        name = f"ftd-throttle-{os.getpid()}-{first}"
        ways = (("cgroup v2 cpu.max", CGROUP_ROOT, {"cpu.max": f"{quota} {period_us}"}),
                ("cgroup v1 cpu.cfs_quota_us", CGROUP_ROOT / "cpu",
                 {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}))
        for how, base, knobs in ways:
            if how.startswith("cgroup v2") and "cpu" not in _read(base / "cgroup.controllers").split():
                continue
            if how.startswith("cgroup v1") and not all((base / k).exists() for k in knobs):
                continue
            group = base / name
            try:
                if how.startswith("cgroup v2") and "cpu" not in _read(base / "cgroup.subtree_control").split():
                    (base / "cgroup.subtree_control").write_text("+cpu")
                group.mkdir(exist_ok=True)
                for each, value in knobs.items():
                    (group / each).write_text(value)
                for pid in tree_pids(self.root):
                    with contextlib.suppress(ProcessLookupError, OSError):
                        (group / "cgroup.procs").write_text(str(pid))
            except OSError as exc:
                log.info("%s not usable here (%s); trying the next way", how, exc)
                with contextlib.suppress(OSError):
                    group.rmdir()
                continue
            self._cgroup, self._back, self.how = group, base, how
            return how
        self.how = "SIGSTOP/SIGCONT duty cycle"
        # A process of its own: a thread here would wait for this interpreter's GIL (5 ms slices while
        # the caller parses logs or polls), and slices of a few ms would come late and uneven.
        roots = [self.root] if isinstance(self.root, int) else list(self.root)
        self._cycler = subprocess.Popen(
            [sys.executable, "-m", "ftd.ftctl.throttle", str(self.fraction), str(self.period_s), *map(str, roots)],
            stdin=subprocess.DEVNULL)
        return self.how

    def stop(self) -> None:
        """Ends the throttle: the processes back in the parent cgroup (or continued), the cgroup removed."""
        if self._cycler is not None:
            self._cycler.terminate()  # it continues its processes on the way out
            try:
                self._cycler.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._cycler.kill()
                self._cycler.wait(timeout=5.0)
            self._cycler = None
            _signal(tree_pids(self.root), signal.SIGCONT)
        if self._cgroup is not None and self._back is not None:
            for pid in _read(self._cgroup / "cgroup.procs").split():
                with contextlib.suppress(OSError):
                    (self._back / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                self._cgroup.rmdir()
            self._cgroup = None


def duty_cycle(roots: Sequence[int], fraction: float, period_s: float, parent: int) -> None:
    """Stops and continues ``roots`` and their descendants (looked up every ``PIDS_EVERY_S``) in
    slices of ``period_s`` until SIGTERM or until ``parent`` is gone; continues them on the way out."""
    run_s, stop_s = fraction * period_s, (1 - fraction) * period_s
    # Real-time priority where allowed (root): on a loaded box an ordinary process wakes a few ms
    # late, and every late SIGSTOP lengthens a 2 ms run slice; the cycle itself uses almost no CPU.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ending.set())
    held: list[int] = []
    looked = float("-inf")
    try:
        while not ending.is_set() and os.getppid() == parent:
            if time.monotonic() - looked >= PIDS_EVERY_S:
                held, looked = tree_pids(roots), time.monotonic()
            _signal(held, signal.SIGSTOP)
            ending.wait(stop_s)
            _signal(held, signal.SIGCONT)
            ending.wait(run_s)
    finally:
        _signal(tree_pids(roots), signal.SIGCONT)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


__all__ = ["CpuThrottle", "duty_cycle", "tree_pids"]


if __name__ == "__main__":  # the duty cycle's own process: FRACTION PERIOD_S ROOT_PID...
    duty_cycle([int(a) for a in sys.argv[3:]], float(sys.argv[1]), float(sys.argv[2]), os.getppid())
