"""The coordinator's side of the checkpoint catalog: RPC translation plus guarded commits of the
records whose rules live in :mod:`ftd.checkpoints.catalog`.

The catalog lives in etcd under ``/ftd/<cluster>/kv/ckpt/`` (one key per step's meta, one per shard,
one per job's rollback) and, on the leader, in memory, loaded at election with the rest of the state.
A change is committed first and believed after, like every other change of the coordinator; the
keeper needs only :class:`~.leader_state.LeaderState` for that, and a wall clock for the records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from ftd.checkpoints import catalog as rules
from ftd.checkpoints.layout import BadIdentifier, FileEntry, ShardManifest, check_job, check_rank, check_step
from ftd.v1 import checkpoint_pb2

from . import errors
from .leader_state import LeaderState
from .metrics import CoordinatorMetrics

log = logging.getLogger("ftd.coordinator.catalog")


def manifest_from_proto(m: checkpoint_pb2.ShardManifest, now: float) -> ShardManifest:
    """Validates an RPC's manifest; :class:`~.errors.InvalidArgument` names the field. ``now`` (unix
    time) stands in for a missing creation time."""
    try:
        job = check_job(m.job)
        step = check_step(m.step)
        if m.world_size < 1:
            raise BadIdentifier("world_size", f"must be >= 1, got {m.world_size}")
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
                 wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.metrics = metrics
        self.wall = wall
        self._lock = asyncio.Lock()
        self._valid_at: dict[tuple[str, int], float] = {}  # when a step became valid, on this leader

    # The records live in the leader's view, loaded from etcd with everything else.
    def _records(self) -> dict[tuple[str, int], rules.CheckpointRecord]:
        return self.state.require_leader().catalog

    def _get(self, job: str, step: int) -> rules.CheckpointRecord:
        record = self._records().get((job, step))
        if record is None:
            raise errors.CheckpointNotFound(job, step)
        return record

    async def _save(self, kind: str, puts: Mapping[str, bytes], deletes: Sequence[str], event: tuple[str, str, str],
                    records: Sequence[rules.CheckpointRecord], removed: Sequence[tuple[str, int]] = ()) -> None:
        await self.state.commit(kind, events=[event], kv_puts=puts, kv_deletes=deletes)
        view = self.state.require_leader()
        for record in records:
            view.catalog[(record.job, record.step)] = record
        for key in removed:
            view.catalog.pop(key, None)

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
        for job, records in valid.items():
            records.sort(key=lambda r: r.step)
            newest = records[-1]
            metrics.last_valid_step.labels(job).set(newest.step)
            became_valid = self._valid_at.get((job, newest.step), newest.created_unix_s)
            metrics.last_valid_time.labels(job).set(became_valid)
            if len(records) > 1:
                before = self._valid_at.get((job, records[-2].step), records[-2].created_unix_s)
                metrics.checkpoint_interval.labels(job).set(max(0.0, became_valid - before))

    async def _delete(self, records: Sequence[rules.CheckpointRecord], why: str,
                      last_puts: Mapping[str, bytes] | None = None) -> None:
        """Deletes records in chunks that fit etcd's --max-txn-ops, metas last so a half-deleted
        record is incomplete (never valid); ``last_puts`` go with the final chunk."""
        keys = [k for r in records for k in rules.keys_of(r)[1:]] + [rules.meta_key(r.job, r.step) for r in records]
        chunks = [keys[i:i + 100] for i in range(0, len(keys), 100)] or [[]]
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            gone = [(r.job, r.step) for r in records if rules.meta_key(r.job, r.step) in chunk]
            await self._save("checkpoint", (last_puts or {}) if last else {}, chunk,
                             ("checkpoints_removed", "", why), [], gone)

    async def commit_shard(self, request: checkpoint_pb2.CommitShardRequest) -> checkpoint_pb2.CommitShardResponse:
        manifest = manifest_from_proto(request.manifest, self.wall())
        if request.tier not in rules.TIERS:
            raise errors.InvalidArgument("tier", f"must be one of {', '.join(rules.TIERS)}, got {request.tier[:40]!r}")
        if not request.location or "/" in request.location:
            raise errors.InvalidArgument("location", f"{request.location[:80]!r} is not a node id or 'shared'")
        async with self._lock:
            before = self._records().get((manifest.job, manifest.step))
            try:
                record, what = rules.commit_shard(before, manifest, request.tier, request.location, self.wall())
            except rules.CatalogError as exc:
                raise (errors.ShardExists(str(exc)) if exc.exists else errors.CatalogConflict(str(exc))) from exc
            if before is not None and record == before:
                return checkpoint_pb2.CommitShardResponse(checkpoint=rules.to_info(record), message="already recorded")
            puts = rules.encode(record, [manifest.rank])
            await self._save("checkpoint", puts, (), ("shard_committed", "", f"{manifest.job} step {manifest.step}: "
                                                      f"{what}"), [record])
            if record.valid and (before is None or not before.valid):
                self._valid_at[(record.job, record.step)] = self.wall()
                self.publish_gauges()
                log.info("checkpoint %s step %d is valid (%d shards, %d bytes)", record.job, record.step,
                         record.world_size, record.total_bytes)
            return checkpoint_pb2.CommitShardResponse(checkpoint=rules.to_info(record), message=what)

    async def record_copy(self, request: checkpoint_pb2.RecordCopyRequest) -> checkpoint_pb2.RecordCopyResponse:
        job, step = _check(request.job, request.step)
        if request.tier not in rules.TIERS:
            raise errors.InvalidArgument("tier", f"must be one of {', '.join(rules.TIERS)}, got {request.tier[:40]!r}")
        async with self._lock:
            record = self._get(job, step)
            if request.rank not in record.shards:
                raise errors.CheckpointNotFound(job, step, request.rank)
            shard = record.shards[request.rank]
            copy = (request.tier, request.location)
            if request.corrupt_reason:
                new = rules.drop_copy(record, request.rank, request.tier, request.location, request.corrupt_reason)
                what = (f"rank {request.rank} copy on {rules.CopyRef(request.tier, request.location)} is corrupt: "
                        f"{request.corrupt_reason}")
            elif request.present:
                try:
                    new = rules.add_copy(record, request.rank, request.tier, request.location)
                except rules.CatalogError as exc:
                    raise errors.CatalogConflict(str(exc)) from exc
                what = f"rank {request.rank} copy recorded on {rules.CopyRef(request.tier, request.location)}"
            else:
                new = rules.drop_copy(record, request.rank, request.tier, request.location)
                what = f"rank {request.rank} copy on {rules.CopyRef(request.tier, request.location)} deleted"
            if new == record or (not request.present and not request.corrupt_reason and copy not in shard.copies):
                return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(record))
            if new.orphaned and new.complete:
                # Retention removed the last copy: the record describes nothing any more.
                await self._delete([new], f"{job} step {step}: last copy deleted")
                return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(new))
            await self._save("checkpoint", rules.encode(new, [request.rank]), (),
                             ("copy_recorded", "", f"{job} step {step}: {what}"), [new])
            return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(new))

    async def invalidate(self, request: checkpoint_pb2.InvalidateCheckpointRequest) -> checkpoint_pb2.CheckpointInfo:
        job, step = _check(request.job, request.step)
        if not request.reason:
            raise errors.InvalidArgument("reason", "say why the checkpoint is invalid")
        async with self._lock:
            record = self._get(job, step)
            if record.invalid_reason:
                return rules.to_info(record)
            new = replace(record, invalid_reason=request.reason[:500])
            await self._save("checkpoint", rules.encode(new, []), (),
                             ("checkpoint_invalid", "", f"{job} step {step} invalid: {request.reason[:500]}"), [new])
            log.warning("checkpoint %s step %d marked invalid: %s", job, step, request.reason)
            return rules.to_info(new)

    def list(self, job: str) -> list[checkpoint_pb2.CheckpointInfo]:
        if job:
            _check(job, 0)
        return [rules.to_info(r) for (j, _), r in sorted(self._records().items()) if not job or j == job]

    def restore_target(self, job: str) -> checkpoint_pb2.RestoreTarget:
        _check(job, 0)
        view = self.state.require_leader()
        records = [r for (j, _), r in view.catalog.items() if j == job]
        target, why = rules.restore_target(records, view.rollbacks.get(job))
        if target is None:
            return checkpoint_pb2.RestoreTarget(found=False, reason=why)
        return checkpoint_pb2.RestoreTarget(found=True, checkpoint=rules.to_info(target), reason=why)

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
