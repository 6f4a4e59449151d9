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
        self._compute = 0.0
        self._data = 0.0
        self._save = False
        self._last: float | None = None

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            self._compute += self.clock() - started

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            self._data += self.clock() - started

    def saved(self) -> None:
        """This step also took a checkpoint: its times are not evidence of a slow node."""
        self._save = True

    def take(self) -> cluster_pb2.StepTiming | None:
        """The step just reported, and the timer reset for the next; None when nothing was timed (a
        job that does not use the timer sends no timing)."""
        now = self.clock()
        wall = now - self._last if self._last is not None else 0.0
        self._last = now
        if self._compute <= 0 and self._data <= 0:
            self._save = False
            return None
        out = cluster_pb2.StepTiming(compute_s=self._compute, wall_s=wall, data_s=self._data, save=self._save,
                                     rank=self.rank)
        self._compute, self._data, self._save = 0.0, 0.0, False
        return out


__all__ = ["StepTimer"]
