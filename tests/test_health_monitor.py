"""The agent's health sampling on its own thread: the sampling check is a pure function of ``now``; a hung
NVML query makes the verdict say so without stopping anyone who reads it; an XID stays in every verdict
until it is cleared, across agent restarts, and a reboot clears it (the GPU is reset with the node)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from doubles import ManualClock

from ftd.agent.health_measure import GpuSampler, XidEvent
from ftd.agent.health_monitor import GpuFaults, HealthMonitor, health_proto
from ftd.agent.health_rules import (
    Check,
    GpuDevice,
    GpuMeasurement,
    HealthThresholds,
    Measurements,
    SamplingState,
    judge,
    sampling_check,
)
from ftd.waiting import wait_for

T0 = 1_800_000_000.0


# ---- the rules, pure -----------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "now", "ok", "reason"), [
    (SamplingState(done_at=100.0), 100.4, True, "sampled 0.4 s ago"),
    (SamplingState(done_at=100.0, busy_since=102.0, busy_part="gpu"), 106.9, True, "sampled 6.9 s ago"),
    (SamplingState(done_at=100.0, busy_since=102.0, busy_part="gpu"), 107.1, False,
     "gpu probe hung 5.1 s (deadline 5 s)"),
    (SamplingState(busy_since=100.0, busy_part="disk:ssd"), 106.0, False, "disk:ssd probe hung 6.0 s (deadline 5 s)"),
    (SamplingState(done_at=100.0), 108.0, False, "health sample 8.0 s old (one every 2.5 s)"),
])
def test_sampling_check_is_a_function_of_now(state: SamplingState, now: float, ok: bool, reason: str) -> None:
    check = sampling_check(state, now, interval_s=2.5, deadline_s=5.0)
    assert check is not None and (check.ok, check.reason) == (ok, reason)


def test_nothing_to_judge_before_the_first_sample_unless_it_hung() -> None:
    assert sampling_check(SamplingState(busy_since=100.0, busy_part="gpu"), 104.0, 2.5, 5.0) is None
    assert judge(None, HealthThresholds(), None, T0) is None
    hung = Check("sampling", False, 6.0, 5.0, "gpu probe hung 6.0 s (deadline 5 s)")
    report = judge(None, HealthThresholds(), hung, T0)
    assert report is not None and not report.healthy and report.reason == hung.reason


def test_a_hang_is_the_reason_and_dates_the_verdict_now() -> None:
    m = Measurements(gpus=GpuMeasurement(True, 1, (GpuDevice(0, 40.0, 0),)), taken_unix=T0)
    fresh = judge(m, HealthThresholds(), Check("sampling", True, 0.4, 7.5, "sampled 0.4 s ago"), T0 + 0.4)
    assert fresh is not None and fresh.healthy and fresh.checked_unix_s == T0
    assert [c.name for c in fresh.checks] == ["sampling", "gpu_temperature", "gpu_ecc", "gpu_xid"]
    hung = judge(m, HealthThresholds(), Check("sampling", False, 6.0, 5.0, "gpu probe hung 6.0 s"), T0 + 9)
    assert hung is not None and not hung.healthy and hung.reason == "gpu probe hung 6.0 s"
    assert hung.checked_unix_s == T0 + 9


def test_a_latched_xid_fails_even_when_nvml_went_away() -> None:
    m = Measurements(gpus=GpuMeasurement(xids=(79,), unavailable_reason="NVML init failed"), taken_unix=T0)
    report = judge(m, HealthThresholds(), None, T0)
    assert report is not None and report.reason == "XID errors 79 (allowed: 13, 31, 43, 45)"


# ---- GPU faults: kept until cleared --------------------------------------------------------------


def test_faults_persist_across_restarts_and_a_reboot_clears_them(tmp_path: Path) -> None:
    path = tmp_path / "gpu-faults.json"
    faults = GpuFaults(path, boot="boot-a")
    faults.record([XidEvent(79, 3), XidEvent(79, 3), XidEvent(48, 1)], T0)
    assert faults.codes() == (48, 79)
    assert [(f.gpu, f.xid, f.count) for f in faults.active()] == [(1, 48, 1), (3, 79, 2)]
    assert GpuFaults(path, boot="boot-a").codes() == (48, 79), "an agent restart keeps them"
    assert GpuFaults(path, boot="boot-b").codes() == (), "a reboot resets the GPUs: the faults go"
    assert json.loads(path.read_text())["faults"] == []
    again = GpuFaults(path, boot="boot-b")
    again.record([XidEvent(79, 0)], T0)
    assert [f.xid for f in again.clear("gpu0 reset by the operator")] == [79]
    assert again.codes() == () and GpuFaults(path, boot="boot-b").codes() == ()


# ---- the monitor on its own thread ---------------------------------------------------------------


class HangingNvml:
    """NVML whose device count blocks while ``answering`` is clear (``waiting`` then says a query
    is stuck in it); the XIDs queued in ``xids`` are its events."""

    def __init__(self) -> None:
        self.answering, self.waiting = threading.Event(), threading.Event()
        self.answering.set()
        self.xids: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        if not self.answering.is_set():
            self.waiting.set()
        self.answering.wait()
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 40

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        pass

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        if not self.xids:
            raise TimeoutError("Timeout")  # the name says it: no event
        return type("EventData", (), {"eventData": self.xids.pop(0)})()


def monitor(tmp_path: Path, nv: HangingNvml, clock: Any = None, deadline_s: float = 5.0) -> HealthMonitor:
    kw = {"clock": clock} if clock is not None else {}
    return HealthMonitor({"ssd": tmp_path}, GpuSampler(nv), HealthThresholds(), GpuFaults(tmp_path / "faults.json"),
                         interval_s=0.05, deadline_s=deadline_s, **kw)


def test_a_hung_nvml_call_is_reported_while_readers_carry_on(tmp_path: Path) -> None:
    nv, clock = HangingNvml(), ManualClock(100.0)
    m = monitor(tmp_path, nv, clock)
    m.start()
    try:
        first = m.report()
        assert first is not None and first.healthy
        nv.answering.clear()
        assert nv.waiting.wait(10), "a sample stuck in NVML"
        clock.now += 4.9
        report = m.report()
        assert report is not None and report.healthy, "within the deadline the previous sample stands"
        clock.now += 0.6
        hung = m.report()
        assert hung is not None and not hung.healthy and hung.reason == "gpu probe hung 5.5 s (deadline 5 s)"
        assert health_proto(None, hung).verdict.reason == hung.reason
        nv.answering.set()
        wait_for(lambda: (r := m.report()) is not None and r.healthy, 10, "healthy again once NVML answers")
    finally:
        nv.answering.set()
        m.stop()


def test_check_now_waits_at_most_the_deadline(tmp_path: Path) -> None:
    nv = HangingNvml()
    m = monitor(tmp_path, nv, deadline_s=0.3)
    m.start()
    try:
        assert m.check_now().healthy
        nv.answering.clear()
        assert nv.waiting.wait(10), "a sample stuck in NVML"
        started = time.monotonic()
        verdict = m.check_now()  # waits for a sample begun after the call: none comes, the deadline ends it
        assert time.monotonic() - started < 2.0
        assert not verdict.healthy and "gpu probe hung" in verdict.reason, verdict.reason
    finally:
        nv.answering.set()
        m.stop()


def test_an_xid_stays_in_every_verdict_until_cleared(tmp_path: Path) -> None:
    nv = HangingNvml()
    m = monitor(tmp_path, nv)
    m.start()
    try:
        nv.xids.append(79)
        assert m.check_now().reason == "XID errors 79 (allowed: 13, 31, 43, 45)"
        for _ in range(3):  # drained once, judged every time
            assert not m.check_now().healthy
            report = m.report()
            assert report is not None and "XID errors 79" in report.reason
        nv.xids.append(13)  # an application fault: allowed, and not kept
        cleared, verdict = m.clear_gpu_faults("reset")
        assert [c.split(" (")[0] for c in cleared] == ["gpu? XID 79"] and verdict.healthy
        assert m.check_now().healthy
    finally:
        m.stop()
