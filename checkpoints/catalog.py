"""The checkpoint catalog: what the coordinator keeps in etcd, and the pure rules over it.

A checkpoint (job, step) is **valid** only when every rank ``0..world_size-1`` has committed its shard
with a checksum and nobody found it unrecoverable. Each shard records its copies as :class:`CopyRef`
(tier and location: ``ssd@node-3``, ``hdd@shared``, ``s3@s3``) and the copies found corrupt, keyed by
:attr:`CopyRef.key`.

Whoever reads the catalog over gRPC turns each ``CheckpointInfo`` back into a
:class:`CheckpointRecord` with :func:`from_info` (the inverse of :func:`to_info`) and asks it typed
questions (``valid``, ``invalid_reason``, :meth:`ShardRecord.has_good_copy`) instead of parsing
status strings or building copy keys itself.

Rules (pure functions returning a reason, tested without I/O):

* :func:`commit_shard` — admit one rank's shard, refusing anything that contradicts the step;
* :func:`restore_target` — the newest restorable step the restoring job can load: of its world size,
  or of any world size for a job that reshards (``dcp``) or holds replicated state;
* :func:`superseded_by` — the older epochs' steps a new timeline abandons: only those newer than the
  step the new world restored;
* :func:`invalidation_loses_last` — the last restorable step of a job is never invalidated;
* :func:`rollback` — make a step the restore target by removing the newer steps from the catalog;
* :func:`retention` — per tier: keep the newest ``keep`` restorable steps committed *there*, never
  delete an older one before a newer one is committed there, never touch in-progress steps;
* :func:`prune_memory` — the memory tier holds at most :data:`MEM_KEEP` snapshots per rank and node
  (the tier's own rule, :mod:`ftd.storage_backends.memory`): recording a newer one drops the oldest
  copy (and a record left without any copy).

The memory tier (``mem``) is a tier like the others: a copy of rank R's shard in node B's memory is
``CopyRef("mem", "B")``. A step is *in memory* (``on_tier("mem")``) when every rank's shard is in the
memory of :data:`MEM_REPLICAS` nodes (its own and its buddy's).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ftd.storage_backends.memory import KEEP, evictions
from ftd.v1 import checkpoint_pb2

from .layout import FileEntry, ShardManifest

TIERS = ("mem", "ssd", "hdd", "s3")  # fastest first
MEMORY = "mem"
MEM_REPLICAS = 2  # in memory = on the rank's node and on its buddy
MEM_KEEP = KEEP  # memory snapshots held per rank on one node: the newest and the one being written
KV_PREFIX = "ckpt/"
INVALID = "invalid: "  # how status() starts for an invalidated step; from_info() reads it back
UNRESTORABLE = "unrestorable: "  # valid (every shard was committed) but every copy of some rank was proven corrupt
NO_COPY = "no copy left: "  # valid, but some rank's copies are all gone (superseded memory snapshots, deletions)


class CopyRef(NamedTuple):
    """Where one copy of a shard lives: a tier and a location on it (a node id for a node-local
    tier, "shared" or "s3" for shared ones). A tuple, so ``(tier, location)`` pairs compare equal."""

    tier: str
    location: str

    @property
    def key(self) -> str:
        """``"tier@location"``: the key of a corrupt copy in ``ShardRecord.bad`` / ``ShardInfo.bad``,
        and how a copy is named in messages."""
        return f"{self.tier}@{self.location}"

    def __str__(self) -> str:
        return self.key


class CatalogError(ValueError):
    """A catalog change that contradicts what is recorded; ``field`` names the culprit."""

    def __init__(self, field: str, why: str, exists: bool = False) -> None:
        super().__init__(why)
        self.field = field
        self.exists = exists  # True: the thing is already there (ALREADY_EXISTS), else a conflict


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    bytes: int
    checksum: str
    files: tuple[FileEntry, ...]
    copies: frozenset[CopyRef] = frozenset()
    bad: Mapping[str, str] = field(default_factory=dict)  # CopyRef.key -> why it is corrupt
    committed_unix_s: float = 0.0
    writer: str = ""  # the node whose commit created the shard (its certificate's name); "" in process

    def good_copies(self) -> list[CopyRef]:
        return sorted(c for c in self.copies if c.key not in self.bad)

    def has_good_copy(self, copy: CopyRef) -> bool:
        """A copy is recorded at ``copy`` and nobody found it corrupt."""
        return copy in self.copies and copy.key not in self.bad


@dataclass(frozen=True)
class CheckpointRecord:
    job: str
    step: int
    epoch: int
    world_size: int
    format: str
    created_unix_s: float
    shards: Mapping[int, ShardRecord] = field(default_factory=dict)
    invalid_reason: str = ""
    cadence: str = ""  # the job's save cadence when the step was first committed (CadencePolicy.describe)
    round: int = -1  # the job round of the step's first commit (-1: not known); a newer round's timeline abandons it

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.world_size and all(r in self.shards for r in range(self.world_size))

    @property
    def valid(self) -> bool:
        return self.complete and not self.invalid_reason

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards.values())

    def on_tier(self, tier: str) -> bool:
        """Every rank has a good copy on ``tier`` (on ``mem``: in the memory of :data:`MEM_REPLICAS`
        nodes, the rank's own and its buddy's)."""
        need = MEM_REPLICAS if tier == MEMORY else 1
        return self.complete and all(len({loc for t, loc in s.good_copies() if t == tier}) >= need
                                     for s in self.shards.values())

    def readable(self, unreachable: Collection[str] = (), replicated: bool = False) -> bool:
        """Restorable, counting only copies outside the ``unreachable`` locations (dead or fenced
        nodes: their memory and disks cannot be read now). ``replicated`` (every rank holds the same
        state): one rank's reachable good copy serves them all."""
        reach = [any(c.location not in unreachable for c in s.good_copies()) for s in self.shards.values()]
        if replicated:
            return self.valid and self.complete and any(reach)
        return self.restorable and all(reach)

    def unreachable_ranks(self, unreachable: Collection[str]) -> list[int]:
        """Ranks with no good copy outside ``unreachable`` (a replicated restore reads another's)."""
        return sorted(rank for rank, s in self.shards.items()
                      if not any(c.location not in unreachable for c in s.good_copies()))

    @property
    def restorable(self) -> bool:
        """Valid, and every rank still has a copy not known to be corrupt somewhere."""
        return self.valid and all(s.good_copies() for s in self.shards.values())

    @property
    def orphaned(self) -> bool:
        """No copy of any shard is left on any tier: the record describes nothing any more."""
        return all(not s.copies for s in self.shards.values())

    def status(self) -> str:
        if self.invalid_reason:
            return f"{INVALID}{self.invalid_reason}"
        if not self.complete:
            return f"in progress: {len(self.shards)} of {self.world_size} shards committed"
        # "Corrupt" only when a copy was proven so: a rank whose copies were merely pruned (a newer
        # memory snapshot replaced them) or deleted has no copy left, and says that.
        corrupt = sorted(rank for rank, s in self.shards.items() if s.copies and not s.good_copies())
        if corrupt:
            return f"{UNRESTORABLE}every copy of rank(s) {', '.join(map(str, corrupt))} was found corrupt"
        gone = sorted(rank for rank, s in self.shards.items() if not s.copies)
        if gone:
            return (f"{NO_COPY}no copy of rank(s) {', '.join(map(str, gone))} is left (memory snapshots superseded "
                    "or copies deleted)")
        return "valid"


@dataclass(frozen=True)
class Rollback:
    job: str
    step: int
    at_unix_s: float
    superseded: tuple[int, ...] = ()


# ---- rules --------------------------------------------------------------------------------------


def commit_shard(record: CheckpointRecord | None, manifest: ShardManifest, tier: str, location: str,
                 now: float, cadence: str = "", round_: int | None = None,
                 writer: str = "") -> tuple[CheckpointRecord, str]:
    """Admits one shard copy. Returns the new record and what happened; raises :class:`CatalogError`
    when the shard contradicts the step (other world size, epoch or format; an older round than the
    step's; other bytes for a rank already committed). ``cadence`` and ``round_`` (the saving
    process's job round, None: not known) are kept with a new step; ``writer`` (the committing node)
    with a new shard."""
    if tier not in TIERS:
        raise CatalogError("tier", f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
    if record is None:
        record = CheckpointRecord(manifest.job, manifest.step, manifest.epoch, manifest.world_size,
                                  manifest.format, now, cadence=cadence, round=-1 if round_ is None else round_)
    if round_ is not None and round_ < record.round:
        raise CatalogError("round", f"step {manifest.step} of job {manifest.job} was first committed in round "
                                    f"{record.round}; rank {manifest.rank} saves in round {round_}, which is over")
    for name, mine, theirs in (("world_size", manifest.world_size, record.world_size),
                               ("epoch", manifest.epoch, record.epoch), ("format", manifest.format, record.format)):
        if mine != theirs:
            raise CatalogError(name, f"step {manifest.step} of job {manifest.job} has {name} {theirs}; "
                                     f"rank {manifest.rank} reports {mine}")
    if record.invalid_reason:
        raise CatalogError("step", f"step {manifest.step} of job {manifest.job} is invalid "
                                   f"({record.invalid_reason}); save a new step instead")
    shard = record.shards.get(manifest.rank)
    if shard is not None and shard.checksum != manifest.checksum:
        raise CatalogError("rank", f"rank {manifest.rank} of step {manifest.step} is already committed with "
                                   f"checksum {shard.checksum}, not {manifest.checksum}; a step is never rewritten",
                           exists=True)
    copy = CopyRef(tier, location)
    if shard is None:
        shard = ShardRecord(manifest.rank, manifest.total_bytes, manifest.checksum, manifest.files, frozenset([copy]),
                            {}, now, writer)
        what = f"rank {manifest.rank} committed on {copy}"
    else:
        bad = {k: v for k, v in shard.bad.items() if k != copy.key}  # a fresh copy heals a bad one
        shard = replace(shard, copies=shard.copies | {copy}, bad=bad)
        what = f"rank {manifest.rank} copy recorded on {copy}"
    new = replace(record, shards={**record.shards, manifest.rank: shard})
    if new.valid and not record.valid:
        what += f"; step {manifest.step} is now valid ({new.world_size} shards)"
    return new, what


def superseded_by(records: Iterable[CheckpointRecord], manifest: ShardManifest,
                  restored_step: int | None = None, round_: int | None = None) -> list[CheckpointRecord]:
    """The job's records that a shard of a newer epoch abandons. A world change restarts every rank
    from one restore point, so a step saved after it in the new epoch starts a new timeline; the old
    timeline's steps after that point (committed before the failure, perhaps on a node that died)
    must neither block the new saves of the same step numbers nor ever be restored into the new
    timeline (as a rollback removes them).

    ``restored_step``: the step the new world restored (-1: none); only the older epochs' steps
    *newer* than it are abandoned, so the step it resumed from and everything older stays whatever
    step number it saves. ``None`` (an older training side that does not say): the older epochs'
    steps at or after the shard's. A shard of an *older* epoch supersedes nothing:
    :func:`commit_shard` refuses it.

    ``round_``: the saving process's job round (None: not known). A worker restart forms a new round
    in the *same* epoch, and a new timeline with it: the same epoch's steps first committed by older
    rounds are abandoned as an older epoch's are. Without it the new round's rank would find its
    step committed with the old timeline's bytes (a step is never rewritten) while its own write had
    replaced the old timeline's files: the catalog would name bytes no tier holds."""
    floor = manifest.step if restored_step is None else restored_step + 1

    def older(r: CheckpointRecord) -> bool:
        return r.epoch < manifest.epoch or (round_ is not None and r.epoch == manifest.epoch and 0 <= r.round < round_)

    return sorted((r for r in records if r.job == manifest.job and r.step >= floor and older(r)),
                  key=lambda r: r.step)


def add_copy(record: CheckpointRecord, rank: int, tier: str, location: str) -> CheckpointRecord:
    """A verified copy of an already committed shard now exists on ``tier``@``location`` (a
    migration); unlike :func:`commit_shard` this is allowed on an invalid step (it is just a fact)."""
    if tier not in TIERS:
        raise CatalogError("tier", f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
    shard = record.shards.get(rank)
    if shard is None:
        raise CatalogError("rank", f"step {record.step} of job {record.job} has no committed rank {rank}")
    copy = CopyRef(tier, location)
    bad = {k: v for k, v in shard.bad.items() if k != copy.key}
    shard = replace(shard, copies=shard.copies | {copy}, bad=bad)
    return replace(record, shards={**record.shards, rank: shard})


def drop_copy(record: CheckpointRecord, rank: int, tier: str, location: str, corrupt: str = "") -> CheckpointRecord:
    """A copy was deleted (retention) or found corrupt (``corrupt`` says why)."""
    shard = record.shards.get(rank)
    if shard is None:
        return record
    copy = CopyRef(tier, location)
    if corrupt:
        shard = replace(shard, bad={**shard.bad, copy.key: corrupt})
    else:
        shard = replace(shard, copies=shard.copies - {copy})
    return replace(record, shards={**record.shards, rank: shard})


def prune_memory(records: Iterable[CheckpointRecord], rank: int, location: str,
                 keep: int = MEM_KEEP) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """The memory tier at ``location`` holds at most ``keep`` snapshots of ``rank`` (of the records'
    job): the copies of the steps the memory tier's own rule drops
    (:func:`ftd.storage_backends.memory.evictions`, the newest step coming in) are dropped, as the
    node itself deletes them before it writes a new one. Returns (records changed, records left
    without any copy: to delete; a memory snapshot that was never made durable disappears from the
    catalog with its last copy)."""
    copy = CopyRef(MEMORY, location)
    holding = {r.step: r for r in records if (s := r.shards.get(rank)) is not None and copy in s.copies}
    changed: list[CheckpointRecord] = []
    removed: list[CheckpointRecord] = []
    gone = evictions(holding, max(holding), keep) if holding else []
    for record in (holding[step] for step in reversed(gone)):
        new = drop_copy(record, rank, MEMORY, location)
        shard = new.shards[rank]
        if copy.key in shard.bad:
            new = replace(new, shards={**new.shards, rank: replace(shard, bad={
                k: v for k, v in shard.bad.items() if k != copy.key})})
        (removed if new.orphaned else changed).append(new)
    return changed, removed


def loadable(record: CheckpointRecord, world_size: int, fmt: str = "", replicated: bool = False) -> bool:
    """Whether a job of ``world_size`` (0: any) can load ``record``: one of its size, or of any size
    when the job reshards (both ``dcp``: DCP's load-time resharding) or holds replicated state (data
    parallel: any rank's shard is the state)."""
    return (not world_size or record.world_size == world_size or replicated
            or (fmt == "dcp" and record.format == "dcp"))


def restore_target(records: Iterable[CheckpointRecord], rollback_to: Rollback | None = None,
                   world_size: int = 0, unreachable: Collection[str] = (),
                   replicated: bool = False, fmt: str = "") -> tuple[CheckpointRecord | None, str]:
    """The newest valid step that every rank can still read from some tier (a rollback removed
    everything newer than its target).

    With ``world_size`` (the restoring job's), steps it cannot load (:func:`loadable`: another world
    size, and neither both ``dcp`` (``fmt``) nor ``replicated``) are skipped, and the reason names
    them: a torch-format shard of another world size is another rank's state, never this rank's.
    A step of another world size that the job can load is resharded, and the reason says so. When
    no loadable step is left, the newest of another size is the answer and the reason says why it
    cannot be loaded (the training side refuses it by name, never as corruption).

    ``unreachable``: locations (dead or fenced nodes) whose copies cannot be read now; a step that
    some rank could only read from there is skipped (a node's memory dies with it), unless
    ``replicated``: then one reachable rank's copy is enough (every rank holds the same state)."""
    records = list(records)
    valid = sorted((r for r in records if r.readable(unreachable, replicated)), key=lambda r: r.step)
    if not valid:
        return None, "no valid checkpoint: start from scratch"
    skipped = ""
    if world_size:
        usable = [r for r in valid if loadable(r, world_size, fmt, replicated)]
        newer = [r for r in valid if not loadable(r, world_size, fmt, replicated)
                 and (not usable or r.step > usable[-1].step)]
        if newer:
            skipped = "; skipped " + ", ".join(f"step {r.step} (world size {r.world_size})" for r in newer[-3:])
            if len(newer) > 3:
                skipped += f" and {len(newer) - 3} more"
        if not usable:
            newest = valid[-1]
            return newest, (f"no restorable step was saved with world size {world_size}; the newest is step "
                            f"{newest.step} of world size {newest.world_size} (restorable only by a replicated "
                            f"state or, saved in dcp, by a dcp job that reshards it)")
        valid = usable
    newest = valid[-1]
    lost = sorted(r.step for r in records if r.restorable and r.step > newest.step
                  and not r.readable(unreachable, replicated))
    if lost:
        skipped += (f"; skipped step(s) {', '.join(map(str, lost[-3:]))} (a rank's copies are only on unreachable "
                    f"nodes: {', '.join(sorted(unreachable)[:5])})")
    if replicated and (borrow := newest.unreachable_ranks(unreachable)):
        skipped += (f"; rank(s) {', '.join(map(str, borrow))} read another rank's copy (replicated state; their own "
                    f"copies are only on unreachable nodes)")
    if world_size and newest.world_size != world_size:
        skipped += (f"; saved with world size {newest.world_size}: "
                    + ("read as replicated state" if replicated else f"resharded to {world_size}"))
    if rollback_to is not None and rollback_to.step == newest.step:
        return newest, f"step {newest.step}, the rollback target{skipped}"
    return newest, f"newest valid step {newest.step}{skipped}"


def invalidation_loses_last(records: Iterable[CheckpointRecord], step: int) -> str:
    """Why invalidating ``step`` is refused ("" when it is not): it is the job's only restorable step,
    so the next restart would start from scratch. A step whose every copy was found corrupt is not
    restorable any more and may be invalidated; so may any step while an older one is restorable."""
    restorable = [r.step for r in records if r.restorable]
    if restorable == [step]:
        return (f"step {step} is the job's last restorable checkpoint; invalidating it would restart training "
                "from scratch. Report its corrupt copies (RecordCopy corrupt_reason) or roll back instead")
    return ""


def restorable_steps(records: Iterable[CheckpointRecord]) -> dict[int, bool]:
    """step → restorable: what :func:`retention`'s ``valid`` must be given (a step that is valid but
    has no good copy left must not count as one of the kept steps)."""
    return {r.step: r.restorable for r in records}


def rollback(records: Iterable[CheckpointRecord], job: str, step: int,
             now: float) -> tuple[Rollback, list[CheckpointRecord]]:
    """Makes ``step`` the restore target of the next (re)start. Newer steps of the job belong to the
    timeline being abandoned: they are returned to be removed from the catalog (their folders on the
    tiers become unknown and are replaced when the new timeline saves those steps again, or deleted
    by retention once older than the kept steps). Raises :class:`CatalogError` if ``step`` is not a
    valid checkpoint of ``job``."""
    by_step = {r.step: r for r in records if r.job == job}
    target = by_step.get(step)
    if target is None:
        raise CatalogError("step", f"job {job} has no checkpoint at step {step}; known: "
                                   f"{', '.join(str(s) for s in sorted(by_step)) or 'none'}")
    if not target.valid:
        raise CatalogError("step", f"step {step} of job {job} is not valid ({target.status()})")
    removed = [r for s, r in sorted(by_step.items()) if s > step]
    return Rollback(job, step, now, tuple(r.step for r in removed)), removed


@dataclass(frozen=True)
class Deletion:
    step: int
    reason: str


def job_floor(restorable: Mapping[int, bool], keep: int) -> int | None:
    """The oldest of the job's newest ``keep`` restorable steps, over the whole catalog (every tier,
    every node), or None while the job has fewer. ``restorable``: :func:`restorable_steps`. No save
    of an older step is in progress (a job saves forward; a rollback removes the newer records), so a
    shard older than it that is not restorable is garbage on any tier, and one that is will not be
    kept by a tier that receives the job's newer steps."""
    newest = sorted((s for s, ok in restorable.items() if ok), reverse=True)
    return newest[keep - 1] if len(newest) >= keep else None


def retention(on_tier: Mapping[int, bool], valid: Mapping[int, bool], keep: int = 3,
              floor: int | None = None) -> list[Deletion]:
    """What to delete from one tier.

    ``on_tier``: step → whether its shard(s) are committed on this tier (published folders seen by
    listing the tier itself, so the answer survives restarts). ``valid``: step → whether the catalog
    says the checkpoint is **restorable** (:func:`restorable_steps`: valid and every rank has a copy
    not known to be corrupt); missing = unknown to the catalog. A valid step whose copies were all
    found corrupt must not count: keeping it instead of an older restorable one would delete the
    last step training can restart from.

    Keeps the newest ``keep`` restorable steps committed on this tier. Deletes older valid steps only when
    ``keep`` newer valid ones are committed here; deletes invalid or unknown steps only when they are
    older than the oldest kept valid step (newer ones may still be in progress), or older than
    ``floor`` (:func:`job_floor`: the job's own kept steps, wherever they are): a tier holding only
    the stale shards of a rank its node held before (a replaced node back as a spare) would
    otherwise keep them for ever, and the tiering copy them up to be deleted there, every pass.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    committed_valid = sorted((s for s, here in on_tier.items() if here and valid.get(s)), reverse=True)
    kept = committed_valid[:keep]
    out = [Deletion(s, f"older than the {keep} newest valid checkpoints on this tier ({', '.join(map(str, kept))})")
           for s in committed_valid[keep:]]
    here_floor = kept[-1] if len(kept) == keep else None
    for s in sorted(on_tier):
        if valid.get(s):
            continue
        why = "invalid" if s in valid else "unknown to the catalog"
        if here_floor is not None and s < here_floor:
            out.append(Deletion(s, f"{why} and older than kept step {here_floor}"))
        elif floor is not None and s < floor:
            out.append(Deletion(s, f"{why} and older than the job's kept step {floor}"))
    return sorted(out, key=lambda d: d.step)


# ---- codec (etcd keys under the cluster prefix) -------------------------------------------------


def meta_key(job: str, step: int) -> str:
    return f"{KV_PREFIX}{job}/{step:012d}/meta"


def shard_key(job: str, step: int, rank: int) -> str:
    return f"{KV_PREFIX}{job}/{step:012d}/rank-{rank:05d}"


def rollback_key(job: str) -> str:
    return f"{KV_PREFIX}{job}/rollback"


def encode(record: CheckpointRecord, ranks: Sequence[int] | None = None) -> dict[str, bytes]:
    """The keys to write for ``record`` (all shards, or only ``ranks``)."""
    meta = {"job": record.job, "step": record.step, "epoch": record.epoch, "world_size": record.world_size,
            "format": record.format, "created_unix_s": record.created_unix_s, "invalid_reason": record.invalid_reason}
    if record.cadence:
        meta["cadence"] = record.cadence
    if record.round >= 0:
        meta["round"] = record.round
    out = {meta_key(record.job, record.step): _dump(meta)}
    for rank in record.shards if ranks is None else ranks:
        s = record.shards[rank]
        out[shard_key(record.job, record.step, rank)] = _dump({
            "rank": s.rank, "bytes": s.bytes, "checksum": s.checksum, "committed_unix_s": s.committed_unix_s,
            "files": [[f.name, f.size, f.crc32c] for f in s.files], "copies": sorted(s.copies), "bad": dict(s.bad),
            **({"writer": s.writer} if s.writer else {})})
    return out


def encode_rollback(rb: Rollback) -> dict[str, bytes]:
    return {rollback_key(rb.job): _dump({"job": rb.job, "step": rb.step, "at_unix_s": rb.at_unix_s,
                                         "superseded": list(rb.superseded)})}


def keys_of(record: CheckpointRecord) -> list[str]:
    return [meta_key(record.job, record.step)] + [shard_key(record.job, record.step, r) for r in record.shards]


Catalog = dict[tuple[str, int], CheckpointRecord]


def decode_all(kv: Mapping[str, bytes]) -> tuple[Catalog, dict[str, Rollback], list[str]]:
    """Rebuilds the catalog from its keys. A key that does not parse is reported in the third value
    and skipped — one corrupt record must not stop a leader from loading the rest. A step whose
    meta or shard record is corrupt is loaded as invalid, never as valid."""
    problems: list[str] = []
    metas: dict[tuple[str, int], dict[str, Any]] = {}
    shards: dict[tuple[str, int], dict[int, ShardRecord]] = {}
    rollbacks: dict[str, Rollback] = {}
    for key, raw in kv.items():
        if not key.startswith(KV_PREFIX):
            continue
        parts = key[len(KV_PREFIX):].split("/")
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise TypeError(f"expected an object, got {type(data).__name__}")
            if len(parts) == 2 and parts[1] == "rollback":
                rollbacks[parts[0]] = Rollback(data["job"], int(data["step"]), float(data["at_unix_s"]),
                                               tuple(int(s) for s in data.get("superseded", ())))
            elif len(parts) == 3 and parts[2] == "meta":
                metas[(parts[0], int(parts[1]))] = data
            elif len(parts) == 3 and parts[2].startswith("rank-"):
                s = ShardRecord(int(data["rank"]), int(data["bytes"]), str(data["checksum"]),
                                tuple(FileEntry(str(n), int(z), str(c)) for n, z, c in data["files"]),
                                frozenset(CopyRef(str(t), str(loc)) for t, loc in data["copies"]),
                                {str(k): str(v) for k, v in data.get("bad", {}).items()},
                                float(data.get("committed_unix_s", 0.0)), str(data.get("writer", "")))
                shards.setdefault((parts[0], int(parts[1])), {})[s.rank] = s
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            problems.append(f"catalog key {key!r} is corrupt: {type(exc).__name__}: {exc}")
            if len(parts) == 3 and parts[1].isdigit():
                metas.setdefault((parts[0], int(parts[1])), {})["corrupt"] = key
    records = {}
    for (job, step), m in metas.items():
        try:
            reason = str(m.get("invalid_reason", ""))
            if "corrupt" in m:
                reason = f"catalog record {m['corrupt']} is corrupt"
            records[(job, step)] = CheckpointRecord(
                job, step, int(m["epoch"]), int(m["world_size"]), str(m["format"]), float(m["created_unix_s"]),
                shards.get((job, step), {}), reason, str(m.get("cadence", "")), int(m.get("round", -1)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if set(m) != {"corrupt"}:  # else the corrupt key was reported already
                problems.append(f"catalog step {job}/{step} has no usable meta record: {exc!r}")
    return records, rollbacks, problems


# ---- codec (the gRPC form, CheckpointInfo) ---------------------------------------------------------


def to_info(record: CheckpointRecord) -> checkpoint_pb2.CheckpointInfo:
    """A record as the catalog RPCs return it; :func:`from_info` is its inverse."""
    info = checkpoint_pb2.CheckpointInfo(
        job=record.job, step=record.step, epoch=record.epoch, world_size=record.world_size, format=record.format,
        created_unix_s=record.created_unix_s, valid=record.valid, status=record.status(), bytes=record.total_bytes,
        on_tier={t: record.on_tier(t) for t in TIERS}, cadence=record.cadence,
    )
    for rank in sorted(record.shards):
        s = record.shards[rank]
        info.shards.append(checkpoint_pb2.ShardInfo(
            rank=rank, bytes=s.bytes, checksum=s.checksum,
            files=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in s.files],
            copies=[checkpoint_pb2.ShardCopy(tier=c.tier, location=c.location) for c in sorted(s.copies)],
            bad=dict(s.bad), writer=s.writer))
    return info


def from_info(info: checkpoint_pb2.CheckpointInfo) -> CheckpointRecord:
    """The record behind a ``CheckpointInfo`` (as :func:`to_info` made it), for typed questions:
    ``valid``, ``invalid_reason``, a shard's good copies. What the wire form does not carry (when
    each shard was committed) is 0."""
    reason = ""
    if info.status.startswith(INVALID):
        reason = info.status[len(INVALID):] or "invalid"
    shards = {
        s.rank: ShardRecord(s.rank, s.bytes, s.checksum, tuple(FileEntry(f.name, f.size, f.crc32c) for f in s.files),
                            frozenset(CopyRef(c.tier, c.location) for c in s.copies), dict(s.bad),
                            writer=s.writer)
        for s in info.shards
    }
    return CheckpointRecord(info.job, info.step, info.epoch, info.world_size, info.format, info.created_unix_s,
                            shards, reason, info.cadence)


def _dump(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
