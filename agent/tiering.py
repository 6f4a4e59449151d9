"""Background tiering of committed checkpoint shards: SSD → HDD → S3, with bounded bandwidth, every
copy verified against the shard manifest while it streams, recorded in the catalog, and retention
of the newest valid checkpoints per tier.

Everything is computed from what is published on each tier (listing the tier itself) plus the
catalog's validity, so an agent restarted at any point picks up where it was: a copy interrupted
half-way is an unpublished staging folder (cleaned), an upload to S3 resumes from its journal.

Responsibility for a shard on a shared tier (a shared HDD mount, S3) lies with the node that holds
the shard on its own SSD — the node that currently owns that rank — so no two agents migrate or
delete the same shard.

The memory tier (``mem``, when the node has one) is the first hop: memory snapshots are written by
the training process and replicated to the buddy by :mod:`.replicator`; a durable step held there
reaches the SSD through :meth:`Tiering.persist`, which the training process asks for when it
commits the step on the SSD (``CommitShard`` with ``from_tier``) and waits for. The pass gives the
memory tier retention (at most :data:`~ftd.checkpoints.catalog.MEM_KEEP` restorable steps per rank)
and the cleanup of interrupted writes. Every copy, hop or migration, is
:func:`ftd.checkpoints.copy.copy_published`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from ftd.checkpoints import catalog as rules
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef
from ftd.checkpoints.copy import Copied, CopyMismatch, copy_published, files_of, published_manifest
from ftd.checkpoints.layout import MANIFEST, BadIdentifier, ManifestError, ShardManifest, parse_shard_key, shard_prefix
from ftd.storage_backends.base import (
    Crc32c,
    StorageBackend,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from ftd.storage_backends.tiers import Tier
from ftd.throttle import TokenBucket
from ftd.v1 import checkpoint_pb2

from .errors import BadRequest, CopyCorrupt, CopyMissing, NodeCannot, NoRoom, TierUnavailable

log = logging.getLogger("ftd.agent.tiering")
ShardId = tuple[str, int, int]  # (job, step, rank)
Catalog = Mapping[tuple[str, int], CheckpointRecord]  # (job, step) -> what the catalog says


@dataclass
class Migration:
    job: str
    step: int
    rank: int
    tier: str
    done: int = 0
    total: int = 0


@dataclass
class Stats:
    migrated_bytes: dict[str, int] = field(default_factory=dict)
    migrations: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    lag_steps: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    last_valid_step: dict[str, int] = field(default_factory=dict)  # job -> newest valid step


def published_shards(backend: StorageBackend) -> dict[ShardId, ShardManifest]:
    """Every published shard on a tier, by reading its manifest (a manifest that does not parse is
    logged and skipped: such a folder is not a usable copy)."""
    out: dict[ShardId, ShardManifest] = {}
    for info in backend.list(""):
        if not info.key.endswith("/" + MANIFEST):
            continue
        ident = parse_shard_key(info.key)
        if ident is None or not backend.is_published(shard_prefix(*ident), MANIFEST):
            continue
        try:
            with backend.open_read(info.key) as f:
                manifest = ShardManifest.decode(f"{backend.name}/{info.key}", f.read())
        except (ManifestError, StorageError) as exc:
            log.warning("skipping shard %s: %s", info.key, exc)
            continue
        if (manifest.job, manifest.step, manifest.rank) == ident:
            out[ident] = manifest
    return out


# An unreachable tier (S3 down) is retried after this long, doubling up to the maximum: meanwhile its
# migrations and its retention are skipped, so the other tiers' work never waits on its retries.
DOWN_BACKOFF_S = (5.0, 60.0)


def next_backoff(previous_s: float, bounds: tuple[float, float] = DOWN_BACKOFF_S) -> float:
    """How long an unreachable tier rests after one more failed try (``previous_s`` 0: the first)."""
    low, high = bounds
    return min(high, max(low, 2 * previous_s))


class Tiering:
    def __init__(
        self,
        tiers: list[Tier],
        catalog: Callable[[str, Any], Any],  # (method, request) -> response, on the coordinator
        keep: int | Mapping[str, int] = 3,  # per tier: a number for every durable tier, or tier -> number
        bandwidth_bytes_s: float = 0.0,
        interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        stale_after_s: float = 3600.0,
    ) -> None:
        durable = [t for t in tiers if t.name != rules.MEMORY]
        if not durable or durable[0].name != "ssd":
            raise ValueError("the first tier after the memory tier must be the node's SSD (hot) tier")
        self.tiers = tiers  # every tier of the node, the memory tier included (peers read them all)
        self.ssd = durable[0]
        self.durable = durable[1:]  # migration targets, fastest first
        self.mem = next((t for t in tiers if t.name == rules.MEMORY), None)
        self.catalog = catalog
        self.keep = keep
        self.bucket = TokenBucket(bandwidth_bytes_s, burst=max(bandwidth_bytes_s, 1 << 20))
        self.interval_s = interval_s
        self.clock = clock
        self.sleep = sleep
        self.stats = Stats()
        self.current: Migration | None = None
        self.stale_after_s = stale_after_s
        self.cleanup_every_s = 60.0
        self._last_cleanup = -1e18
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, float]] = {}  # tier -> (retry at, backoff): unreachable tiers

    def keep_on(self, tier: Tier) -> int:
        """Restorable steps kept per rank on ``tier``: the memory tier keeps at most
        :data:`~ftd.checkpoints.catalog.MEM_KEEP`."""
        if isinstance(self.keep, Mapping):
            return self.keep.get(tier.name, rules.MEM_KEEP if tier.name == rules.MEMORY else 3)
        return min(self.keep, rules.MEM_KEEP) if tier.name == rules.MEMORY else self.keep

    def notify(self) -> None:
        """A shard was just committed on the SSD: start a pass now."""
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.pass_once()
            except Exception:  # one bad pass must not end tiering
                log.exception("tiering pass failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    # ---- one pass ------------------------------------------------------------------------------

    def pass_once(self) -> None:
        with self._lock:
            ssd = self.ssd
            local = published_shards(ssd.backend)
            in_memory = published_shards(self.mem.backend) if self.mem is not None else {}
            jobs = sorted({job for job, _, _ in [*local, *in_memory]})
            records = {job: self._records(job) for job in jobs}
            if any(r is None for r in records.values()):
                return  # without the catalog nothing is copied or deleted
            catalog: dict[tuple[str, int], CheckpointRecord] = {}
            for job, recs in records.items():
                for rec in recs or []:
                    catalog[(job, rec.step)] = rec
                valid = [r.step for r in recs or [] if r.valid]
                if valid:
                    self.stats.last_valid_step[job] = max(valid)
            now = self.clock()
            if now - self._last_cleanup >= self.cleanup_every_s:
                self._last_cleanup = now
                for tier in self.durable:
                    try:  # what interrupted copies left: staging folders, abandoned multipart uploads
                        tier.backend.cleanup("", older_than_s=self.stale_after_s, marker_name=MANIFEST)
                    except StorageError as exc:
                        log.warning("cleanup of %s failed: %s", tier.name, exc)
                if self.mem is not None:
                    try:  # RAM: an interrupted snapshot or replica is not left for an hour
                        self.mem.backend.cleanup("", older_than_s=min(self.stale_after_s, 120.0), marker_name=MANIFEST)
                    except StorageError as exc:
                        log.warning("cleanup of %s failed: %s", self.mem.name, exc)
            for tier in self.durable:
                self._migrate_to(tier, local, catalog, copy=self._reachable(tier, now))
            for tier in self.tiers:
                if not self._reachable(tier, now):
                    continue
                try:
                    self._retain(tier, in_memory if tier is self.mem else local, catalog)
                except StorageUnavailable as exc:
                    self._mark_down(tier, exc)
                else:
                    self._down.pop(tier.name, None)

    def _reachable(self, tier: Tier, now: float) -> bool:
        """False while ``tier`` rests after failing as unreachable (:data:`DOWN_BACKOFF_S`)."""
        down = self._down.get(tier.name)
        return down is None or now >= down[0]

    def _mark_down(self, tier: Tier, exc: Exception) -> None:
        wait = next_backoff(self._down.get(tier.name, (0.0, 0.0))[1])
        self._down[tier.name] = (self.clock() + wait, wait)
        self.stats.errors[tier.name] = self.stats.errors.get(tier.name, 0) + 1
        log.warning("tier %s unreachable, it lags until it is back (next try in %.0fs; other tiers go on): %s",
                    tier.name, wait, exc)

    def _records(self, job: str) -> list[CheckpointRecord] | None:
        try:
            infos = self.catalog("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=job)).checkpoints
        except Exception as exc:
            log.warning("catalog unreachable, tiering paused: %s", exc)
            return None
        return [rules.from_info(info) for info in infos]

    @staticmethod
    def _has_copy(record: CheckpointRecord, rank: int, tier: Tier) -> bool:
        shard = record.shards.get(rank)
        return shard is not None and shard.has_good_copy(CopyRef(tier.name, tier.location))

    def _floor(self, catalog: Catalog, job: str, tier: Tier) -> int | None:
        """:func:`~ftd.checkpoints.catalog.job_floor` of ``job`` for ``tier``: counting, for a durable
        tier, only steps every rank holds on a durable tier somewhere (a step in memory only, saved
        every step, must not push the durable steps below the floor)."""
        durable = tier is not self.mem

        def kept(rec: CheckpointRecord) -> bool:
            return rec.restorable and (not durable or all(
                any(c.tier != rules.MEMORY for c in s.good_copies()) for s in rec.shards.values()))

        return rules.job_floor({s: kept(r) for (j, s), r in catalog.items() if j == job}, self.keep_on(tier))

    def _migrate_to(self, tier: Tier, local: Mapping[ShardId, ShardManifest], catalog: Catalog,
                    copy: bool = True) -> None:
        """Copies what ``tier`` lacks, newest first, and only the steps its retention would keep: per
        (job, rank) the newest ``keep_on(tier)`` restorable ones and any newer step in progress (a
        backlog after an outage is not uploaded to be deleted at once). ``copy`` False: only the
        pending count and the lag are updated, for a tier resting after being unreachable."""
        eligible: dict[tuple[str, int], list[tuple[ShardId, ShardManifest]]] = {}
        for ident, manifest in local.items():
            record = catalog.get((ident[0], ident[1]))
            # Committed by this rank and not invalidated (a step still in progress is copied too).
            if record is None or record.invalid_reason or ident[2] not in record.shards:
                continue
            if record.shards[ident[2]].checksum != manifest.checksum:
                continue  # another timeline's bytes under the same step (a restart re-saving it): not this shard
            eligible.setdefault((ident[0], ident[2]), []).append((ident, manifest))
        todo = []
        floors = {job: self._floor(catalog, job, tier) for job, _ in eligible}
        for (job, _), shards in eligible.items():
            # From the keep-th newest restorable step on (steps in progress newer than it included),
            # and never below the job's own kept steps: a replaced node back as a spare still holds
            # the shards of the rank it had, which the tier's retention would delete at once.
            restorable = sorted((i[1] for i, _ in shards if catalog[(i[0], i[1])].restorable), reverse=True)
            floor = restorable[self.keep_on(tier) - 1] if len(restorable) >= self.keep_on(tier) else -1
            job_kept = floors[job]
            floor = max(floor, -1 if job_kept is None else job_kept)
            for ident, manifest in shards:
                record = catalog[(ident[0], ident[1])]
                if ident[1] >= floor and not self._has_copy(record, ident[2], tier):
                    todo.append((ident, manifest))
        self.stats.pending[tier.name] = len(todo)
        newest_local = max((s for (_, s, _) in local), default=0)
        for ident, manifest in sorted(todo, key=lambda t: -t[0][1]) if copy else []:  # newest first
            shard = catalog[(ident[0], ident[1])].shards[ident[2]]
            try:
                self._copy(self.ssd, tier, manifest, fresh=CopyRef(tier.name, tier.location).key in shard.bad)
                self._down.pop(tier.name, None)
            except StorageUnavailable as exc:
                self._mark_down(tier, exc)
                break
            except StorageFull as exc:
                self.stats.errors[tier.name] = self.stats.errors.get(tier.name, 0) + 1
                log.error("tier %s is full, shard %s not copied: %s", tier.name, ident, exc)
                break
            except StorageError as exc:
                self.stats.errors[tier.name] = self.stats.errors.get(tier.name, 0) + 1
                log.error("copy of %s to %s failed: %s", ident, tier.name, exc)
            except (grpc.RpcError, ConnectionError) as exc:
                log.warning("copy of %s to %s not recorded in the catalog (retried next pass): %s", ident,
                            tier.name, exc)
            self.stats.pending[tier.name] -= 1
        on_tier = [s for (j, s, r) in local if (rec := catalog.get((j, s))) and self._has_copy(rec, r, tier)]
        self.stats.lag_steps[tier.name] = newest_local - max(on_tier, default=newest_local if not local else 0)

    def _copy(self, src: Tier, dst: Tier, manifest: ShardManifest, fresh: bool = False) -> None:
        """``fresh``: the catalog records the copy on ``dst`` as corrupt. Its folder is deleted first:
        a published folder with the same manifest would otherwise count as copied and be recorded
        present again, making a proven-corrupt copy restorable again."""
        prefix = shard_prefix(manifest.job, manifest.step, manifest.rank)
        if fresh:
            log.warning("the copy of %s on %s is recorded corrupt: replacing it", prefix, dst.name)
            dst.backend.delete_prefix(prefix, marker_name=MANIFEST)
        move = Migration(manifest.job, manifest.step, manifest.rank, dst.name, 0, manifest.total_bytes)
        self.current = move

        def progress(n: int) -> None:
            move.done += n
            wait = self.bucket.delay(n, self.clock())
            if wait > 0:
                self.sleep(wait)

        try:
            copied = copy_published(src.backend, dst.backend, manifest, progress=progress)
        except CopyMismatch as exc:
            log.error("source copy of %s on %s is corrupt (%s); not migrated", prefix, src.name, exc)
            self.catalog("RecordCopy", checkpoint_pb2.RecordCopyRequest(
                job=manifest.job, step=manifest.step, rank=manifest.rank, tier=src.name,
                location=src.location, present=True, corrupt_reason=exc.message))
            return
        finally:
            self.current = None
        if not copied.already:
            self.stats.migrated_bytes[dst.name] = self.stats.migrated_bytes.get(dst.name, 0) + manifest.total_bytes
            self.stats.migrations[dst.name] = self.stats.migrations.get(dst.name, 0) + 1
            log.info("copied %s to %s (%d bytes in %.2fs)", prefix, dst.name, manifest.total_bytes, copied.seconds)
        self._record(manifest, dst, present=True)

    def persist(self, source: str, target: str, shard: checkpoint_pb2.ShardManifest) -> Copied:
        """The first hop, for a durable step whose bytes are in the memory tier (``source``): the
        memory copy's files copied to the SSD (``target``; :func:`~ftd.checkpoints.copy.copy_published`,
        every file checked against its manifest, which must list the files of ``shard``: what the
        training commits). Runs on the caller's thread, beside the pass (which copies nothing into
        the SSD); the caller commits the copy. Raises :class:`~.errors.AgentError`s: the training process
        waits for the answer."""
        try:
            prefix = shard_prefix(shard.job, shard.step, shard.rank)
        except BadIdentifier as exc:
            raise BadRequest(f"manifest.{exc}") from exc
        if self.mem is None or source != self.mem.name or target != self.ssd.name:
            raise NodeCannot(f"{prefix}: no hop from {source[:40]!r} to {target[:40]!r} here (the hop goes from "
                             f"{self.mem.name if self.mem is not None else 'a memory tier'} to {self.ssd.name})")
        files = {f.name: (f.size, f.crc32c) for f in shard.files}
        try:
            manifest = published_manifest(self.mem.backend, prefix)
            if manifest is None:
                raise CopyMissing(f"{self.mem.backend.name}: no published memory copy of {prefix}")
            if files_of(manifest) != files:
                raise CopyMissing(f"{self.mem.backend.name}: the memory copy of {prefix} is another one than the "
                                  "committed shard (a newer snapshot of another timeline replaced it)")
            return copy_published(self.mem.backend, self.ssd.backend, manifest)
        except CopyMismatch as exc:
            raise CopyCorrupt(f"{prefix}: the memory copy changed while copied to the SSD: {exc}") from exc
        except StorageFull as exc:
            raise NoRoom(str(exc)) from exc
        except (StorageError, OSError) as exc:
            raise TierUnavailable(f"{prefix}: copying to {self.ssd.backend.name} failed: {exc}") from exc

    def _record(self, manifest: ShardManifest, tier: Tier, present: bool) -> None:
        self.catalog("RecordCopy", checkpoint_pb2.RecordCopyRequest(
            job=manifest.job, step=manifest.step, rank=manifest.rank, tier=tier.name, location=tier.location,
            present=present, checksum=manifest.checksum if present else ""))

    def verify(self, job: str, step: int, rank: int, tier_name: str) -> tuple[bool, str, int]:
        """Re-reads one shard copy on one of this node's tiers against the catalog's record:
        the manifest, then every file's size and CRC32C. Returns (ok, what was wrong, bytes read)."""
        tier = next((t for t in self.tiers if t.name == tier_name), None)
        if tier is None:
            return False, f"this node has no {tier_name} tier", 0
        record = next((r for r in self._records(job) or [] if r.step == step), None)
        shard = record.shards.get(rank) if record is not None else None
        if shard is None:
            return False, f"the catalog has no rank {rank} of {job} step {step}", 0
        prefix = shard_prefix(job, step, rank)
        where = f"{tier.name}:{prefix}"
        total = 0
        try:
            if not tier.backend.is_published(prefix, MANIFEST):
                return False, f"{where}: no published shard (manifest missing)", 0
            with tier.backend.open_read(f"{prefix}/{MANIFEST}") as f:
                manifest = ShardManifest.decode(f"{tier.backend.name}/{prefix}/{MANIFEST}", f.read())
            if manifest.checksum != shard.checksum:
                return False, f"{where}: manifest checksum {manifest.checksum}, catalog {shard.checksum}", 0
            for entry in manifest.files:
                crc = Crc32c()
                size = 0
                with tier.backend.open_read(f"{prefix}/{entry.name}") as f:
                    while block := f.read(8 << 20):
                        crc.update(block)
                        size += len(block)
                total += size
                if size != entry.size or crc.hexdigest() != entry.crc32c:
                    return False, (f"{where}/{entry.name}: {size} bytes crc32c {crc.hexdigest()}, expected "
                                   f"{entry.size} bytes crc32c {entry.crc32c}"), total
        except (ManifestError, StorageError) as exc:
            return False, f"{where}: {exc}", total
        return True, "", total

    def _retain(self, tier: Tier, local: Mapping[ShardId, ShardManifest], catalog: Catalog) -> None:
        """Per (job, rank) this node is responsible for: keep the newest ``keep`` restorable steps
        committed on this tier (see :func:`ftd.checkpoints.catalog.retention`). ``local``: what is
        published on the SSD (on the memory tier: what is published there)."""
        mine = {(j, r) for (j, _, r) in local}
        here = local if tier is self.ssd or tier is self.mem else published_shards(tier.backend)
        by_rank: dict[tuple[str, int], dict[int, ShardManifest]] = {}
        for (job, step, rank), manifest in here.items():
            if tier.shared and (job, rank) not in mine:
                continue  # another node owns that rank now
            by_rank.setdefault((job, rank), {})[step] = manifest
        floors = {job: self._floor(catalog, job, tier) for job, _ in by_rank}
        for (job, rank), steps in by_rank.items():
            valid = {s: rec.restorable for s in steps if (rec := catalog.get((job, s))) is not None}
            on_tier = {s: True for s in steps}
            for deletion in rules.retention(on_tier, valid, self.keep_on(tier), floors[job]):
                prefix = shard_prefix(job, deletion.step, rank)
                log.info("retention on %s: deleting %s (%s)", tier.name, prefix, deletion.reason)
                tier.backend.delete_prefix(prefix, marker_name=MANIFEST)
                self.stats.deleted[tier.name] = self.stats.deleted.get(tier.name, 0) + 1
                if (job, deletion.step) in catalog:
                    try:
                        self._record(steps[deletion.step], tier, present=False)
                    except Exception as exc:
                        log.warning("could not record the deletion of %s: %s", prefix, exc)

