"""The agent's health sampling, on its own thread, and the GPU faults it keeps until they are cleared.

Heartbeats and ``CheckHealth`` never measure: they read the latest sample, judged at the time they
ask (``health_rules.judge``), so a hung NVML or filesystem call holds only the sampling thread. The
verdict then says so ("gpu probe hung 5.0 s") while heartbeats keep the node alive, instead of a
silent heartbeat stream getting a healthy node declared dead.

A critical XID (one not in ``allowed_xids``) marks the GPU faulty until an operator clears it
(``ftctl health NODE --clear-gpu-faults``, the agent's ``ClearGpuFaults``: after resetting the GPU, or
deciding the fault was benign) or the node reboots (the GPU is reset with it). :class:`GpuFaults`
keeps them in ``WORKDIR/gpu-faults.json`` with the kernel's boot id, so an agent restart keeps them:
NVML reports an XID once, as an event, and cannot tell one that happened before the agent started.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ftd.v1 import cluster_pb2

from .health_measure import GpuSampler, XidEvent, measure_disks
from .health_rules import (
    DiskMeasurement,
    HealthReport,
    HealthThresholds,
    Measurements,
    SamplingState,
    judge,
    sampling_check,
)

log = logging.getLogger("ftd.agent.health")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MAX_FAULTS = 64  # distinct (gpu, xid) pairs kept; a GPU raising more is as faulty with fewer on record


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say): a reboot resets every GPU."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class GpuFault:
    xid: int
    gpu: int  # NVML index, -1: unknown
    first_unix_s: float
    last_unix_s: float
    count: int = 1


class GpuFaults:
    """Critical XIDs seen on this node and not cleared, kept in ``path`` (``None``: memory only).
    Faults recorded under another boot id are dropped when loaded."""

    def __init__(self, path: Path | None, boot: str | None = None) -> None:
        self.path, self.boot = path, boot_id() if boot is None else boot
        self._lock = threading.Lock()
        self._faults: dict[tuple[int, int], GpuFault] = {}
        if path is None or not path.exists():
            return
        try:
            doc = json.loads(path.read_text())
            faults = [GpuFault(**f) for f in doc.get("faults", ())]
            stored_boot = str(doc.get("boot_id", ""))
        except (OSError, ValueError, TypeError) as exc:
            log.error("GPU faults in %s unreadable (%s): starting without them", path, exc)
            return
        if faults and stored_boot != self.boot:
            log.warning("GPU faults %s cleared: the node rebooted since", _names(faults))
            self._save()
            return
        self._faults = {(f.gpu, f.xid): f for f in faults}
        if faults:
            log.warning("GPU faults kept from before the agent restarted: %s (clear with ftctl health NODE "
                        "--clear-gpu-faults)", _names(faults))

    def record(self, events: Iterable[XidEvent], now_unix: float) -> None:
        with self._lock:
            changed = False
            for e in events:
                key = (e.gpu, e.xid)
                old = self._faults.get(key)
                if old is None and len(self._faults) >= MAX_FAULTS:
                    continue
                self._faults[key] = (GpuFault(e.xid, e.gpu, now_unix, now_unix) if old is None
                                     else replace(old, last_unix_s=now_unix, count=old.count + 1))
                if old is None:
                    log.error("GPU %s raised XID %d: the node is unhealthy until the fault is cleared",
                              e.gpu if e.gpu >= 0 else "?", e.xid)
                changed = True
            if changed:
                self._save()

    def active(self) -> tuple[GpuFault, ...]:
        with self._lock:
            return tuple(sorted(self._faults.values(), key=lambda f: (f.gpu, f.xid)))

    def codes(self) -> tuple[int, ...]:
        return tuple(sorted({f.xid for f in self.active()}))

    def clear(self, reason: str) -> tuple[GpuFault, ...]:
        """Forgets every fault (an operator reset the GPU, or judged it benign); returns them."""
        with self._lock:
            cleared = tuple(sorted(self._faults.values(), key=lambda f: (f.gpu, f.xid)))
            self._faults.clear()
            self._save()
        if cleared:
            log.warning("GPU faults %s cleared: %s", _names(cleared), reason or "no reason given")
        return cleared

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"boot_id": self.boot, "faults": [asdict(f) for f in self._faults.values()]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("cannot keep GPU faults in %s: %s", self.path, exc)


def _names(faults: Iterable[GpuFault]) -> str:
    return ", ".join(f"gpu{f.gpu if f.gpu >= 0 else '?'} XID {f.xid}" for f in faults)


def verdict_proto(report: HealthReport) -> cluster_pb2.HealthVerdict:
    """A report as it travels in heartbeats and ``CheckHealth`` answers."""
    verdict = cluster_pb2.HealthVerdict(healthy=report.healthy, reason="" if report.healthy else report.reason,
                                        checked_unix_s=report.checked_unix_s)
    for check in report.checks:
        entry = verdict.checks.add(name=check.name, ok=check.ok, reason=check.reason)
        if check.value is not None:
            entry.value = check.value
        if check.threshold is not None:
            entry.threshold = check.threshold
    return verdict


def health_proto(m: Measurements | None, report: HealthReport | None) -> cluster_pb2.Health:
    """The heartbeat's health: free space per tier, GPUs when NVML is there, the verdict when one exists.
    Per-device lists are sent only when every device answered (one value per device, by index)."""
    health = cluster_pb2.Health()
    if m is not None:
        for tier, disk in m.disks.items():
            if not disk.error:
                health.disks.add(tier=tier, path=disk.path, free_bytes=disk.free_bytes, total_bytes=disk.total_bytes)
        if m.gpus.available:
            gpu = health.gpu
            gpu.SetInParent()  # present even with no device: NVML answered
            gpu.count = m.gpus.count
            devices = m.gpus.devices
            if all(d.utilization_pct is not None for d in devices):
                gpu.utilization_pct.extend(d.utilization_pct or 0.0 for d in devices)
            if all(d.memory_used_bytes is not None for d in devices):
                gpu.memory_used_bytes.extend(d.memory_used_bytes or 0 for d in devices)
    if report is not None:
        health.verdict.CopyFrom(verdict_proto(report))
    return health


class HealthMonitor:
    """Samples disks and GPUs every ``interval_s`` on its own thread; a part running past
    ``deadline_s`` is reported as hung by every verdict asked for meanwhile."""

    def __init__(self, tiers: Mapping[str, Path], gpus: GpuSampler, thresholds: HealthThresholds,
                 faults: GpuFaults, interval_s: float, deadline_s: float,
                 on_sample: Callable[[Measurements], None] = lambda m: None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.tiers, self.gpus, self.thresholds, self.faults = dict(tiers), gpus, thresholds, faults
        self.interval_s, self.deadline_s = interval_s, deadline_s
        self.on_sample, self.clock, self.wall = on_sample, clock, wall
        self._cond = threading.Condition()  # guards the three below; never held while measuring
        self._latest: Measurements | None = None
        self._state = SamplingState()
        self._done = 0  # samples completed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the sampling thread --------------------------------------------------------------

    def start(self) -> None:
        """Starts sampling and waits for the first sample, at most ``deadline_s``."""
        self._thread = threading.Thread(target=self._run, name="ftd-health", daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: self._done > 0, timeout=self.deadline_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("health sampling still stuck in %s; leaving it", self._state.busy_part)
                return
        self.gpus.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a bug must not end the sampling: the verdict would go stale silently
                log.exception("health sampling failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _begin(self, part: str) -> None:
        with self._cond:
            self._state = replace(self._state, busy_since=self.clock(), busy_part=part)

    def sample_once(self) -> Measurements:
        """One sample, part by part, on the calling thread (the monitor's own, or a test's)."""
        disks: dict[str, DiskMeasurement] = {}
        for tier, path in self.tiers.items():
            self._begin(f"disk:{tier}")
            disks.update(measure_disks({tier: path}))
        self._begin("gpu")
        allowed = self.thresholds.allowed_xid_codes
        self.faults.record((e for e in self.gpus.drain_xids() if e.xid not in allowed), self.wall())
        gpus = replace(self.gpus.measure(), xids=self.faults.codes())
        sample = Measurements(disks, gpus, None, self.wall())
        with self._cond:
            self._latest, self._done = sample, self._done + 1
            self._state = SamplingState(done_at=self.clock())
            self._cond.notify_all()
        self.on_sample(sample)
        return sample

    # ---- what heartbeats and CheckHealth read ---------------------------------------------

    def _judged(self) -> tuple[Measurements | None, HealthReport | None]:
        with self._cond:
            latest, state = self._latest, self._state
        check = sampling_check(state, self.clock(), self.interval_s, self.deadline_s)
        return latest, judge(latest, self.thresholds, check, self.wall())

    def report(self) -> HealthReport | None:
        """The latest sample judged now (never waits on a measurement)."""
        return self._judged()[1]

    def health(self) -> cluster_pb2.Health:
        """What a heartbeat carries: the latest sample and its verdict, judged now."""
        return health_proto(*self._judged())

    def check_now(self) -> cluster_pb2.HealthVerdict:
        """A sample begun after this call, judged; at most ``deadline_s`` of waiting (then the hang,
        or the previous sample, is what is judged)."""
        with self._cond:
            wanted = self._done + (2 if self._state.busy_since is not None else 1)
            self._wake.set()
            self._cond.wait_for(lambda: self._done >= wanted, timeout=self.deadline_s)
        report = self.report()
        if report is None:
            return cluster_pb2.HealthVerdict(healthy=False, reason="not sampled yet", checked_unix_s=self.wall())
        return verdict_proto(report)

    def clear_gpu_faults(self, reason: str) -> tuple[tuple[str, ...], cluster_pb2.HealthVerdict]:
        """Clears the latched XIDs and samples again: what was cleared, and the verdict now."""
        cleared = self.faults.clear(reason)
        return tuple(f"gpu{f.gpu if f.gpu >= 0 else '?'} XID {f.xid} (x{f.count}, first at {f.first_unix_s:.0f})"
                     for f in cleared), self.check_now()
