"""Per-step timing of one rank, for the coordinator's straggler detector.

In a synchronous job every rank's step takes as long as the slowest rank's, so the wall time of a
step cannot tell a straggler from its victims. What differs is the time each rank spends *computing*
(the rest it waits in collectives for the slowest). The training wraps what it computes::

    with ckpt.timing.data():
        batch = next(loader)
    with ckpt.timing.compute():
        loss = model(batch).loss
    loss.backward()           # with FSDP/DDP this overlaps communication: leave it out, or not
    ckpt.report_step(step)    # sends this step's compute, data and wall time

Only what the job wraps counts as compute; the detector compares nodes by it, so it must be the
same code on every rank. On a GPU, wrap with a synchronize (or CUDA events) around the phase: kernel
launches return before the kernels finish.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from ftd.v1 import cluster_pb2


class StepTimer:
    def __init__(self, rank: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank = rank
        self.clock = clock
        self._phases = {"compute": 0.0, "data": 0.0}
        self._save = False
        self._last: float | None = None
        self.last: cluster_pb2.StepTiming | None = None  # what the last take() returned (the job may log it)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            self._phases[name] += self.clock() - started

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Time the rank spends computing (not waiting for other ranks)."""
        return self._phase("compute")

    def data(self) -> contextlib.AbstractContextManager[None]:
        """Time the rank waits for its next batch."""
        return self._phase("data")

    def saved(self) -> None:
        """This step also took a checkpoint: its times are not evidence of a slow node."""
        self._save = True

    def take(self) -> cluster_pb2.StepTiming | None:
        """The step just reported, and the timer reset for the next; None when nothing was timed (a
        job that does not use the timer sends no timing)."""
        now = self.clock()
        wall = now - self._last if self._last is not None else 0.0
        self._last = now
        compute, data = self._phases["compute"], self._phases["data"]
        self._phases = {"compute": 0.0, "data": 0.0}
        save, self._save = self._save, False
        if compute <= 0 and data <= 0:
            self.last = None
            return None
        self.last = cluster_pb2.StepTiming(compute_s=compute, wall_s=wall, data_s=data, save=save, rank=self.rank)
        return self.last


__all__ = ["StepTimer"]
