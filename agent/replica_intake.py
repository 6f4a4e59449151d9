"""The buddy's side of replication: a memory snapshot of another node's rank taken into this node's
memory tier, off the ``WriteShard`` stream (:func:`receive_replica`) or pulled over the holder's bulk
port (:func:`receive_pulled`, ``PullReplica``), and the metrics of both sides. The holder's side,
the queue and the pushes, is :mod:`.replicator`.

Both take a replica the same way: the header's checks and the budget first (:func:`_admit`: room made
by the keep rule, ``RESOURCE_EXHAUSTED`` naming the sizes, never an OOM; a replica the rule would
drop at once is answered "superseded", not taken), then the files into the memory tier through
:func:`~ftd.checkpoints.copy.copy_shard` (every file's CRC32C checked as it lands, the manifest
checked against the announced shard and the files that arrived, published last), then the copy
recorded by this node itself: in its memory inventory (agent.memory_report), announced to the leader on
the heartbeat stream (``record``: the request as a ``RecordCopy(tier="mem", location=<its own id>)``
would say it, and the replica's owner); on failure the record is told which older snapshots
room-making deleted.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from ftd.checkpoints.copy import CopyMismatch, Expected, copy_shard, files_of, published_manifest
from ftd.checkpoints.layout import (
    MANIFEST,
    BadIdentifier,
    ManifestError,
    ShardManifest,
    check_job,
    check_rank,
    check_step,
    shard_prefix,
)
from ftd.rpc import rpc_code, rpc_details
from ftd.storage_backends.atomic_files import leftover_name
from ftd.storage_backends.base import InvalidKey, StorageError
from ftd.storage_backends.memory import MemoryFull, MemoryTier, evictions, superseded
from ftd.storage_backends.tiers import Tier
from ftd.v1 import agent_pb2, checkpoint_pb2

from . import bulk_copy
from .errors import BadRequest, CoordinatorUnreachable, CopyCorrupt, NodeCannot, NoFastCopy, NoRoom, PeerDenied
from .landing import SLACK, Slot, reclaim
from .peer_copy import MAX_MANIFEST_BYTES, BulkSource, ChunkSource

log = logging.getLogger("ftd.agent.replicator")
# Records a replica landed (or a snapshot room-making deleted): the request, and the replica's owner.
Record = Callable[[checkpoint_pb2.RecordCopyRequest, str], Any]


class ReplicationMetrics:
    """``ftd_agent_memory_*``: what this node sent to its buddy and what it holds for others."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.replicated_bytes = Counter("ftd_agent_memory_replicated_bytes_total",
                                        "Memory snapshot bytes this node pushed to its buddy", registry=r)
        self.replicated = Counter("ftd_agent_memory_replicated_shards_total",
                                  "Memory snapshots this node pushed to its buddy", registry=r)
        self.failures = Counter("ftd_agent_memory_replication_failures_total",
                                "Memory snapshots not replicated (no_buddy, unreachable, refused, error, dropped)",
                                ["reason"], registry=r)
        self.received = Counter("ftd_agent_memory_replicas_received_total",
                                "Memory snapshots of other nodes' ranks written into this node's memory tier",
                                registry=r)
        self.refused = Counter("ftd_agent_memory_tier_refused_total",
                               "Writes into this node's memory tier refused because its budget would be exceeded "
                               "(side: replica = a buddy's push; the training's own refusals count in "
                               "ftd_agent_checkpoint_save_failures_total{reason=\"memory_full\"})", ["side"],
                               registry=r)
        self.held_bytes = Gauge("ftd_agent_memory_tier_bytes", "Bytes held in this node's memory tier", registry=r)
        self.lag = Gauge("ftd_agent_memory_replication_lag_seconds",
                         "Commit-to-buddy delay of the newest replicated memory snapshot", registry=r)
        self.by_path = Counter("ftd_agent_memory_replicated_by_path_total",
                               "Memory snapshots this node replicated to its buddy, by path (bulk: the buddy "
                               "pulled them over the bulk port; stream: WriteShard)", ["path"], registry=r)
        self.reused = Counter("ftd_agent_memory_replica_pages_reused_total",
                              "Files of a buddy's replica received into the pages of the replica it replaced "
                              "(nothing freed or allocated)", registry=r)
        self.fallbacks = Counter("ftd_agent_memory_replication_fallbacks_total",
                                 "Replications that fell back from the bulk path to the WriteShard stream",
                                 registry=r)


# The sender's rule (agent.peer_rules.may_write through the service): called with the header and a
# world size before anything is taken (the header's: 0 when it names none), then with the manifest's
# once it arrived, before it is published; raises PeerDenied. The training's own calls: none.
SourceCheck = Callable[[agent_pb2.WriteShardHeader, int, bool], None]


def _announced(where: str, raw: bytes, ident: tuple[str, int, int], received: Expected,
               header: agent_pb2.WriteShardHeader | None = None, check: SourceCheck | None = None) -> bytes:
    """A replica's manifest (the last thing to arrive, by either path), accepted only when it is of the
    shard that was announced, of the world size announced (when one was), lists exactly the files
    that arrived, and the sender may write that rank (``check``)."""
    try:
        manifest = ShardManifest.decode(where, raw)
    except ManifestError as exc:
        raise CopyCorrupt(str(exc)) from exc
    if (manifest.job, manifest.step, manifest.rank) != ident:
        raise BadRequest(f"the manifest is of {manifest.job} step {manifest.step} rank {manifest.rank}")
    if header is not None and header.world_size and manifest.world_size != header.world_size:
        raise BadRequest(f"the manifest is of a world of {manifest.world_size} ranks, the header said "
                         f"{header.world_size}")
    if header is not None and check is not None:
        check(header, manifest.world_size, True)
    listed = files_of(manifest)
    if listed != received:
        raise CopyCorrupt(f"the files received {dict(received)} are not the manifest's {listed}")
    return raw


class _ReplicaSource(ChunkSource):
    """``WriteShard``'s body after the header: a chunk stream (:class:`~.peer_copy.ChunkSource`)
    whose manifest, last, must be of the header's shard and list exactly the files that arrived."""

    def __init__(self, messages: Iterator[agent_pb2.WriteShardChunk], prefix: str, ident: tuple[str, int, int],
                 header: agent_pb2.WriteShardHeader, check: SourceCheck | None = None) -> None:
        super().__init__(_chunks(messages), f"the replica of {prefix}", BadRequest, self._count)
        self.prefix, self.ident, self.declared, self.received = prefix, ident, int(header.bytes), 0
        self.header, self.check = header, check

    def _count(self, n: int) -> None:
        self.received += n
        if self.received > self.declared:
            raise BadRequest(f"the replica sends more than the {self.declared} bytes its header declared")

    def manifest(self, received: Expected) -> bytes:
        return _announced(self.where, super().manifest(received), self.ident, received, self.header, self.check)


def _chunks(messages: Iterator[agent_pb2.WriteShardChunk]) -> Iterator[agent_pb2.ShardChunk]:
    for msg in messages:
        if not msg.HasField("chunk"):
            raise BadRequest("a second header in one WriteShard stream")
        yield msg.chunk


def receive_replica(messages: Iterator[agent_pb2.WriteShardChunk], mem: Tier, node_id: str,
                    record: Record,
                    metrics: ReplicationMetrics | None = None,
                    check: SourceCheck | None = None) -> agent_pb2.WriteShardResponse:
    """Writes a buddy's memory snapshot into this node's memory tier (through
    :func:`~ftd.checkpoints.copy.copy_shard`) and records the copy; raises an
    :class:`~.errors.AgentError` (its table gives the status to answer) when it cannot be taken.
    ``check``: the sender's rule, before any room is made and again on the manifest."""
    started = time.monotonic()
    first = next(messages, None)
    if first is None or not first.HasField("header"):
        raise BadRequest("the first WriteShard message must be the header")
    if check is not None:
        check(first.header, int(first.header.world_size), False)
    taken = _admit(first.header, mem, metrics)
    if isinstance(taken, agent_pb2.WriteShardResponse):
        return taken
    source = _ReplicaSource(messages, taken.prefix, taken.ident, first.header, check)
    _land(source, taken, mem, node_id, record)
    _received(mem, metrics)
    return agent_pb2.WriteShardResponse(bytes=source.received, seconds=time.monotonic() - started,
                                        message=f"recorded {mem.name}@{node_id}")


def receive_pulled(request: agent_pb2.PullReplicaRequest, host: str, mem: Tier, node_id: str,
                   record: Record,
                   metrics: ReplicationMetrics | None = None, timeout_s: float = 120.0,
                   check: SourceCheck | None = None) -> agent_pb2.WriteShardResponse:
    """The bulk path of :func:`receive_replica`: the same header checks (budget, per-rank limit),
    then the holder's offered files pulled from ``host`` (:func:`.bulk_copy.receive`: every record's
    tag and every file's CRC32C against the holder's manifest checked as it lands), the manifest
    checked against what arrived, published last, and the copy recorded. A pull that fails is
    :class:`~.errors.NoFastCopy`: the holder pushes the snapshot with ``WriteShard`` instead.

    Its landing reserve is the replica the keep rule evicts for it: that replica's files become the
    slots the new one's files of the same names are received into (:func:`.landing.reclaim`: the
    pages are reused in place, not freed and allocated again; only files nobody holds open or
    mapped). A spare's own landing reserve stays for the restore it waits for."""
    started = time.monotonic()
    h, offer = request.header, request.offer
    if h.source != request.source:
        raise BadRequest(f"header.source {h.source[:100]!r} is not the announcing node {request.source[:100]!r}")
    names = [f.name for f in offer.files]
    if not names or names[-1] != MANIFEST or names.count(MANIFEST) != 1 or len(set(names)) != len(names):
        raise BadRequest("offer.files: each file once, the manifest last")
    if offer.files[-1].size > MAX_MANIFEST_BYTES:
        raise BadRequest(f"offer.files: a manifest of {offer.files[-1].size} bytes")
    if sum(f.size for f in offer.files) != h.bytes:
        raise BadRequest(f"offer.files: {sum(f.size for f in offer.files)} bytes, the header declares {h.bytes}")
    unsummed = [f.name for f in offer.files[:-1] if not f.crc32c]
    if unsummed:
        raise NoFastCopy(f"the holder's manifest gives no CRC32C for {unsummed[:3]}: push with WriteShard")
    if check is not None:
        check(h, int(h.world_size), False)
    taken = _admit(h, mem, metrics, {f.name: f.size for f in offer.files[:-1]})
    if isinstance(taken, agent_pb2.WriteShardResponse):
        return taken
    slots = taken.slots

    def land(name: str, size: int) -> Slot | None:
        slot = slots.get(name)
        if slot is None or slot.capacity < size + SLACK:
            return None
        return slots.pop(name)

    source = _PulledReplica(host, offer, taken.ident, timeout_s, land, h, check)
    try:
        _land(source, taken, mem, node_id, record)
    except bulk_copy.BulkError as exc:
        raise NoFastCopy(f"the pull of {taken.what} from {source.where} failed ({exc}): push it with "
                         "WriteShard") from exc
    finally:
        taken.release()
    if metrics is not None:
        metrics.reused.inc(len(taken.used))
    _received(mem, metrics)
    return agent_pb2.WriteShardResponse(bytes=source.bytes, seconds=time.monotonic() - started,
                                        message=f"pulled; recorded {mem.name}@{node_id}")


@dataclass
class _Taken:
    """A replica the header admitted: room made (``deleted``: the older snapshots that went), and
    the slots reclaimed from them (file name → slot) in the ``trash`` folders they came from."""

    ident: tuple[str, int, int]
    prefix: str
    what: str
    deleted: list[int]
    owner: str = ""  # the node whose rank it is (the header's source, checked by the sender's rule)
    slots: dict[str, Slot] = field(default_factory=dict)
    trash: list[Path] = field(default_factory=list)
    used: list[str] = field(default_factory=list)

    def release(self) -> None:
        """The slots not landed in are freed, and the folders they came from removed."""
        self.used = [name for name in self.used if name not in self.slots]
        for slot in self.slots.values():
            slot.discard()
        self.slots.clear()
        for folder in self.trash:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # the evicted step's folder, when nothing else is in it
                folder.parent.rmdir()  # (a writer that made it just now makes it again: in_folder)


def _admit(h: agent_pb2.WriteShardHeader, mem: Tier, metrics: ReplicationMetrics | None,
           incoming: Mapping[str, int] | None = None) -> _Taken | agent_pb2.WriteShardResponse:
    """The header's checks, then room made and the budget checked (``MemoryFull`` answers
    :class:`~.errors.NoRoom`); a replica the keep rule would drop at once is answered, not taken.
    With ``incoming`` (file name → size: the bulk path, which lands in prepared pages) the evicted
    snapshots' files of those names are reclaimed as slots (:func:`.landing.reclaim`) and only the
    bytes beyond them count against the budget."""
    store = memory_store(mem)
    try:
        job, step, rank = check_job(h.job), check_step(h.step), check_rank(h.rank)
    except BadIdentifier as exc:
        raise BadRequest(f"header.{exc}") from exc
    if h.tier != mem.name:
        raise BadRequest(f"header.tier: replicas go to the memory tier {mem.name!r}, not {h.tier[:40]!r}")
    held = store.snapshots(job, rank)
    if superseded(held, step):
        return agent_pb2.WriteShardResponse(message=f"superseded: this node holds newer snapshots {held} of rank "
                                                    f"{rank}")
    what = f"the replica of {job} step {step} rank {rank} from {h.source[:100] or '?'}"
    taken = _Taken((job, step, rank), shard_prefix(job, step, rank), what, [], h.source)
    if incoming:
        for old in evictions(held, step):
            folder = store.folder_path(shard_prefix(job, old, rank))
            trash = leftover_name(folder, "trash")
            got = reclaim(folder, trash, {n: s for n, s in incoming.items() if n not in taken.slots})
            if trash.exists():
                taken.deleted.append(old)
                taken.trash.append(trash)
                for entry in trash.iterdir():  # the rest of the evicted snapshot goes now
                    if entry.name not in got:
                        with contextlib.suppress(OSError):
                            entry.unlink()
            taken.slots.update(got)
        taken.used = list(taken.slots)
    reused = sum(slot.capacity for slot in taken.slots.values())
    try:
        taken.deleted += store.admit(job, rank, step, max(0, int(h.bytes) - reused), what)
    except MemoryFull as exc:
        taken.release()
        if metrics is not None:
            metrics.refused.labels("replica").inc()
        log.error("refused %s: %s", what, exc)
        raise NoRoom(str(exc)) from exc
    return taken


def _land(source: Any, taken: _Taken, mem: Tier, node_id: str, record: Record) -> None:
    """The copy into the memory tier (a concurrent copy of the same step may win: checked the same
    way), then recorded; on failure the catalog is told what room-making deleted."""
    job, step, rank = taken.ident
    try:
        copy_shard(source, memory_store(mem), taken.prefix)
    except BaseException as exc:
        for old in taken.deleted:  # the catalog must not keep offering what this node no longer holds
            _record(record, job, old, rank, mem, node_id, taken.owner, present=False)
        if isinstance(exc, CopyMismatch):
            raise CopyCorrupt(str(exc)) from exc
        if isinstance(exc, InvalidKey):
            raise BadRequest(str(exc)) from exc
        raise
    landed = published_manifest(memory_store(mem), taken.prefix)
    try:
        _record(record, job, step, rank, mem, node_id, taken.owner,
                checksum=landed.checksum if landed is not None else "")
    except BaseException:  # a replica the catalog does not list is never restored: its room goes back now
        with contextlib.suppress(StorageError, OSError):
            mem.backend.delete_prefix(taken.prefix, marker_name=MANIFEST)
        raise


def _received(mem: Tier, metrics: ReplicationMetrics | None) -> None:
    if metrics is not None:
        metrics.received.inc()
        metrics.held_bytes.set(memory_store(mem).used_bytes())


class _PulledReplica(BulkSource):
    """The holder's offered files (:class:`~.peer_copy.BulkSource`, each checked against the
    CRC32C the holder's manifest gives), whose manifest, last, must be of the announced shard and
    list exactly the files that arrived."""

    def __init__(self, host: str, offer: agent_pb2.OpenShardResponse, ident: tuple[str, int, int],
                 timeout_s: float, landing: Callable[[str, int], Slot | None] | None,
                 header: agent_pb2.WriteShardHeader, check: SourceCheck | None) -> None:
        super().__init__(host, offer, None, timeout_s, landing)
        self.ident, self.header, self.check = ident, header, check

    def manifest(self, received: Expected) -> bytes:
        return _announced(self.where, super().manifest(received), self.ident, received, self.header, self.check)


def caller_host(peer: str) -> str:
    """The host of gRPC's peer string (``ipv4:10.0.0.2:53122``, ``ipv6:[::1]:53122``); "" for
    anything else (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return ""
    host = rest.rpartition(":")[0]
    return host.strip("[]")


def memory_store(mem: Tier) -> MemoryTier:
    store = mem.memory
    if store is None:
        raise NodeCannot(f"the tier {mem.name} ({mem.backend.name}) is no memory tier")
    return store


def _record(record: Record, job: str, step: int, rank: int, mem: Tier, node_id: str, owner: str,
            present: bool = True, checksum: str = "") -> None:
    try:
        record(checkpoint_pb2.RecordCopyRequest(job=job, step=step, rank=rank, tier=mem.name, location=node_id,
                                                present=present, checksum=checksum), owner)
    except (grpc.RpcError, ConnectionError) as exc:
        if present and rpc_code(exc) is grpc.StatusCode.PERMISSION_DENIED:
            raise PeerDenied(f"the catalog refused {job} step {step} rank {rank} (deleted here): "
                             f"{rpc_details(exc)}") from exc
        if present:
            raise CoordinatorUnreachable(
                f"the replica is held but could not be recorded in the catalog: {exc}") from exc
        log.warning("could not record the deletion of %s step %d rank %d from memory: %s", job, step, rank, exc)


__all__ = ["Record", "ReplicationMetrics", "caller_host", "memory_store", "receive_pulled", "receive_replica"]
