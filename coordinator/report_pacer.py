"""Memory reports taken in slices of the event loop's time, so that a step's burst of them cannot hold
the detection tick back.

Training is synchronous: every rank of a job snapshots the same step within milliseconds, so every
node's memory report reaches the leader at once. At 2,000 nodes x 8 ranks that is 0.3-0.5 s of parsing
(bench/coordinator_scale.py), and taken as they arrived the reports held the 0.1 s tick back for 0.4-0.8 s
every step; past ``stall_after_s`` the leader takes the gap for a stall of its own and grants every node
``dead_after_s`` of grace, which declared a real death 2 s late (a p99 detection of 4.5 s in one run).

A report is taken at once while the reports taken in the loop's current pass cost less than ``slice_s``
(every report in a small cluster, and in tests). Past that the rest wait in a queue, the newest per node
(an older one still queued is replaced: the ledger would replace it anyway), which a task works off
``slice_s`` at a time, yielding to the loop in between: the tick, beacons and other messages run at
least that often. Nothing is dropped but on a step-down (:meth:`clear`), when the reports belong to a
term that ended; what is queued is at most one report per node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ftd.v1 import coordinator_pb2

from . import errors

log = logging.getLogger("ftd.coordinator.report_pacer")
SLICE_S = 0.02  # the loop's time reports may take at a stretch (5 % of detection's 0.4 s resolution)

Take = Callable[[str, str, coordinator_pb2.MemoryReport], None]


class ReportPacer:
    """``offer`` is the membership's ``on_memory``; ``take`` the controller's (ledger and mirror).
    ``enabled`` False (a controller driven by hand in tests) takes every report at once."""

    def __init__(self, take: Take, slice_s: float = SLICE_S, clock: Callable[[], float] = time.perf_counter,
                 on_deferred: Callable[[], None] = lambda: None) -> None:
        self._take = take
        self.slice_s = slice_s
        self.clock = clock
        self.on_deferred = on_deferred  # a report queued (a metric)
        self.enabled = False
        self.pending: dict[str, tuple[str, coordinator_pb2.MemoryReport]] = {}  # node -> newest queued
        self._spent = 0.0  # report time in the loop's current pass
        self._reset_due = False
        self._task: asyncio.Task[None] | None = None

    def offer(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport) -> None:
        loop = _running_loop() if self.enabled else None
        if loop is None or (not self.pending and self._spent < self.slice_s):
            began = self.clock()
            self._take(node, incarnation, report)  # errors (NotLeader) go to the stream, as before
            if loop is not None:
                self._spent += self.clock() - began
                if not self._reset_due:  # runs after every callback ready now: the pass's end
                    self._reset_due = True
                    loop.call_soon(self._reset)
            return
        self.pending.pop(node, None)  # the newest goes to the back: no node waits twice in a burst
        self.pending[node] = (incarnation, report)
        self.on_deferred()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._work(), name="memory-reports")

    def clear(self) -> None:
        """The term ended (step-down, suspension, stop): what is queued belongs to its streams."""
        self.pending.clear()

    def _reset(self) -> None:
        self._spent, self._reset_due = 0.0, False

    async def _work(self) -> None:
        while self.pending:
            await asyncio.sleep(0)  # the loop runs what is due (the tick, beacons) before each slice
            began = self.clock()
            while self.pending and self.clock() - began < self.slice_s:
                node = next(iter(self.pending))
                incarnation, report = self.pending.pop(node)
                try:
                    self._take(node, incarnation, report)
                except errors.NotLeader:
                    self.pending.clear()
                except Exception:  # one bad report must not strand the others
                    log.exception("memory report of node %s not taken", node)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
