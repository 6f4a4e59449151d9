"""A job's restore floor: the newest step a leader has answered as its restore target, kept in etcd.

Memory snapshots are soft state (memory_ledger.py). A new leader that took the last leader's memory
ledger over from its mirror (memory_mirror.py) may miss the reports of the mirror's last moments, and
one of them may have made the step the last leader answered complete. The floor closes that gap: a
leader writes it before it first answers a newer step, and a new leader answering from the mirror waits
for the agents' own reports while its answer would be older than the floor. One guarded put per step
newly answered (restore targets are asked when a job (re)starts, not per memory snapshot), so etcd's
write rate stays independent of the memory cadence.

A rollback (an operator's or a step anomaly's) moves a job back on purpose: a floor pinned under an
older rollback (or none) no longer holds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftd.v1 import checkpoint_pb2

from . import errors

if TYPE_CHECKING:
    from .leader_state import LeaderState
    from .view import ClusterView

PREFIX = "floors/"


@dataclass(frozen=True)
class Floor:
    step: int
    rollback_at: float = 0.0  # the at_unix_s of the job's rollback in force when pinned (0: none)


def key(job: str) -> str:
    return f"{PREFIX}{job}"


def encode(floor: Floor) -> bytes:
    return json.dumps({"step": floor.step, "rollback_at": floor.rollback_at}, sort_keys=True).encode()


def decode(raw: bytes) -> Floor:
    """Raises ValueError naming what is wrong (the view reports it and goes on without the floor)."""
    try:
        data = json.loads(raw)
        step, at = int(data["step"]), float(data.get("rollback_at", 0.0))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a restore floor: {type(exc).__name__}: {exc}") from exc
    if step < 0:
        raise ValueError(f"not a restore floor: step {step}")
    return Floor(step, at)


def load(kv: Mapping[str, bytes]) -> tuple[dict[str, Floor], list[str]]:
    """The floors among a snapshot's keys, and a problem line per corrupt one (skipped)."""
    floors: dict[str, Floor] = {}
    problems: list[str] = []
    for name, raw in kv.items():
        if name.startswith(PREFIX):
            try:
                floors[name[len(PREFIX):]] = decode(raw)
            except ValueError as exc:
                problems.append(f"restore floor {name!r} is corrupt: {exc}")
    return floors, problems


def floor_of(floors: Mapping[str, Floor], job: str, rollback_at: float | None) -> int | None:
    """The step no restore target of ``job`` may go below for want of a report, or None: none pinned,
    or pinned before the job's current rollback (``rollback_at``: its at_unix_s, None for none)."""
    floor = floors.get(job)
    if floor is None or floor.rollback_at != (rollback_at or 0.0):
        return None
    return floor.step


def floor_wait(now: float, since: float, deadline_s: float, step: int | None, floor: int | None,
               unheard: Iterable[str]) -> tuple[tuple[str, ...], float]:
    """Whether an answer of ``step`` (None: nothing found) by a leader whose memory ledger came partly
    from its mirror waits: while it is older than ``floor`` and some node of the job's world has not
    reported to this leader itself (``unheard``), up to ``deadline_s`` after ``since`` (the election).
    After the deadline it is answered (the reason says it is older than the floor). Returns the nodes
    waited for (empty: answer now) and the seconds left."""
    if floor is None or (step is not None and step >= floor):
        return (), 0.0
    waiting = tuple(sorted(unheard))
    left = since + deadline_s - now
    if not waiting or left <= 0:
        return (), 0.0
    return waiting, left


def below_reason(step: int | None, floor: int | None) -> str:
    """What an answer older than the floor adds to its reason."""
    if floor is None or (step is not None and step >= floor):
        return ""
    return (f"; older than step {floor}, which a leader answered before (some memory copy of it is gone, or "
            "its report did not come)")


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


__all__ = ["PREFIX", "Floor", "FloorKeeper", "below_reason", "decode", "encode", "floor_of", "floor_wait", "key",
           "load"]
