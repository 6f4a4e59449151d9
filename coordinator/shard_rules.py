"""Which node may commit or record which shard: the catalog's authorization bound to the job's state.

The transport's table (:mod:`ftd.authz`) only checks that a node acts as itself (the ``location`` of
a copy is its own name, or a shared tier). That left a compromised node's certificate with power over
every job's data: forged shards for every rank at a huge step, an epoch of 10^18 that abandoned the
whole catalog, other nodes' copies dropped. These rules bind a node's catalog writes to what the job's
current round says it holds. They are pure functions of the request, the job's state and the catalog,
returning a :class:`Verdict` whose reason names the node, job, step, rank and rule; the keeper
(:mod:`.catalog`) raises it as ``PERMISSION_DENIED`` before anything is changed or deleted.

Operators and in-process callers (``caller=None``: tests, tools) are not bound by them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ftd.checkpoints import catalog as ckpt

from .rendezvous import JobState

SHARED = frozenset({"shared", "s3"})  # copy locations that name no node (validation.SHARED_LOCATIONS)


@dataclass(frozen=True)
class Rule:
    name: str  # stable: the label of ftd_coordinator_rpc_denied_total and what denials name
    text: str


HOLDER = Rule("shard_holder", "a node commits shards only for the ranks it holds in the job's current round")
EPOCH = Rule("job_epoch", "a shard's epoch is the job's current epoch")
PROGRESS = Rule("step_progress", "a shard's step is at most the job's reported progress plus the slack")
COPY_OWNER = Rule("copy_owner", "a node records copies only of shards of a rank it holds, mirrors as the holder's "
                                "buddy, or already holds a copy of")
KEEP_TARGET = Rule("keep_restore_target", "no node drops the last good copy of a rank of the job's newest "
                                          "restorable checkpoint")
RULES = (HOLDER, EPOCH, PROGRESS, COPY_OWNER, KEEP_TARGET)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    rule: str
    reason: str


_OK = Verdict(True, "", "")


@dataclass(frozen=True)
class Unmanaged:
    """What binds a commit of a job with no round when the coordinator allows them (``unmanaged_jobs``):
    the world's epoch (no shard of a future epoch abandons the job's timeline) and whether the caller
    is a registered node (a stranger commits nothing)."""

    world_epoch: int
    caller_registered: bool


def _deny(rule: Rule, reason: str) -> Verdict:
    return Verdict(False, rule.name, f"{reason} (rule {rule.name}: {rule.text})")


def holder(job: JobState, world_size: int, rank: int) -> str | None:
    """The node that holds training rank ``rank`` of a ``world_size``-rank world in the job's current
    round: torchrun numbers ranks node by node (global rank = node rank x ranks per node + local rank),
    and the round's ``members`` are the node ids by node rank. None when the world size does not fit
    the round (not a whole number of ranks per node) or the rank is out of it."""
    nodes = len(job.members)
    if nodes == 0 or world_size <= 0 or world_size % nodes or not 0 <= rank < world_size:
        return None
    return job.members[rank // (world_size // nodes)]


def progress_limit(progress: Iterable[int], committed: Iterable[int], slack: int) -> int | None:
    """The newest step a shard may have: the newest step any member reported (heartbeats) or the
    catalog holds, plus ``slack`` (heartbeats lag the saves). None when neither is known (a job whose
    script reports no progress, before its first checkpoint): no bound, the holder rule still applies."""
    known = max([s for s in progress if s >= 0] + [s for s in committed if s >= 0], default=-1)
    return None if known < 0 else known + slack


def may_commit(caller: str, job: JobState | None, job_id: str, step: int, epoch: int, rank: int, world_size: int,
               limit: int | None, unmanaged: Unmanaged | None = None) -> Verdict:
    """Whether node ``caller`` may commit (job_id, step, rank) saved at ``epoch`` in a world of
    ``world_size`` ranks; ``limit``: :func:`progress_limit`; ``unmanaged``: how a job with no round is
    treated (None: refused)."""
    what = f"node {caller} may not commit {job_id} step {step} rank {rank}"
    if job is None:
        if unmanaged is None:
            return _deny(HOLDER, f"{what}: job {job_id} has no round (shards are committed by the members of its "
                                 "world; the coordinator's unmanaged_jobs lets a trusted fleet commit jobs that do "
                                 "not rendezvous through ftd)")
        if epoch > unmanaged.world_epoch:
            return _deny(EPOCH, f"{what} at epoch {epoch}: the world is at epoch {unmanaged.world_epoch}")
        if unmanaged.caller_registered:
            return _OK
        return _deny(HOLDER, f"{what}: {caller} is not registered")
    if epoch > job.epoch:
        return _deny(EPOCH, f"{what} at epoch {epoch}: job {job_id} is at epoch {job.epoch}")
    if epoch < job.epoch:
        return _deny(EPOCH, f"{what} at epoch {epoch}: job {job_id} is at epoch {job.epoch} "
                            "(a world that is over saves nothing more)")
    owner = holder(job, world_size, rank)
    if owner is None:
        return _deny(HOLDER, f"{what}: a world of {world_size} ranks does not fit round {job.round} of job "
                             f"{job_id} ({len(job.members)} nodes)")
    if owner != caller:
        return _deny(HOLDER, f"{what}: rank {rank} is held by {owner} in round {job.round}")
    if limit is not None and step > limit:
        return _deny(PROGRESS, f"{what}: the job reached step {limit} at most (with the slack)")
    return _OK


def may_record(caller: str, job: JobState | None, record: ckpt.CheckpointRecord, rank: int, tier: str,
               location: str, present: bool, corrupt: bool, buddy_of: Callable[[str], str | None],
               newest_restorable: ckpt.CheckpointRecord | None, unmanaged: bool = False) -> Verdict:
    """Whether node ``caller`` may record a fact about the copy of ``record``'s ``rank`` at
    ``tier``@``location`` (the transport already checked the location is the caller's own or shared):
    a copy present, dropped (``present`` False) or found corrupt.

    * At its own location a node drops its copies and reports them corrupt freely: its own bytes.
    * A new copy (at its own location or a shared one), or a corrupt mark on a shared copy, only from
      the node holding the rank in the current round (a promoted spare restoring it included) or a
      node with a copy of the shard at its own location already (moving its own bytes between its
      tiers and up to the shared ones); the buddy (``buddy_of``) of a node holding a memory copy records
      its memory replica. ``unmanaged``: a job with no round on a trusted fleet (``unmanaged_jobs``):
      any node records copies at its own location.
    * A drop of a shared copy from one of those too, and never the last good copy of a rank of
      ``newest_restorable`` (retention deletes only steps older than the kept ones)."""
    what = f"node {caller} may not record the copy of {record.job} step {record.step} rank {rank} on {tier}@{location}"
    shard = record.shards.get(rank)
    own = location == caller
    if own and (not present or corrupt):
        return _OK
    owner = holder(job, record.world_size, rank) if job is not None else None
    mine = shard is not None and any(c.location == caller for c in shard.copies)
    sources = {owner} if owner is not None else set()
    if shard is not None:
        sources |= {c.location for c in shard.copies if c.tier == ckpt.MEMORY}
    mirror = own and tier == ckpt.MEMORY and any(buddy_of(n) == caller for n in sources)
    trusted = own and unmanaged and job is None
    if not (owner == caller or mine or mirror or trusted):
        held = f"rank {rank} is held by {owner}" if owner else f"job {record.job} has no round holding rank {rank}"
        buddy = "" if own and tier == ckpt.MEMORY else " (a buddy records only its memory replica)"
        return _deny(COPY_OWNER, f"{what}: {held}; {caller} holds no copy of it{buddy}")
    if not present and location in SHARED and shard is not None and newest_restorable is not None \
            and newest_restorable.step == record.step:
        others = [c for c in shard.good_copies() if c != ckpt.CopyRef(tier, location)]
        if not others:
            return _deny(KEEP_TARGET, f"{what}: it is the last good copy of rank {rank} of step {record.step}, "
                                      f"the job's newest restorable checkpoint")
    return _OK
