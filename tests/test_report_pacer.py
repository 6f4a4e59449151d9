"""The memory-report pacer (coordinator/report_pacer.py): a step's burst of reports is taken a slice of
the loop's time at a stretch, with the loop's other work (the detection tick) between slices; the newest
report per node; nothing queued outlives the term. A clock that moves only when a report is taken."""

from __future__ import annotations

import asyncio

from ftd.coordinator import errors
from ftd.coordinator.report_pacer import ReportPacer
from ftd.v1 import coordinator_pb2

COST_S = 0.01  # what each report costs on the pacer's clock


class Ledger:
    def __init__(self) -> None:
        self.now = 0.0
        self.taken: list[tuple[str, int]] = []
        self.fail: dict[str, Exception] = {}

    def clock(self) -> float:
        return self.now

    def take(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport) -> None:
        self.now += COST_S
        if node in self.fail:
            raise self.fail[node]
        self.taken.append((node, report.version))


def report(version: int) -> coordinator_pb2.MemoryReport:
    return coordinator_pb2.MemoryReport(version=version)


def pacer(ledger: Ledger) -> tuple[ReportPacer, list[int]]:
    deferred: list[int] = []
    p = ReportPacer(ledger.take, slice_s=0.025, clock=ledger.clock, on_deferred=lambda: deferred.append(1))
    p.enabled = True
    return p, deferred


async def settle(p: ReportPacer, bound: int = 100) -> None:
    for _ in range(bound):  # a bounded number of the loop's passes
        if not p.pending and (p._task is None or p._task.done()):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still queued after {bound} passes: {list(p.pending)}")


def test_a_burst_is_taken_in_slices_with_the_loops_other_work_between_them() -> None:
    async def scenario() -> None:
        ledger = Ledger()
        p, deferred = pacer(ledger)
        ticks: list[int] = []  # how many reports were taken when each "tick" ran
        loop = asyncio.get_running_loop()

        def tick() -> None:
            ticks.append(len(ledger.taken))
            if len(ticks) < 20:
                loop.call_soon(tick)

        loop.call_soon(tick)
        for n in range(12):  # one pass of the loop delivers twelve reports
            p.offer(f"n{n:02d}", "i", report(1))
        assert len(ledger.taken) == 3 and len(deferred) == 9, "taken at once until the slice was spent"
        await settle(p)
        assert [node for node, _ in ledger.taken] == [f"n{n:02d}" for n in range(12)], "in arrival order"
        assert {3, 6, 9} <= set(ticks) and max(ticks) <= 12, f"the loop ran between slices of three: {ticks}"

    asyncio.run(scenario())


def test_a_newer_report_of_a_queued_node_replaces_it_and_a_quiet_pass_takes_at_once_again() -> None:
    async def scenario() -> None:
        ledger = Ledger()
        p, _ = pacer(ledger)
        for n in range(3):
            p.offer(f"n{n}", "i", report(1))
        p.offer("n1", "i", report(2))  # queued behind the spent slice
        p.offer("n0", "i", report(2))
        p.offer("n1", "i", report(3))  # replaces n1's queued report, and waits behind n0's
        await settle(p)
        assert ledger.taken == [("n0", 1), ("n1", 1), ("n2", 1), ("n0", 2), ("n1", 3)], ledger.taken
        await asyncio.sleep(0)  # a new pass of the loop: its slice is unspent
        p.offer("n3", "i", report(1))
        assert ledger.taken[-1] == ("n3", 1)

    asyncio.run(scenario())


def test_the_queue_ends_with_the_term_and_one_bad_report_strands_no_other() -> None:
    async def scenario() -> None:
        ledger = Ledger()
        p, _ = pacer(ledger)
        ledger.fail["n3"] = ValueError("a bug")
        for n in range(6):
            p.offer(f"n{n}", "i", report(1))
        await settle(p)
        assert [n for n, _ in ledger.taken] == ["n0", "n1", "n2", "n4", "n5"]
        await asyncio.sleep(0)
        ledger.fail["n9"] = errors.NotLeader("c0", "", "stepped down")  # the first one queued
        for n in range(6, 12):
            p.offer(f"n{n}", "i", report(1))
        await settle(p)
        assert [n for n, _ in ledger.taken][5:] == ["n6", "n7", "n8"], "not the leader: the rest is dropped"
        await asyncio.sleep(0)
        for n in range(12, 16):
            p.offer(f"n{n}", "i", report(1))
        p.clear()  # a step-down
        await settle(p)
        assert [n for n, _ in ledger.taken][8:] == ["n12", "n13", "n14"], "n15 was queued when the term ended"

    asyncio.run(scenario())


def test_outside_a_running_loop_or_when_off_every_report_is_taken_at_once() -> None:
    ledger = Ledger()
    p = ReportPacer(ledger.take, slice_s=0.0, clock=ledger.clock)
    p.enabled = True
    for n in range(5):
        p.offer(f"n{n}", "i", report(1))
    assert len(ledger.taken) == 5

    async def scenario() -> None:
        off = ReportPacer(ledger.take, slice_s=0.0, clock=ledger.clock)  # a controller driven by hand
        for n in range(5):
            off.offer(f"m{n}", "i", report(1))
        assert len(ledger.taken) == 10 and not off.pending

    asyncio.run(scenario())
