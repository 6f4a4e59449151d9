"""When to snapshot into memory and when to persist to disk: the save cadence as a pure policy.

Lost work per failure is about half the interval between the checkpoints a restore can use, plus
the recovery time. A durable checkpoint every 1000 steps (the deployment guide's figure) loses tens
of minutes at a few seconds a step; a snapshot in memory, replicated to a peer, every step loses at
most one. The memory snapshot is taken every ``memory_every_steps`` (default 1) unless its stall
would cost more than ``max_stall_fraction`` of the step time, in which case the interval widens just
enough; durable persistence follows ``persist_every_steps`` and/or ``persist_every_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CadencePolicy:
    memory_every_steps: int = 1  # 0: no memory snapshots
    persist_every_steps: int = 1000  # 0: not by steps
    persist_every_s: float = 0.0  # 0: not by time
    max_stall_fraction: float = 0.1  # a memory snapshot may hold the loop this share of a step at most

    def __post_init__(self) -> None:
        if self.memory_every_steps < 0 or self.persist_every_steps < 0 or self.persist_every_s < 0:
            raise ValueError("cadence intervals must be >= 0 (0 turns that trigger off)")
        if self.persist_every_steps == 0 and self.persist_every_s == 0:
            raise ValueError("durable checkpoints need persist_every_steps or persist_every_s")
        if not 0 < self.max_stall_fraction <= 1:
            raise ValueError(f"max_stall_fraction must be in (0, 1], got {self.max_stall_fraction}")

    def describe(self) -> str:
        """The policy as the catalog keeps it with each step (``ftctl checkpoints list``), readable by
        people and by :meth:`parse`: ``memory_every_steps=1 persist_every_steps=1000 persist_every_s=0``."""
        return (f"memory_every_steps={self.memory_every_steps} persist_every_steps={self.persist_every_steps} "
                f"persist_every_s={self.persist_every_s:g}")

    @classmethod
    def parse(cls, text: str) -> CadencePolicy:
        """The inverse of :meth:`describe` (fields left out keep their defaults); ``ValueError`` for
        anything else."""
        fields: dict[str, float] = {}
        for part in text.split():
            name, sep, value = part.partition("=")
            if not sep or name not in ("memory_every_steps", "persist_every_steps", "persist_every_s",
                                       "max_stall_fraction"):
                raise ValueError(f"not a cadence setting: {part!r}")
            fields[name] = float(value)
        return cls(memory_every_steps=int(fields.get("memory_every_steps", cls.memory_every_steps)),
                   persist_every_steps=int(fields.get("persist_every_steps", cls.persist_every_steps)),
                   persist_every_s=fields.get("persist_every_s", cls.persist_every_s),
                   max_stall_fraction=fields.get("max_stall_fraction", cls.max_stall_fraction))


@dataclass(frozen=True)
class Decision:
    memory: bool
    persist: bool
    reason: str


def memory_interval(policy: CadencePolicy, stall_s: float, step_s: float) -> int:
    """Steps between memory snapshots: the configured interval, widened while the measured snapshot
    stall exceeds ``max_stall_fraction`` of the step time (0 when snapshots are off). A widened
    interval is the configured one times a power of two: every rank measures its own stall, and ranks
    that widen differently must still snapshot common steps (every multiple of the widest interval),
    or no step would ever be complete in memory."""
    every = policy.memory_every_steps
    if every == 0:
        return 0
    if stall_s <= 0 or step_s <= 0:
        return every
    needed = math.ceil(stall_s / (policy.max_stall_fraction * step_s))
    if needed <= every:
        return every
    return int(every * 2 ** math.ceil(math.log2(math.ceil(needed / every))))


def decide(policy: CadencePolicy, step: int, now_s: float, last_persist_step: int, last_persist_s: float,
           stall_s: float = 0.0, step_s: float = 0.0) -> Decision:
    """What to save at ``step``; a persisted step is snapshotted in memory too (it is the newest)."""
    persist_why = ""
    if policy.persist_every_steps and (last_persist_step < 0 or step - last_persist_step >= policy.persist_every_steps):
        persist_why = f"{policy.persist_every_steps} steps since the last durable checkpoint"
    elif policy.persist_every_s and now_s - last_persist_s >= policy.persist_every_s:
        persist_why = f"{policy.persist_every_s:g}s since the last durable checkpoint"
    every = memory_interval(policy, stall_s, step_s)
    memory = bool(persist_why) or (every > 0 and step % every == 0)
    if persist_why:
        return Decision(True, True, persist_why)
    if memory:
        widened = f" (widened from {policy.memory_every_steps}: stall {stall_s * 1e3:.1f} ms)" \
            if every > policy.memory_every_steps else ""
        return Decision(True, False, f"memory snapshot every {every} step(s){widened}")
    return Decision(False, False, f"next memory snapshot in {every - step % every} step(s)" if every else
                    "memory snapshots off")
