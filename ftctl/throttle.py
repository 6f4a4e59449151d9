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
    :attr:`how` says which mechanism held it. :meth:`alike` holds several groups (nodes) each to the
    same share."""

    def __init__(self, root: int | Sequence[int], fraction: float, period_s: float = PERIOD_US / 1e6) -> None:
        if not 0.01 <= fraction < 1.0:
            raise ValueError(f"a throttle keeps a fraction in [0.01, 1) of a CPU, got {fraction}")
        self.root, self.fraction, self.period_s = root, fraction, period_s
        self.groups: list[list[int]] = [[root] if isinstance(root, int) else list(root)]
        self.how = ""
        self._cgroups: list[Path] = []
        self._back: Path | None = None  # where the processes go when the throttle ends
        self._cycler: subprocess.Popen[bytes] | None = None

    @classmethod
    def alike(cls, groups: Sequence[Sequence[int]], fraction: float,
              period_s: float = PERIOD_US / 1e6) -> CpuThrottle:
        """Each group (a node's processes) held to ``fraction`` of a CPU, alike: a cgroup each, or one
        duty cycle whose run slices for the groups are spread evenly over the period. One cycle, not
        one per group: separate cycles drift apart on a loaded box and the group whose cycler wakes
        late runs longer (CI once measured two "alike" nodes 2x apart); slices spread apart, not in
        step: groups continued together contend for the cores in the order they were signalled."""
        throttle = cls([pid for group in groups for pid in group], fraction, period_s)
        throttle.groups = [list(group) for group in groups]
        return throttle

    def __enter__(self) -> CpuThrottle:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        period_us = max(1000, int(self.period_s * 1e6))  # the kernel's least CFS period is 1 ms
        quota = max(1000, int(self.fraction * period_us))
        ways = (("cgroup v2 cpu.max", CGROUP_ROOT, {"cpu.max": f"{quota} {period_us}"}),
                ("cgroup v1 cpu.cfs_quota_us", CGROUP_ROOT / "cpu",
                 {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}))
        for how, base, knobs in ways:
            if how.startswith("cgroup v2") and "cpu" not in _read(base / "cgroup.controllers").split():
                continue
            if how.startswith("cgroup v1") and not all((base / k).exists() for k in knobs):
                continue
            try:
                if how.startswith("cgroup v2") and "cpu" not in _read(base / "cgroup.subtree_control").split():
                    (base / "cgroup.subtree_control").write_text("+cpu")
                for group_roots in self.groups:
                    group = base / f"ftd-throttle-{os.getpid()}-{min(group_roots, default=0)}"
                    group.mkdir(exist_ok=True)
                    self._cgroups.append(group)
                    for each, value in knobs.items():
                        (group / each).write_text(value)
                    for pid in tree_pids(group_roots):
                        with contextlib.suppress(ProcessLookupError, OSError):
                            (group / "cgroup.procs").write_text(str(pid))
            except OSError as exc:
                log.info("%s not usable here (%s); trying the next way", how, exc)
                self._release(base)
                continue
            self._back, self.how = base, how
            return how
        self.how = "SIGSTOP/SIGCONT duty cycle"
        # A process of its own: a thread here would wait for this interpreter's GIL (5 ms slices while
        # the caller parses logs or polls), and slices of a few ms would come late and uneven.
        self._cycler = subprocess.Popen(
            [sys.executable, "-m", "ftd.ftctl.throttle", str(self.fraction), str(self.period_s),
             *(",".join(map(str, group)) for group in self.groups)],
            stdin=subprocess.DEVNULL)
        return self.how

    def stop(self) -> None:
        """Ends the throttle: the processes back in the parent cgroup (or continued), the cgroups removed."""
        if self._cycler is not None:
            self._cycler.terminate()  # it continues its processes on the way out
            try:
                self._cycler.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._cycler.kill()
                self._cycler.wait(timeout=5.0)
            self._cycler = None
            _signal(tree_pids([pid for group in self.groups for pid in group]), signal.SIGCONT)
        if self._back is not None:
            self._release(self._back)
            self._back = None

    def _release(self, back: Path) -> None:
        for group in self._cgroups:
            for pid in _read(group / "cgroup.procs").split():
                with contextlib.suppress(OSError):
                    (back / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
        self._cgroups = []


def schedule(groups: int, fraction: float, period_s: float) -> list[tuple[float, int, int]]:
    """One period of the duty cycle: ``(offset_s, group, signal)`` in time order. Group ``i`` runs
    from ``i * period / groups`` for ``fraction * period`` (wrapping into the next period)."""
    events = []
    for i in range(groups):
        begin = i * period_s / groups
        events.append((begin, i, signal.SIGCONT))
        events.append(((begin + fraction * period_s) % period_s, i, signal.SIGSTOP))
    return sorted(events, key=lambda e: (e[0], e[2] == signal.SIGCONT))


def duty_cycle(groups: Sequence[Sequence[int]], fraction: float, period_s: float, parent: int) -> None:
    """Stops and continues each group's roots and their descendants (looked up every
    ``PIDS_EVERY_S``) on :func:`schedule`'s slices until SIGTERM or until ``parent`` is gone;
    continues them on the way out. Deadlines are absolute, so a late wake-up shortens the next
    wait instead of shifting every later slice."""
    # Real-time priority where allowed (root): on a loaded box an ordinary process wakes a few ms
    # late, and every late SIGSTOP lengthens a 2 ms run slice; the cycle itself uses almost no CPU.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    ending = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ending.set())
    plan = schedule(len(groups), fraction, period_s)
    held: list[list[int]] = [[] for _ in groups]
    looked = float("-inf")
    try:
        for group in groups:
            _signal(tree_pids(group), signal.SIGSTOP)
        cycle = time.monotonic()
        while not ending.is_set() and os.getppid() == parent:
            if time.monotonic() - looked >= PIDS_EVERY_S:
                held, looked = [tree_pids(group) for group in groups], time.monotonic()
            for offset, i, sig in plan:
                ending.wait(max(0.0, cycle + offset - time.monotonic()))
                _signal(held[i], sig)
            cycle += period_s
            if time.monotonic() - cycle > period_s:  # far behind (a stall): start afresh, not catch up
                cycle = time.monotonic()
    finally:
        _signal(tree_pids([pid for group in groups for pid in group]), signal.SIGCONT)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


__all__ = ["CpuThrottle", "duty_cycle", "schedule", "tree_pids"]


if __name__ == "__main__":  # the duty cycle's own process: FRACTION PERIOD_S GROUP... (a group: PID,PID,...)
    duty_cycle([[int(p) for p in a.split(",") if p] for a in sys.argv[3:]], float(sys.argv[1]),
               float(sys.argv[2]), os.getppid())
