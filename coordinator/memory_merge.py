"""The merge of a job's durable checkpoint records (etcd) with the memory snapshots the leader's ledger
holds (coordinator/memory_ledger.py): pure functions of the snapshots, built on demand for restore
targets and listings. At 16,000 ranks a merge handles ~64,000 snapshots; it runs with the garbage
collector paused (:func:`collector_paused`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from ftd.checkpoints import catalog as rules
from ftd.checkpoints.layout import FileEntry


class Snap(NamedTuple):
    """One memory snapshot as the leader keeps it (a tuple: cheap to make, a few µs per snapshot)."""

    node: str  # where it is: the reporting node (its location on the memory tier)
    writer: str  # the node whose rank it is (the reporting node for its own ranks, the owner for a replica)
    replica: bool
    job: str
    step: int
    epoch: int
    rank: int
    world_size: int
    format: str
    files: tuple[FileEntry, ...]
    checksum: str
    created: float
    restored: int | None
    round: int  # -1: not known
    cadence: str
    size: int  # the files' bytes, summed once when reported (a merge reads it for every rank)

    @property
    def bytes(self) -> int:
        return self.size


def _older(epoch: int, round_: int, than: tuple[int, int]) -> bool:
    """As :func:`~ftd.checkpoints.catalog.superseded_by`: an older epoch, or the same epoch's older round."""
    return epoch < than[0] or (than[1] >= 0 and epoch == than[0] and 0 <= round_ < than[1])


def abandoned_floor(snaps: Sequence[Snap], durable: Sequence[rules.CheckpointRecord]) -> tuple[tuple[int, int], int]:
    """The newest timeline (epoch, round) among the job's own snapshots and durable records, and the
    first step it abandons in older timelines: the step after the one it restored, else the oldest
    step it saved (what :func:`~ftd.checkpoints.catalog.superseded_by` did at each commit)."""
    newest = max({(s.epoch, s.round) for s in snaps if not s.replica} | {(r.epoch, r.round) for r in durable},
                 default=(-1, -1))
    mine = [s for s in snaps if not s.replica and (s.epoch, s.round) == newest]
    restored = [s.restored for s in mine if s.restored is not None]
    if restored:
        return newest, min(restored) + 1
    steps = [s.step for s in mine] + [r.step for r in durable if (r.epoch, r.round) == newest]
    return newest, min(steps, default=0)


def merge(durable: Sequence[rules.CheckpointRecord], snaps: Sequence[Snap], rollback: rules.Rollback | None = None,
          held: Callable[[int, int | None], int | None] = lambda epoch, round_: None,
          invalid: Mapping[int, str] | None = None,
          bad: Mapping[tuple[int, int], Mapping[str, str]] | None = None,
          dead: Collection[str] = ()) -> list[rules.CheckpointRecord]:
    """The job's records: the durable ones (etcd) with the memory copies of ``snaps`` (one job's) added, and
    records built for steps only in memory. A snapshot reported by a node now ``dead`` (or fenced) still says
    what its rank's shard was (as a committed shard did in etcd: a replicated restore reads the step from the
    other ranks) but adds no copy: its memory died with it. The commit-time rules, at merge time: an older
    timeline's steps the newest abandons are left out (durable ones too: a newer epoch that only saved to memory
    so far abandons them as its first commit did); a rollback's removed steps saved before it and ``held`` steps
    (a step anomaly being rolled back: ``held(epoch, round)`` the first step not to count) count no memory copy;
    a copy whose checksum is not the rank's (the durable shard's, else the owner's own snapshot's) does not
    count. ``invalid``: memory-only steps marked invalid (step -> why); ``bad``: (step, rank) -> {copy key: why}
    of memory copies found corrupt."""
    newest, floor = abandoned_floor(snaps, durable)
    by_step: dict[int, list[Snap]] = {}
    stops: dict[tuple[int, int], int | None] = {}  # (epoch, round) -> held's first step not to count
    for s in snaps:
        if s.step >= floor and _older(s.epoch, s.round, newest):
            continue
        if rollback is not None and s.step > rollback.step and s.created < rollback.at_unix_s:
            continue
        timeline = (s.epoch, s.round)
        if timeline not in stops:
            stops[timeline] = held(s.epoch, s.round if s.round >= 0 else None)
        stop = stops[timeline]
        if stop is not None and s.step >= stop:
            continue
        group = by_step.get(s.step)
        if group is None:
            by_step[s.step] = [s]
        else:
            group.append(s)
    out = {r.step: r for r in durable if not (r.step >= floor and _older(r.epoch, r.round, newest))}
    for step, group in by_step.items():
        record = _with_memory(out.get(step), group, (invalid or {}).get(step, ""), bad or {}, dead)
        if record is not None:
            out[step] = record
    return [out[s] for s in sorted(out)]


def _with_memory(base: rules.CheckpointRecord | None, group: list[Snap], invalid: str,
                 bad: Mapping[tuple[int, int], Mapping[str, str]],
                 dead: Collection[str] = ()) -> rules.CheckpointRecord | None:
    """One step: ``base`` (durable, or None) with the memory copies of ``group`` added (the newest
    timeline's shape; own snapshots define a missing rank before replicas do). Built in one pass over
    the own snapshots then the replicas, without sorting: 16,000 ranks and their replicas take a fraction
    of a second."""
    if base is None:
        first = max(group, key=lambda s: (s.epoch, s.round, not s.replica))
        base = rules.CheckpointRecord(first.job, first.step, first.epoch, first.world_size, first.format,
                                      min(s.created for s in group), {}, invalid, first.cadence, first.round)
    epoch, world, fmt = base.epoch, base.world_size, base.format
    durable = base.shards
    defined: dict[int, Snap] = {}  # ranks the durable record lacks: the snapshot that defines each
    copies: dict[int, set[rules.CopyRef]] = {}
    refs: dict[str, rules.CopyRef] = {}  # one CopyRef per node (16,000 ranks: a few thousand nodes)
    own = [s for s in group if not s.replica]
    for s in (*own, *(s for s in group if s.replica)) if len(own) != len(group) else own:
        if s.epoch != epoch or s.world_size != world or s.format != fmt:
            continue  # another timeline's bytes under this step number
        rank = s.rank
        shard = durable.get(rank)
        if shard is not None:
            checksum = shard.checksum
        else:
            defining = defined.get(rank)
            if defining is None:
                defined[rank] = defining = s
            checksum = defining.checksum
        if s.checksum != checksum:
            continue  # other bytes than the rank's: the copy does not count
        mem = copies.get(rank)
        if mem is None:
            copies[rank] = mem = set()
        node = s.node
        if node not in dead:
            ref = refs.get(node)
            if ref is None:
                refs[node] = ref = rules.CopyRef(rules.MEMORY, node)
            mem.add(ref)
    if not copies or (not any(copies.values()) and all(rank in durable for rank in copies)):
        return None
    shards = dict(durable)
    step = base.step
    for rank, mem in copies.items():
        marks = bad.get((step, rank))
        shard = durable.get(rank)
        if shard is None:
            d = defined[rank]
            shards[rank] = rules.ShardRecord(rank, d.bytes, d.checksum, d.files, frozenset(mem),
                                             dict(marks) if marks else {}, d.created, d.writer)
        else:
            shards[rank] = rules.ShardRecord(rank, shard.bytes, shard.checksum, shard.files, shard.copies | mem,
                                             {**shard.bad, **marks} if marks else shard.bad, shard.committed_unix_s,
                                             shard.writer)
    return replace(base, shards=shards, invalid_reason=base.invalid_reason or invalid)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a burst of allocations that all survive (a merge of
    16,000 ranks makes ~100,000 objects and no cycle): its passes would walk every object the leader
    holds again and again, more than half of such a merge's time (0.5 s -> 0.22 s measured)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
