"""This node's memory snapshots as the leader learns them: an inventory announced on the heartbeat
stream (``HeartbeatRequest.memory``), not one catalog RPC per rank and step.

A memory snapshot is soft state (coordinator/memory_ledger.py): the leader keeps the newest report per
node in memory and a new leader hears it again, because every stream's first message carries the whole
report. The inventory holds the snapshots this node vouches for: its own ranks' (the training's
``CommitShard(tier="mem")``, answered at once: the leader's verdict comes when records are built) and
the replicas it took for the node it mirrors (agent.replica_intake). Before each report it drops what
the memory tier no longer holds (the keep rule evicted it), so a report is what the tier has now. It is
kept beside the tier too (:data:`FILE`, rewritten on every change): a restarted agent announces the
snapshots its tier (tmpfs) still holds, not an empty tier that would make the leader forget them.

The heartbeat asks :meth:`MemoryInventory.take` for each message (the report on a stream's first
message and whenever it changed; ``None`` otherwise); :meth:`changed` says whether a message is due
for it (a sender that only writes on changes asks that).
"""

from __future__ import annotations

import logging
import os
import threading

from ftd.checkpoints.copy import published_manifest
from ftd.checkpoints.layout import (
    MANIFEST,
    MAX_RANK,
    BadIdentifier,
    FileEntry,
    ShardManifest,
    check_job,
    shard_prefix,
)
from ftd.storage_backends.memory import MemoryTier
from ftd.v1 import checkpoint_pb2, coordinator_pb2

from .errors import BadRequest, CopyMissing

log = logging.getLogger("ftd.agent.memory_report")
MAX_HELD = 4096  # snapshots announced per node at most (the leader ignores a bigger report)
FILE = ".ftd-memory-inventory"  # in the memory tier's root: a reserved name, skipped by listings and scans


def manifest_proto(m: ShardManifest) -> checkpoint_pb2.ShardManifest:
    return checkpoint_pb2.ShardManifest(
        job=m.job, step=m.step, epoch=m.epoch, rank=m.rank, world_size=m.world_size, format=m.format,
        created_unix_s=m.created_unix_s,
        files=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in m.files])


def check_manifest(m: checkpoint_pb2.ShardManifest) -> str:
    """Why a training's memory snapshot cannot be announced ("" when it can): the leader's own cheap
    checks, run here so the training hears of a bad manifest at once."""
    try:
        check_job(m.job)
    except BadIdentifier as exc:
        return f"manifest.{exc}"
    if m.step < 0 or not 1 <= m.world_size <= MAX_RANK + 1 or not 0 <= m.rank < m.world_size:
        return f"manifest: step {m.step}, rank {m.rank} of world size {m.world_size} out of range"
    if m.format not in ("torch", "dcp"):
        return f"manifest.format: must be 'torch' or 'dcp', got {m.format[:40]!r}"
    if not m.files:
        return "manifest.files: a shard has at least one file"
    return ""


def _checksum(m: checkpoint_pb2.ShardManifest) -> str:
    files = tuple(FileEntry(f.name, f.size, f.crc32c) for f in m.files)
    return ShardManifest(m.job, m.step, m.epoch, m.rank, m.world_size, m.format, files, 0.0).checksum


class MemoryInventory:
    """The memory snapshots this node announces, keyed by (job, step, rank); thread-safe (the
    service's threads record, the heartbeat's request thread reports)."""

    def __init__(self, store: MemoryTier, node_id: str) -> None:
        self.store = store
        self.node_id = node_id
        self._held: dict[tuple[str, int, int], coordinator_pb2.MemorySnapshot] = {}
        self._lock = threading.Lock()
        self.version = 0  # bumped on every change (the leader ignores an older report of this agent)
        self._sent = -1  # the version the last report carried
        self._path = store.root / FILE
        self._writing = threading.Lock()
        try:
            kept = coordinator_pb2.MemoryReport.FromString(self._path.read_bytes())
        except FileNotFoundError:
            kept = coordinator_pb2.MemoryReport()
        except (OSError, ValueError) as exc:  # DecodeError is a ValueError: start empty, say so
            log.warning("memory inventory %s unreadable (%s): this node announces its new snapshots only",
                        self._path, exc)
            kept = coordinator_pb2.MemoryReport()
        for snap in kept.snapshots:  # what the tier still holds is checked before each report
            self._held[(snap.manifest.job, snap.manifest.step, snap.manifest.rank)] = snap

    def own(self, request: checkpoint_pb2.CommitShardRequest) -> checkpoint_pb2.CommitShardResponse:
        """A rank of this node saved a memory snapshot: recorded here, announced with the next
        heartbeat. The answer is immediate and says only what this node knows: the one shard with its
        copy here (the step is valid once the leader has every rank's report; ``GetRestoreTarget``
        and ``ListCheckpoints`` give the merged view)."""
        m = request.manifest
        why = check_manifest(m)
        if why:
            raise BadRequest(why)
        if not self.store.is_published(shard_prefix(m.job, m.step, m.rank), MANIFEST):
            raise CopyMissing(f"{m.job} step {m.step} rank {m.rank} is not in the memory tier of node {self.node_id}: "
                              "write it there before announcing it")
        snap = coordinator_pb2.MemorySnapshot(manifest=m, cadence=request.cadence[:200])
        if request.HasField("restored_step"):
            snap.restored_step = request.restored_step
        if request.HasField("job_round"):
            snap.job_round = request.job_round
        with self._lock:
            self._held[(m.job, m.step, m.rank)] = snap
            self.version += 1
            version = self.version
        self._keep()
        info = checkpoint_pb2.CheckpointInfo(
            job=m.job, step=m.step, epoch=m.epoch, world_size=m.world_size, format=m.format,
            created_unix_s=m.created_unix_s, valid=False, cadence=snap.cadence,
            status="in memory here; the leader counts it once this node's report reaches it",
            shards=[checkpoint_pb2.ShardInfo(rank=m.rank, bytes=sum(f.size for f in m.files), files=m.files,
                                             checksum=_checksum(m),
                                             copies=[checkpoint_pb2.ShardCopy(tier="mem", location=self.node_id)],
                                             writer=self.node_id)])
        return checkpoint_pb2.CommitShardResponse(checkpoint=info, message=(
            f"rank {m.rank} memory snapshot of step {m.step} recorded on node {self.node_id} (report version "
            f"{version}); announced to the leader with the next heartbeat"))

    def replica(self, job: str, step: int, rank: int, owner: str) -> None:
        """A replica of ``owner``'s rank landed in the memory tier (its published manifest is read)."""
        manifest = published_manifest(self.store, shard_prefix(job, step, rank))
        if manifest is None:
            return
        snap = coordinator_pb2.MemorySnapshot(manifest=manifest_proto(manifest), replica=True, owner=owner)
        with self._lock:
            self._held[(job, step, rank)] = snap
            self.version += 1
        self._keep()

    def gone(self, job: str, step: int, rank: int) -> None:
        with self._lock:
            if self._held.pop((job, step, rank), None) is None:
                return
            self.version += 1
        self._keep()

    def _keep(self) -> None:
        """The inventory beside the tier, replaced atomically (tmpfs: a few KB per change)."""
        with self._writing:
            with self._lock:
                data = coordinator_pb2.MemoryReport(snapshots=list(self._held.values())).SerializeToString()
            tmp = self._path.with_name(FILE + ".tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, self._path)
            except OSError as exc:  # the announcement itself does not depend on it
                log.warning("could not keep the memory inventory in %s: %s", self._path, exc)

    def changed(self) -> bool:
        """Something changed since the last report: a stream message is due to carry it."""
        return self.version != self._sent

    def report(self) -> coordinator_pb2.MemoryReport:
        """The whole inventory now, less what the memory tier no longer holds."""
        with self._lock:
            held = list(self._held.items())
        missing = [key for key, _ in held if not self.store.is_published(shard_prefix(*key), MANIFEST)]
        with self._lock:
            for key in missing:
                if self._held.pop(key, None) is not None:
                    self.version += 1
            snaps = sorted(self._held.items())[-MAX_HELD:]
            self._sent = self.version
            return coordinator_pb2.MemoryReport(snapshots=[s for _, s in snaps], version=self.version)

    def take(self, first: bool) -> coordinator_pb2.MemoryReport | None:
        """For one heartbeat message: the report on a stream's ``first`` message or when it changed."""
        return self.report() if first or self.changed() else None


__all__ = ["FILE", "MAX_HELD", "MemoryInventory", "check_manifest", "manifest_proto"]
