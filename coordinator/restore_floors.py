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

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


__all__ = ["PREFIX", "Floor", "below_reason", "decode", "encode", "floor_of", "floor_wait", "key", "load"]
