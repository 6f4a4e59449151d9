"""The coordinator's side of the checkpoint catalog: RPC translation plus guarded commits of the
records whose rules live in :mod:`ftd.checkpoints.catalog`.

The catalog lives in etcd under ``/ftd/<cluster>/kv/ckpt/`` (one key per step's meta, one per shard,
one per job's rollback) and, on the leader, in memory, loaded at election with the rest of the state.
A change is committed first and believed after, like every other change of the coordinator; the
keeper needs only :class:`~.leader_state.LeaderState` for that, and a wall clock for the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from ftd.authz import NODE_KINDS
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.layout import (
    MAX_RANK,
    BadIdentifier,
    FileEntry,
    ShardManifest,
    check_job,
    check_rank,
    check_step,
)
from ftd.identity import Identity
from ftd.v1 import checkpoint_pb2, coordinator_pb2

from . import errors, paging, rate_limits, shard_rules, validation
from . import memory_ledger as ledger
from . import rendezvous as rules_job
from .floor_keeper import FloorKeeper
from .leader_state import LeaderState
from .merge_cache import MergeCache
from .metrics import CoordinatorMetrics
from .view import ClusterView

log = logging.getLogger("ftd.coordinator.catalog")
MAX_JOB_SERIES = 16  # jobs with ftd_coordinator_checkpoint_* series: those with the newest valid steps
_PAGE_TOKEN = r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,127}/[0-9]{12})?"  # "<job>/<step:012d>" of the last item


def manifest_from_proto(m: checkpoint_pb2.ShardManifest, now: float) -> ShardManifest:
    """Validates an RPC's manifest; :class:`~.errors.InvalidArgument` names the field. ``now`` (unix
    time) stands in for a missing creation time."""
    try:
        job = check_job(m.job)
        step = check_step(m.step)
        if not 1 <= m.world_size <= MAX_RANK + 1:
            raise BadIdentifier("world_size", f"must be in [1, {MAX_RANK + 1}], got {m.world_size}")
        if not math.isfinite(m.created_unix_s) or m.created_unix_s < 0:
            raise BadIdentifier("created_unix_s", f"must be a time >= 0, got {m.created_unix_s}")
        rank = check_rank(m.rank, m.world_size)
        if m.format not in ("torch", "dcp"):
            raise BadIdentifier("format", f"must be 'torch' or 'dcp', got {m.format[:40]!r}")
        if not m.files:
            raise BadIdentifier("files", "a shard has at least one file")
        files = tuple(FileEntry(f.name, f.size, f.crc32c) for f in m.files)
        raw = ShardManifest(job, step, m.epoch, rank, m.world_size, m.format, files, m.created_unix_s or now)
        # The same checks as a manifest read from disk (file names, checksums).
        return ShardManifest.decode("request", raw.encode())
    except BadIdentifier as exc:
        raise errors.InvalidArgument.naming(exc, within="manifest.") from exc
    except ValueError as exc:
        raise errors.InvalidArgument("manifest", str(exc)) from exc


def _check(job: str, step: int) -> tuple[str, int]:
    try:
        return check_job(job), check_step(step)
    except BadIdentifier as exc:
        raise errors.InvalidArgument.naming(exc) from exc


class CatalogKeeper:
    def __init__(self, state: LeaderState, metrics: CoordinatorMetrics,
                 wall: Callable[[], float] = time.time, limiter: rate_limits.WriteLimiter | None = None,
                 step_slack: int = 1000, unmanaged_jobs: bool = False, memory_deadline_s: float = 4.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        # Memory snapshots: soft state of the leader (memory_ledger.py), merged in when records are read.
        self.memory = ledger.MemoryLedger()
        self.memory_deadline_s = memory_deadline_s
        self.floors = FloorKeeper(state)  # the newest step answered, in etcd (floor_keeper.py)
        self.address = ""  # this replica's address: where a refused restore target is retried (ReportsPending)
        # Merged records (merge_cache.py) and restore targets are cached until the ledger, the durable
        # records or the nodes' states change: after a failure every rank asks for the same target at once.
        # (a lambda: the controller sets self.held later)
        self.merges = MergeCache(state, self.memory, clock, lambda j, e, r: self.held(j, e, r))  # noqa: PLW0108
        self._targets: dict[tuple[object, ...], checkpoint_pb2.RestoreTarget] = {}
        # the choice behind an answer, without whose reports are late: after a failover's deadline the late
        # set shrinks with every node that re-opens its stream, and only the answer's reason changes then
        self._choices: dict[tuple[object, ...], tuple[rules.CheckpointRecord | None, str]] = {}
        self.clock, self.memory_in_etcd = clock, False  # True: memory RPCs go to etcd as before issue 19 (bench)
        self.limiter = limiter or rate_limits.WriteLimiter()
        self._series: set[str] = set()  # jobs whose gauges are published
        self.metrics, self.wall, self._lock = metrics, wall, asyncio.Lock()
        self._valid_at: dict[tuple[str, int], float] = {}  # when a step became valid, on this leader
        # (job, the saving epoch and round) -> the first step not to record: a step anomaly is being rolled back,
        # and every checkpoint from it on would be suspect (coordinator/rollbacks.py sets it)
        self.held: Callable[[str, int, int | None], int | None] = lambda job, epoch, round_: None
        # node -> the node mirroring its memory snapshots (coordinator/buddies.py), set by the controller
        self.buddy_of: Callable[[str], str | None] = lambda node: None
        self.step_slack = step_slack  # shard_rules.progress_limit: steps a commit may run ahead of the progress
        self.unmanaged_jobs = unmanaged_jobs  # jobs with no round may be committed (shard_rules.Unmanaged)

    @property
    def lock(self) -> asyncio.Lock:
        """Held while the catalog changes: a commit of a shard checks its round and lands under it."""
        return self._lock

    def unreachable(self, job: str) -> set[str]:
        view = self.state.require_leader()
        return _unreachable(view, [r for (j, _), r in view.catalog.items() if j == job])

    def applied(self, records: Sequence[rules.CheckpointRecord]) -> None:
        """The view once ``records`` are committed with other records (a rollback's suspect marks)."""
        view = self.state.require_leader()
        for record in records:
            view.catalog[(record.job, record.step)] = record
        self.merges.durable_changed()
        self.publish_gauges()

    # The records live in the leader's view, loaded from etcd with everything else.
    def _records(self) -> dict[tuple[str, int], rules.CheckpointRecord]:
        return self.state.require_leader().catalog

    def _get(self, job: str, step: int) -> rules.CheckpointRecord:
        record = self._records().get((job, step))
        if record is None:
            raise errors.CheckpointNotFound(job, step)
        return record

    async def _save(self, kind: str, puts: Mapping[str, bytes], deletes: Sequence[str],
                    event: tuple[str, str, str] | None, records: Sequence[rules.CheckpointRecord],
                    removed: Sequence[tuple[str, int]] = ()) -> None:
        """``event`` None: no event line (memory snapshots come every step; the event log keeps only
        the newest entries and must not be flooded by them)."""
        await self.state.commit(kind, events=[event] if event is not None else [], kv_puts=puts, kv_deletes=deletes)
        view = self.state.require_leader()
        for record in records:
            view.catalog[(record.job, record.step)] = record
        for key in removed:
            view.catalog.pop(key, None)
        self.merges.durable_changed()

    def publish_gauges(self) -> None:
        """The newest valid checkpoint per job and the interval between the two newest."""
        view = self.state.view
        if view is None:
            return
        valid: dict[str, list[rules.CheckpointRecord]] = {}
        for (job, _), record in view.catalog.items():
            if record.valid:
                valid.setdefault(job, []).append(record)
        metrics = self.metrics
        # Job ids come from requests: only the MAX_JOB_SERIES jobs with the newest valid steps get
        # series, and the series of a job that drops out are removed, so their number stays bounded.
        shown = sorted(valid, key=lambda j: max(r.created_unix_s for r in valid[j]), reverse=True)[:MAX_JOB_SERIES]
        for job in self._series - set(shown):
            for gauge in (metrics.last_valid_step, metrics.last_valid_time, metrics.checkpoint_interval):
                with contextlib.suppress(KeyError):
                    gauge.remove(job)
        self._series = set(shown)
        for job in shown:
            records = valid[job]
            records.sort(key=lambda r: r.step)
            newest = records[-1]
            metrics.last_valid_step.labels(job).set(newest.step)
            became_valid = self._valid_at.get((job, newest.step), newest.created_unix_s)
            metrics.last_valid_time.labels(job).set(became_valid)
            if len(records) > 1:
                before = self._valid_at.get((job, records[-2].step), records[-2].created_unix_s)
                metrics.checkpoint_interval.labels(job).set(max(0.0, became_valid - before))

    async def _delete(self, records: Sequence[rules.CheckpointRecord], why: str,
                      last_puts: Mapping[str, bytes] | None = None, quiet: bool = False) -> None:
        """Deletes records in chunks that fit etcd's --max-txn-ops, metas last so a half-deleted
        record is incomplete (never valid); ``last_puts`` go with the final chunk."""
        keys = [k for r in records for k in rules.keys_of(r)[1:]] + [rules.meta_key(r.job, r.step) for r in records]
        chunks = [keys[i:i + 100] for i in range(0, len(keys), 100)] or [[]]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            gone = [(r.job, r.step) for r in records if rules.meta_key(r.job, r.step) in chunk]
            await self._save("checkpoint", (last_puts or {}) if last else {}, chunk,
                             None if quiet else ("checkpoints_removed", "", why), [], gone)

    async def commit_shard(self, request: checkpoint_pb2.CommitShardRequest,
                           caller: Identity | None = None) -> checkpoint_pb2.CommitShardResponse:
        """``caller``: who asked, from the certificate (None: in process, trusted)."""
        validation.validate_commit_shard(request)
        manifest = manifest_from_proto(request.manifest, self.wall())
        if request.tier not in rules.TIERS:
            raise errors.InvalidArgument("tier", f"must be one of {', '.join(rules.TIERS)}, got {request.tier[:40]!r}")
        mem = request.tier == "mem"
        self.limiter.check("CommitShard/mem" if mem else "CommitShard", rate_limits.shard_writer(request.location,
                           manifest.rank), rate_limits.MEMORY_TIER_SCALE if mem else 1.0)
        if mem and not self.memory_in_etcd:
            return self._commit_memory(request, manifest, caller)
        async with self._lock:
            self._may_commit(caller, manifest)  # before anything is judged, changed or deleted
            records = self._records()
            if manifest.job not in {j for j, _ in records} and \
                    len({j for j, _ in records}) >= validation.MAX_CATALOG_JOBS:
                raise errors.TooMany(f"the catalog holds checkpoints of {validation.MAX_CATALOG_JOBS} jobs already; "
                                     f"job {manifest.job} is refused until old ones are deleted")
            restored = request.restored_step if request.HasField("restored_step") else None
            round_ = request.job_round if request.HasField("job_round") else None
            self._check_round(manifest, round_)
            self._check_held(manifest, round_)
            abandoned = rules.superseded_by(records.values(), manifest, restored, round_)
            gone = {(r.job, r.step) for r in abandoned}
            before = None if (manifest.job, manifest.step) in gone else records.get((manifest.job, manifest.step))
            cadence = validation.clip(validation.one_line(request.cadence), 200)
            try:  # judged against the state after the abandonment, before anything is deleted
                record, what = rules.commit_shard(before, manifest, request.tier, request.location, self.wall(),
                                                  cadence, round_, _writer(caller))
            except rules.CatalogError as exc:
                raise (errors.ShardExists(str(exc)) if exc.exists else errors.CatalogConflict(str(exc))) from exc
            if abandoned:  # a new timeline (restarted from an older step in a newer epoch) takes over
                since = ("started from scratch" if restored == -1 else f"restored step {restored}"
                         if restored is not None else "restarted from an older step")
                where = f"epoch {manifest.epoch}" + (f" round {round_}" if round_ is not None else "")
                await self._delete(abandoned, f"{manifest.job}: {where} saves step {manifest.step} "
                                              f"after it {since}; steps {[r.step for r in abandoned][:10]} of the "
                                              "abandoned timeline removed")
                log.warning("job %s: step %d saved in %s (%s); removed steps %s of older epochs or rounds "
                            "(abandoned timeline)", manifest.job, manifest.step, where, since,
                            [r.step for r in abandoned][:20])
            if before is not None and record == before:
                return checkpoint_pb2.CommitShardResponse(checkpoint=rules.to_info(record), message="already recorded")
            puts = rules.encode(record, [manifest.rank])
            pruned, emptied = self._memory_pruned(record, manifest.rank, request.tier, request.location)
            for other in pruned:
                puts.update(rules.encode(other, [manifest.rank]))
            memory = request.tier == rules.MEMORY
            await self._save("checkpoint", puts, (), None if memory else (
                "shard_committed", "", f"{manifest.job} step {manifest.step}: {what}"), [record, *pruned])
            if emptied:
                await self._delete(emptied, f"{manifest.job}: memory snapshots of rank {manifest.rank} on "
                                            f"{request.location} superseded", quiet=True)
            if record.valid and (before is None or not before.valid):
                self._valid_at[(record.job, record.step)] = self.wall()
                self.publish_gauges()
                (log.debug if memory else log.info)("checkpoint %s step %d is valid (%d shards, %d bytes)",
                                                    record.job, record.step, record.world_size, record.total_bytes)
            return checkpoint_pb2.CommitShardResponse(checkpoint=rules.to_info(record), message=what)

    def _may_commit(self, caller: Identity | None, manifest: ShardManifest) -> None:
        """:func:`~.shard_rules.may_commit` for a node caller; raises :class:`~.errors.Forbidden`."""
        if caller is None or caller.kind not in NODE_KINDS:
            return
        view = self.state.require_leader()
        job = view.jobs.get(manifest.job)
        members = job.members if job is not None else ()
        progress = [rt.progress.step for n in members
                    if (rt := view.runtime.get(n)) is not None and rt.progress is not None]
        committed = [s for (j, s) in view.catalog if j == manifest.job]
        unmanaged = shard_rules.Unmanaged(view.world.epoch, caller.name in view.nodes) \
            if self.unmanaged_jobs else None
        verdict = shard_rules.may_commit(caller.name, job, manifest.job, manifest.step, manifest.epoch, manifest.rank,
                                         manifest.world_size,
                                         shard_rules.progress_limit(progress, committed, self.step_slack), unmanaged)
        if not verdict.allowed:
            raise errors.Forbidden(verdict.rule, verdict.reason)

    def _may_record(self, caller: Identity | None, record: rules.CheckpointRecord,
                    request: checkpoint_pb2.RecordCopyRequest, corrupt: bool) -> None:
        """:func:`~.shard_rules.may_record` for a node caller; raises :class:`~.errors.Forbidden`."""
        if caller is None or caller.kind not in NODE_KINDS:
            return
        view = self.state.require_leader()
        restorable = [r for (j, _), r in view.catalog.items() if j == record.job and r.restorable]
        verdict = shard_rules.may_record(caller.name, view.jobs.get(record.job), record, request.rank, request.tier,
                                         request.location, request.present, corrupt, self.buddy_of,
                                         max(restorable, key=lambda r: r.step, default=None), self.unmanaged_jobs)
        if not verdict.allowed:
            raise errors.Forbidden(verdict.rule, verdict.reason)

    def _check_held(self, manifest: ShardManifest, round_: int | None) -> None:
        held = self.held(manifest.job, manifest.epoch, round_)
        if held is not None and manifest.step >= held:
            raise errors.CatalogConflict(f"rank {manifest.rank} of job {manifest.job}: step {manifest.step} is not "
                                         f"recorded: the step anomaly at step {held} is being rolled back (every "
                                         "checkpoint from it on would be suspect)")

    def _check_round(self, manifest: ShardManifest, round_: int | None) -> None:
        """A shard saved in a round the job has left (a worker of a failed round still writing) is
        refused: its timeline is abandoned, and its commit would mix into the new round's steps."""
        job = self.state.require_leader().jobs.get(manifest.job)
        if round_ is not None and job is not None and job.epoch == manifest.epoch and round_ < job.round:
            raise errors.CatalogConflict(f"rank {manifest.rank} of job {manifest.job} saves step {manifest.step} in "
                                         f"round {round_}, but the job is in round {job.round}: that round is over")

    def _memory_pruned(self, record: rules.CheckpointRecord, rank: int, tier: str,
                       location: str) -> tuple[list[rules.CheckpointRecord], list[rules.CheckpointRecord]]:
        """A memory copy recorded at ``location``: the copies of that rank's older memory snapshots
        there are dropped (the node holds at most :data:`~ftd.checkpoints.catalog.MEM_KEEP`; it
        deleted the oldest before writing), and records left without any copy go."""
        if tier != rules.MEMORY:
            return [], []
        records = [r for key, r in self._records().items() if key[0] == record.job and key[1] != record.step]
        return rules.prune_memory([*records, record], rank, location)

    # ---- memory snapshots: soft state (memory_ledger.py), never etcd --------------------------------

    def take_report(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport) -> None:
        """A node's memory report off its heartbeat stream (membership.on_heartbeat)."""
        self.memory.take(node, incarnation, report, self.state.require_leader().jobs.values())

    def merged(self, job: str) -> list[rules.CheckpointRecord]:
        """The job's durable records merged with the memory snapshots of its alive nodes (merge_cache.py)."""
        return self.merges.merged(job)

    async def prepare(self, job: str) -> None:
        """Before a restore target: an expensive merge is rebuilt off the event loop (merge_cache.py)."""
        _check(job, 0)
        if not self.readiness(job).waiting:
            await self.merges.prepare(job)

    def _merged_step(self, job: str, step: int) -> rules.CheckpointRecord | None:
        return next((r for r in self.merged(job) if r.step == step), None)

    def readiness(self, job: str) -> ledger.Readiness:
        """:meth:`~.memory_ledger.MemoryLedger.readiness_of` on this leader's view."""
        return self.memory.readiness_of(self.state.require_leader(), job, self.clock(), self.memory_deadline_s)

    def _commit_memory(self, request: checkpoint_pb2.CommitShardRequest, manifest: ShardManifest,
                       caller: Identity | None) -> checkpoint_pb2.CommitShardResponse:
        """``CommitShard(tier="mem")`` (compatibility: agents announce on the heartbeat stream): the
        commit-time checks, then one snapshot into the ledger; nothing goes to etcd."""
        if request.location in validation.SHARED_LOCATIONS:
            raise errors.InvalidArgument("location", f"a memory snapshot is on a node, not {request.location!r}")
        self._may_commit(caller, manifest)
        restored = request.restored_step if request.HasField("restored_step") else None
        round_ = request.job_round if request.HasField("job_round") else None
        self._check_round(manifest, round_)
        self._check_held(manifest, round_)
        durable = [r for (j, _), r in self._records().items() if j == manifest.job]
        gone = {r.step for r in rules.superseded_by(durable, manifest, restored, round_)}
        before = next((r for r in durable if r.step == manifest.step and r.step not in gone), None)
        try:  # a rank's bytes contradicting the durable record are refused as a durable commit's would be
            rules.commit_shard(before, manifest, request.tier, request.location, self.wall(), "", round_)
        except rules.CatalogError as exc:
            raise (errors.ShardExists(str(exc)) if exc.exists else errors.CatalogConflict(str(exc))) from exc
        cadence = validation.clip(validation.one_line(request.cadence), 200)
        self.memory.add(ledger.snap_of(request.location, manifest, _writer(caller), False, restored, round_, cadence))
        record = self._merged_step(manifest.job, manifest.step)
        info = rules.to_info(record) if record is not None else checkpoint_pb2.CheckpointInfo()
        return checkpoint_pb2.CommitShardResponse(checkpoint=info, message=(
            f"rank {manifest.rank} memory snapshot recorded on mem@{request.location} (soft state in the leader, "
            "not written to etcd)"))

    def _record_memory(self, request: checkpoint_pb2.RecordCopyRequest, corrupt: str,
                       caller: Identity | None) -> checkpoint_pb2.RecordCopyResponse:
        """``RecordCopy(tier="mem")`` (compatibility): a memory copy recorded, dropped or found
        corrupt in the ledger; nothing goes to etcd."""
        job, step, rank, location = request.job, request.step, request.rank, request.location
        record = self._merged_step(job, step)
        if record is None:
            raise errors.CheckpointNotFound(job, step)
        shard = record.shards.get(rank)
        if shard is None:
            raise errors.CheckpointNotFound(job, step, rank)
        self._may_record(caller, record, request, bool(corrupt))
        where = rules.CopyRef(rules.MEMORY, location)
        if corrupt:
            self.memory.mark_bad(job, step, rank, location, corrupt)
            log.warning("%s step %d: rank %d copy on %s is corrupt: %s", job, step, rank, where, corrupt)
        elif request.present:
            if request.checksum and request.checksum != shard.checksum:
                raise errors.CatalogConflict(
                    f"the copy of {job} step {step} rank {rank} on {where} holds other bytes (checksum "
                    f"{request.checksum[:16]}) than the committed shard (checksum {shard.checksum}): another "
                    "timeline's, not recorded")
            self.memory.add(ledger.Snap(location, shard.writer, True, job, step, record.epoch, rank, record.world_size,
                                        record.format, shard.files, shard.checksum, shard.committed_unix_s, None,
                                        record.round, record.cadence, shard.bytes))
        else:
            self.memory.drop(location, job, step, rank)
        new = self._merged_step(job, step) or record
        return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(new))

    async def record_copy(self, request: checkpoint_pb2.RecordCopyRequest,
                          caller: Identity | None = None) -> checkpoint_pb2.RecordCopyResponse:
        job, step = _check(request.job, request.step)
        validation.validate_record_copy(request)
        corrupt = validation.clip(validation.one_line(request.corrupt_reason), 500)
        if request.tier not in rules.TIERS:
            raise errors.InvalidArgument("tier", f"must be one of {', '.join(rules.TIERS)}, got {request.tier[:40]!r}")
        mem = request.tier == "mem"
        self.limiter.check("RecordCopy/mem" if mem else "RecordCopy", rate_limits.shard_writer(request.location,
                           request.rank), rate_limits.MEMORY_TIER_SCALE if mem else 1.0)
        if mem and not self.memory_in_etcd:
            return self._record_memory(request, corrupt, caller)
        async with self._lock:
            record = self._get(job, step)
            if request.rank not in record.shards:
                raise errors.CheckpointNotFound(job, step, request.rank)
            shard = record.shards[request.rank]
            self._may_record(caller, record, request, bool(corrupt))
            copy = (request.tier, request.location)
            if corrupt:
                new = rules.drop_copy(record, request.rank, request.tier, request.location, corrupt)
                where = rules.CopyRef(request.tier, request.location)
                what = f"rank {request.rank} copy on {where} is corrupt: {corrupt}"
            elif request.present:
                if request.checksum and request.checksum != shard.checksum:
                    raise errors.CatalogConflict(
                        f"the copy of {job} step {step} rank {request.rank} on "
                        f"{rules.CopyRef(request.tier, request.location)} "
                        f"holds other bytes (checksum {request.checksum[:16]}) than the committed shard "
                        f"(checksum {shard.checksum}): another timeline's, not recorded")
                try:
                    new = rules.add_copy(record, request.rank, request.tier, request.location)
                except rules.CatalogError as exc:
                    raise errors.CatalogConflict(str(exc)) from exc
                what = f"rank {request.rank} copy recorded on {rules.CopyRef(request.tier, request.location)}"
            else:
                new = rules.drop_copy(record, request.rank, request.tier, request.location)
                what = f"rank {request.rank} copy on {rules.CopyRef(request.tier, request.location)} deleted"
            if new == record or (not request.present and not corrupt and copy not in shard.copies):
                return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(record))
            if new.orphaned and new.complete:
                # Retention removed the last copy: the record describes nothing any more.
                await self._delete([new], f"{job} step {step}: last copy deleted")
                return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(new))
            puts = rules.encode(new, [request.rank])
            pruned, emptied = self._memory_pruned(new, request.rank, request.tier, request.location) \
                if request.present and not corrupt else ([], [])
            for other in pruned:
                puts.update(rules.encode(other, [request.rank]))
            memory = request.tier == rules.MEMORY and not corrupt
            await self._save("checkpoint", puts, (), None if memory else (
                "copy_recorded", "", f"{job} step {step}: {what}"), [new, *pruned])
            if emptied:
                await self._delete(emptied, f"{job}: memory snapshots of rank {request.rank} on {request.location} "
                                            "superseded", quiet=True)
            return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(new))

    async def invalidate(self, request: checkpoint_pb2.InvalidateCheckpointRequest) -> checkpoint_pb2.CheckpointInfo:
        job, step = _check(request.job, request.step)
        validation.validate_invalidate(request)
        reason = validation.clip(validation.one_line(request.reason), 500)
        if not reason:
            raise errors.InvalidArgument("reason", "say why the checkpoint is invalid")
        async with self._lock:
            if (job, step) not in self._records() and (record := self._merged_step(job, step)) is not None:
                # only in memory: marked in the ledger (soft, as the snapshots are)
                self.memory.invalid[(job, step)] = reason
                self.memory.changed()
                log.warning("memory-only checkpoint %s step %d marked invalid: %s", job, step, reason)
                return rules.to_info(replace(record, invalid_reason=record.invalid_reason or reason))
            record = self._get(job, step)
            if record.invalid_reason:
                return rules.to_info(record)
            refused = rules.invalidation_loses_last([r for (j, _), r in self._records().items() if j == job], step)
            if refused:
                raise errors.CatalogConflict(f"job {job}: {refused}")
            new = replace(record, invalid_reason=reason)
            await self._save("checkpoint", rules.encode(new, []), (),
                             ("checkpoint_invalid", "", f"{job} step {step} invalid: {reason}"), [new])
            log.warning("checkpoint %s step %d marked invalid: %s", job, step, reason)
            return rules.to_info(new)

    def list(self, job: str) -> list[checkpoint_pb2.CheckpointInfo]:
        """The first page (:data:`~.paging.DEFAULT_PAGE_SIZE` records, about
        :data:`~.paging.MAX_PAGE_BYTES`); :meth:`list_page` for the rest."""
        return list(self.list_page(checkpoint_pb2.ListCheckpointsRequest(job=job)).checkpoints)

    def list_page(self, request: checkpoint_pb2.ListCheckpointsRequest) -> checkpoint_pb2.ListCheckpointsResponse:
        """Records in (job, step) order, a page at a time; the token is ``<job>/<step:012d>`` of the
        previous page's last record."""
        job = request.job
        if job:
            _check(job, 0)
        page = paging.page(request.page_size, request.page_token, _PAGE_TOKEN)
        after: tuple[str, int] | None = None
        if page.token:
            token_job, token_step = page.token.split("/")
            after = (token_job, int(token_step))
        records = dict(self._records())
        for name in self.memory.jobs() & ({job} if job else self.memory.jobs()):
            for key in [k for k in records if k[0] == name]:
                del records[key]  # the merge may leave out an abandoned durable step
            records.update({(name, r.step): r for r in self.merged(name)})
        keys = sorted(k for k in records if (not job or k[0] == job) and (after is None or k > after))
        infos, more = paging.take_page((rules.to_info(records[k]) for k in keys), page.size,
                                       checkpoint_pb2.CheckpointInfo.ByteSize)
        token = f"{infos[-1].job}/{infos[-1].step:012d}" if more else ""
        return checkpoint_pb2.ListCheckpointsResponse(checkpoints=infos, next_page_token=token)

    def restore_target(self, job: str, world_size: int = 0, replicated: bool = False,
                       fmt: str = "") -> checkpoint_pb2.RestoreTarget:
        _check(job, 0)
        if world_size < 0 or world_size > MAX_RANK + 1:
            raise errors.InvalidArgument("world_size", f"must be in [0, {MAX_RANK + 1}], got {world_size}")
        if fmt not in ("", "torch", "dcp"):
            raise errors.InvalidArgument("format", f"must be 'torch', 'dcp' or empty, got {fmt[:40]!r}")
        view = self.state.require_leader()
        ready = self.readiness(job)
        if ready.waiting:
            raise errors.ReportsPending(job, ready.waiting, ready.left_s, self.address)
        records = self.merged(job)
        state = view.jobs.get(job)
        gone = self.memory.gone(view, self.clock())
        chosen = (job, world_size, replicated, fmt, self.merges.key_of(job), gone,
                  len(view.nodes), view.rollbacks.get(job), state.skip_until if state is not None else -1)
        key = (*chosen, ready.late)
        answer = self._targets.get(key)
        if answer is None:
            choice = self._choices.get(chosen)
            if choice is None:  # 16,000 ranks: tens of ms on the event loop
                choice = rules.restore_target(records, view.rollbacks.get(job), world_size,
                                              _unreachable(view, records), replicated, fmt)
                if len(self._choices) >= 64:
                    self._choices.clear()
                self._choices[chosen] = choice
            answer = self._answer(view, job, world_size, *choice, ready)
            if len(self._targets) >= 64:
                self._targets.clear()
            self._targets[key] = answer
        if self.memory.mirrored:  # a ledger followed from the last leader: never older than its answers
            answer = self.floors.check(view, job, answer, self.clock(), self.memory.since, self.memory_deadline_s, [
                n for n in (state.members if state is not None and state.members else view.nodes)
                if n in self.memory.mirrored and n not in gone])
        return answer

    def _answer(self, view: ClusterView, job: str, world_size: int, target: rules.CheckpointRecord | None, why: str,
                ready: ledger.Readiness) -> checkpoint_pb2.RestoreTarget:
        why += ledger.late_reason(ready.late, self.memory_deadline_s)
        if target is None:
            return checkpoint_pb2.RestoreTarget(found=False, reason=why)
        state = view.jobs.get(job)
        skip = state.skip_until if state is not None and state.skip_until > target.step else 0
        if skip:
            why += f"; the data of steps {target.step + 1}..{skip} is skipped (rolled back past a step anomaly)"
        return checkpoint_pb2.RestoreTarget(found=True, checkpoint=rules.to_info(target), reason=why,
                                            resharded=bool(world_size) and target.world_size != world_size,
                                            skip_until_step=skip)

    async def forget(self, request: checkpoint_pb2.ForgetJobRequest,
                     job_state: rules_job.JobState | None) -> checkpoint_pb2.ForgetJobResponse:
        """An operator removes every record of a job from the catalog (``job_state``: its rendezvous
        record, which must be closed or absent: a running job's checkpoints are not forgotten)."""
        job, _ = _check(request.job, 0)
        reason = validation.clip(validation.one_line(request.reason), 300) or "forgotten by an operator"
        if job_state is not None and not job_state.closed:
            raise errors.CatalogConflict(f"job {job} is open (round {job_state.round}): close it first (ftctl), "
                                         "then forget its checkpoints")
        async with self._lock:
            view = self.state.require_leader()
            records = sorted((r for (j, _), r in view.catalog.items() if j == job), key=lambda r: r.step)
            if not records and job not in view.rollbacks:
                raise errors.NoCheckpoints(job)
            await self._delete(records, f"{job}: checkpoints forgotten ({reason}); steps "
                                        f"{[r.step for r in records][:10]}")
            if job in view.rollbacks:
                await self._save("checkpoint", {}, [rules.rollback_key(job)], None, [])
                view.rollbacks.pop(job, None)
            await self.floors.forget(job)
            self.publish_gauges()
            log.warning("job %s: %d checkpoints forgotten (%s)", job, len(records), reason)
            return checkpoint_pb2.ForgetJobResponse(removed_steps=[r.step for r in records])

    async def rollback(self, request: checkpoint_pb2.RollbackRequest) -> checkpoint_pb2.RollbackResponse:
        job, step = _check(request.job, request.step)
        async with self._lock:
            view = self.state.require_leader()
            records = [r for (j, _), r in view.catalog.items() if j == job]
            try:
                rb, removed = rules.rollback(records, job, step, self.wall())
            except rules.CatalogError as exc:
                raise errors.CatalogConflict(str(exc)) from exc
            await self._delete(removed, f"{job} rolled back to step {step}; removed steps "
                                        f"{list(rb.superseded) or 'none'}", rules.encode_rollback(rb))
            view.rollbacks[job] = rb
            log.warning("job %s rolled back to step %d (removed %s)", job, step, list(rb.superseded))
            return checkpoint_pb2.RollbackResponse(target=rules.to_info(self._get(job, step)),
                                                   removed_steps=list(rb.superseded))


def _writer(caller: Identity | None) -> str:
    """The name a shard's writer is recorded under: the committing node's (operators and in-process
    callers commit nothing a node will verify against)."""
    return caller.name if caller is not None and caller.kind in NODE_KINDS else ""


def _unreachable(view: ClusterView, records: Sequence[rules.CheckpointRecord]) -> set[str]:
    """Locations of the records' copies that cannot be read now: nodes dead, fenced or unknown (a
    node's memory tier dies with it; its disks wait for it to come back)."""
    locations = {c.location for r in records for s in r.shards.values() for c in s.copies}
    return {loc for loc in locations - set(validation.SHARED_LOCATIONS)
            if loc not in view.nodes or view.state_of(loc)[0] in ledger.GONE}
