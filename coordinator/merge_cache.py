"""The leader's cache of each job's durable records merged with its memory snapshots
(coordinator/memory_ledger.py, coordinator/memory_merge.py): restore targets and listings read it, and
after a failure every rank asks for the same target at once.

A merge is kept until the ledger, the durable records or the nodes' states change; one that only newer
memory reports changed is rebuilt at once when cheap and otherwise at most ``merge_due`` allows. An
expensive rebuild asked for by a restore target (:meth:`MergeCache.prepare`) runs on a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ftd.checkpoints import catalog as rules

from . import memory_ledger as ledger
from .leader_state import LeaderState

OFFLOAD_S = 0.02  # a merge this slow (or never built) is rebuilt on a worker thread before a restore target
MAX_JOBS = 16  # merges kept: more jobs than this at once and the cache starts over

Key = tuple[int, int, int]  # (the ledger's generation or settled count, the durable generation, id(view))
Plan = tuple[Key, Key, Callable[[], list[rules.CheckpointRecord]]]  # key, settled key, the merge to run


class MergeCache:
    def __init__(self, state: LeaderState, memory: ledger.MemoryLedger, clock: Callable[[], float],
                 held: Callable[[str, int, int | None], int | None]) -> None:
        self.state, self.memory, self.clock, self.held = state, memory, clock, held
        self.durable = 0  # bumped with every change of the durable records (durable_changed)
        # job -> (key, merged, settled key, built at, build seconds): see memory_ledger.merge_due
        self._merged: dict[str, tuple[Key, list[rules.CheckpointRecord], Key, float, float]] = {}
        self._pending: dict[str, asyncio.Task[None]] = {}  # job -> its merge rebuilding on a thread

    def durable_changed(self) -> None:
        self.durable += 1

    def key_of(self, job: str) -> Key | None:
        """What the job's cached merge was built from (a restore target cached with it is as fresh)."""
        cached = self._merged.get(job)
        return cached[0] if cached is not None else None

    def merged(self, job: str) -> list[rules.CheckpointRecord]:
        """The job's durable records merged with the memory snapshots of its alive nodes."""
        plan = self._plan(job)
        if isinstance(plan, list):
            return plan
        began = time.perf_counter()
        return self._store(job, plan, plan[2](), time.perf_counter() - began)

    async def prepare(self, job: str) -> None:
        """Rebuilds the job's merge on a worker thread when it is due and was expensive (OFFLOAD_S or
        more: 16,000 ranks take 0.3-1 s) or never built (a new leader's first), so that :meth:`merged`
        then serves it from the cache. The event loop meanwhile keeps reading streams and beacons at
        about half speed (the GIL is shared) instead of stopping for it: at a failover of 2,000 nodes
        such stops of seconds let live nodes' silences count. Concurrent askers await the same rebuild."""
        task = self._pending.get(job)
        if task is None:
            cached = self._merged.get(job)
            if cached is not None and cached[4] < OFFLOAD_S:
                return  # cheap: merged() builds it inline
            plan = self._plan(job)
            if isinstance(plan, list):
                return
            task = self._pending[job] = asyncio.create_task(self._rebuild(job, plan))
        await asyncio.shield(task)

    async def _rebuild(self, job: str, plan: Plan) -> None:
        try:
            began = time.perf_counter()
            merged = await asyncio.to_thread(plan[2])
            self._store(job, plan, merged, time.perf_counter() - began)
        finally:
            self._pending.pop(job, None)

    def _plan(self, job: str) -> list[rules.CheckpointRecord] | Plan:
        """The cached merge if it serves (memory_ledger.merge_due), else the plan of a new one, its inputs
        taken now (memory_ledger.MemoryLedger.merge_of)."""
        view = self.state.require_leader()
        self.memory.gone(view, self.clock())  # a dead node's report goes: its memory died with it
        key = (self.memory.generation, self.durable, id(view))
        settled = (self.memory.settled, self.durable, id(view))
        cached = self._merged.get(job)
        if cached is not None and (cached[0] == key or (cached[2] == settled
                                   and not ledger.merge_due(self.clock(), cached[3], cached[4]))):
            return cached[1]
        durable = [r for (j, _), r in view.catalog.items() if j == job]
        state = view.jobs.get(job)
        suspect = (state.suspect_from, state.suspect_unix_s) if state is not None and state.suspect_from >= 0 else None
        return key, settled, self.memory.merge_of(job, durable, view.rollbacks.get(job),
                                                  lambda epoch, round_: self.held(job, epoch, round_), suspect)

    def _store(self, job: str, plan: Plan, merged: list[rules.CheckpointRecord],
               took_s: float) -> list[rules.CheckpointRecord]:
        """Caches a merge as built from the state its plan took, counted as built when it finished (one
        that ran on a thread for longer than merge_due's age is not rebuilt at once)."""
        if len(self._merged) >= MAX_JOBS:
            self._merged.clear()
        self._merged[job] = (plan[0], merged, plan[1], self.clock(), took_s)
        return merged
