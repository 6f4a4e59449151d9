"""The leader's side of the restore floor (restore_floors.py): pins a job's floor in etcd before a newer
step is first answered, and holds back an answer from a mirrored memory ledger that is older than it.
Apart from the floor's pure rules because it needs the leader's state, which the view that loads the
floors is part of."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ftd.v1 import checkpoint_pb2

from . import errors
from .leader_state import LeaderState
from .restore_floors import Floor, below_reason, encode, floor_of, floor_wait, key
from .view import ClusterView


class FloorKeeper:
    """The leader's side: pins a job's floor before a newer step is first answered, and holds back an
    answer from a mirrored ledger that is older than it."""

    def __init__(self, state: LeaderState, address: str = "") -> None:
        self.state, self.address = state, address
        # job -> (step, the write in flight, its rollback): 16,000 ranks asking at once share one write
        self._pins: dict[str, tuple[int, asyncio.Future[None], float]] = {}

    @staticmethod
    def _rollback_at(view: ClusterView, job: str) -> float:
        rb = view.rollbacks.get(job)
        return rb.at_unix_s if rb is not None else 0.0

    async def pin(self, job: str, answer: checkpoint_pb2.RestoreTarget) -> None:
        """Before ``answer`` is given: its step becomes the job's floor in etcd unless one as new is there."""
        if not answer.found:
            return
        view = self.state.require_leader()
        at, step = self._rollback_at(view, job), answer.checkpoint.step
        current = floor_of(view.floors, job, at)
        if current is not None and step <= current:
            return
        pending = self._pins.get(job)
        failed = pending is not None and pending[1].done() and (pending[1].cancelled()
                                                                or pending[1].exception() is not None)
        if pending is None or failed or pending[0] < step or pending[2] != at:
            pending = (step, asyncio.ensure_future(self._write(job, Floor(step, at))), at)
            self._pins[job] = pending
        await asyncio.shield(pending[1])

    async def _write(self, job: str, floor: Floor) -> None:
        await self.state.commit("restore_floor", kv_puts={key(job): encode(floor)})
        view = self.state.require_leader()
        old = view.floors.get(job)
        if old is None or old.rollback_at != floor.rollback_at or old.step < floor.step:
            view.floors[job] = floor

    def check(self, view: ClusterView, job: str, answer: checkpoint_pb2.RestoreTarget, now: float, since: float,
              deadline_s: float, unheard: Iterable[str]) -> checkpoint_pb2.RestoreTarget:
        """``answer`` from a ledger partly mirrored (``unheard``: nodes of the job's world known only from
        the mirror): :class:`~.errors.ReportsPending` while it is older than the floor and the deadline has
        not passed; after it, the answer with why it is older."""
        floor = floor_of(view.floors, job, self._rollback_at(view, job))
        step = answer.checkpoint.step if answer.found else None
        waiting, left = floor_wait(now, since, deadline_s, step, floor, unheard)
        if waiting:
            raise errors.ReportsPending(job, waiting, left, self.address)
        why = below_reason(step, floor)
        if not why:
            return answer
        older = checkpoint_pb2.RestoreTarget()
        older.CopyFrom(answer)
        older.reason += why
        return older

    async def forget(self, job: str) -> None:
        """The job's checkpoints were forgotten: so is its floor."""
        view = self.state.require_leader()
        if job in view.floors:
            await self.state.commit("checkpoint", kv_deletes=[key(job)])
            view.floors.pop(job, None)
        self._pins.pop(job, None)


__all__ = ["FloorKeeper"]
