"""Replication of memory snapshots to the buddy node: the memory tier survives the loss of a node.

When a training process of this node commits a memory snapshot (``CommitShard`` with tier ``mem``),
the agent queues it here; a background thread pushes it to the buddy (the next alive node in
another failure domain, chosen by the coordinator and named in this node's assignment:
``coordinator/buddies.py``, :func:`.peers.buddy_of`) with the client-streaming
``WriteShard`` RPC: a header (job, step, rank, bytes), then the shard's files as ``ShardChunk``s,
each file closed by its CRC32C, the manifest last.

Off the training's critical path and bounded:

* the queue holds at most ``max_pending`` shards, one per (job, rank): a newer snapshot of a rank
  replaces its pending older one, and the newest goes first (an old snapshot is worth little once a
  newer one exists);
* one shard is in flight at a time, read lazily ``chunk_bytes`` at a time from the memory tier, so
  the bytes in flight are bounded by the chunk and gRPC's flow-control window, whatever the shard's
  size; ``bandwidth_bytes_s`` caps the rate (0: none).

The buddy (:func:`receive_replica`) checks the header against its own budget and the per-rank limit
first (:class:`~ftd.storage_backends.memory.MemoryTier`: ``RESOURCE_EXHAUSTED`` naming the sizes:
never an OOM), writes the files into its memory tier with
:func:`~ftd.checkpoints.copy.copy_shard` (every file's CRC32C checked as it lands, the manifest —
checked against what arrived — published last) and records its copy in the catalog itself
(``RecordCopy(tier="mem", location=<its own id>)``: a node records only copies at its own location).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from ftd.checkpoints.copy import CopyMismatch, Expected, copy_shard, files_of
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
from ftd.rpc import describe
from ftd.storage_backends.base import InvalidKey, StorageError
from ftd.storage_backends.memory import MemoryFull, MemoryTier, superseded
from ftd.storage_backends.tiers import Tier
from ftd.throttle import TokenBucket
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2

from .errors import (
    AgentError,
    BadRequest,
    CallCancelled,
    CoordinatorUnreachable,
    CopyCorrupt,
    CopyMissing,
    NodeCannot,
    NoRoom,
    PeerUnreachable,
    peer_error,
)
from .peer_copy import CHUNK_BYTES, ChunkSource, serve_shard
from .peers import Buddy

log = logging.getLogger("ftd.agent.replicator")
# A push's failure (the buddy's answer, by the agents' one table) as ftd_agent_memory_replication_failures_total's
# reason; any other answer counts as "error".
FAILURE_REASONS: dict[type[AgentError], str] = {NoRoom: "refused", PeerUnreachable: "unreachable",
                                                CallCancelled: "dropped"}


@dataclass(frozen=True)
class Pending:
    job: str
    step: int
    rank: int
    queued_at: float


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


class Replicator:
    def __init__(self, mem: Tier, node_id: str, told_buddy: Callable[[], Buddy],
                 open_channel: Callable[[str], grpc.Channel], catalog: Callable[[str, Any], Any] | None = None,
                 metrics: ReplicationMetrics | None = None,
                 max_pending: int = 4, chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 120.0,
                 bandwidth_bytes_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.mem = mem
        self.store = _store(mem)
        self.node_id = node_id
        self.told_buddy = told_buddy  # the buddy in this node's latest assignment, with its address
        self.open_channel = open_channel
        self.catalog = catalog  # (method, request) -> response, on the coordinator
        self.metrics = metrics or ReplicationMetrics()
        self.max_pending = max_pending
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.bucket = TokenBucket(bandwidth_bytes_s, burst=max(bandwidth_bytes_s, float(chunk_bytes)))
        self.clock = clock
        self.last_buddy = Buddy(None, "not chosen yet")
        self._pending: OrderedDict[tuple[str, int], Pending] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._channel: tuple[str, grpc.Channel] | None = None
        self.store.create()

    def receive(self, messages: Iterator[agent_pb2.WriteShardChunk]) -> agent_pb2.WriteShardResponse:
        """The buddy's side of ``WriteShard`` (:func:`receive_replica`) on this node's memory tier."""
        catalog = self.catalog
        if catalog is None:
            raise NodeCannot(f"node {self.node_id} cannot record replicas")
        return receive_replica(messages, self.mem, self.node_id, lambda req: catalog("RecordCopy", req), self.metrics)

    # ---- the queue ---------------------------------------------------------------------------------

    def enqueue(self, job: str, step: int, rank: int) -> None:
        """Queues a committed memory snapshot; an older pending one of the same rank is dropped, and
        the oldest pending one when the queue is full."""
        with self._lock:
            key = (job, rank)
            old = self._pending.get(key)
            if old is not None and old.step >= step:
                return
            if old is not None:
                self.metrics.failures.labels("dropped").inc()
            self._pending[key] = Pending(job, step, rank, self.clock())
            while len(self._pending) > self.max_pending:
                oldest = min(self._pending, key=lambda k: self._pending[k].step)
                del self._pending[oldest]
                self.metrics.failures.labels("dropped").inc()
        self._wake.set()

    def pending(self) -> list[Pending]:
        with self._lock:
            return sorted(self._pending.values(), key=lambda p: -p.step)

    def _next(self) -> Pending | None:
        with self._lock:
            if not self._pending:
                return None
            key = max(self._pending, key=lambda k: self._pending[k].step)  # newest first
            return self._pending.pop(key)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            while not stop.is_set() and self.replicate_once():
                pass
        self._close_channel()

    def replicate_once(self) -> bool:
        """Pushes the newest pending snapshot to the buddy; ``False`` when nothing was pending."""
        item = self._next()
        if item is None:
            return False
        try:
            self._replicate(item)
        except Exception:  # one bad replica must not end replication
            self.metrics.failures.labels("error").inc()
            log.exception("replication of %s step %d rank %d failed", item.job, item.step, item.rank)
        return True

    # ---- the buddy ---------------------------------------------------------------------------------

    def buddy(self) -> Buddy:
        """This node's buddy and its agent address, as the coordinator last named them (it pushes a
        new choice when the buddy dies or the cluster changes: nothing to look up here)."""
        chosen = self.told_buddy()
        if chosen.node_id != self.last_buddy.node_id:
            log.info("memory replicas of %s go to %s", self.node_id, chosen.reason)
        self.last_buddy = chosen
        return chosen

    def _stub(self, address: str) -> agent_pb2_grpc.AgentStub:
        if self._channel is None or self._channel[0] != address:
            self._close_channel()
            self._channel = (address, self.open_channel(address))
        return agent_pb2_grpc.AgentStub(self._channel[1])

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel[1].close()
            self._channel = None

    # ---- one replica -------------------------------------------------------------------------------

    def _replicate(self, item: Pending) -> None:
        backend = self.mem.backend
        prefix = shard_prefix(item.job, item.step, item.rank)
        if not backend.is_published(prefix, MANIFEST):
            self.metrics.failures.labels("dropped").inc()
            log.debug("%s is gone from memory (a newer snapshot replaced it): not replicated", prefix)
            return
        total = sum(info.size for info in backend.list(prefix + "/"))
        buddy = self.buddy()
        address = buddy.address
        if buddy.node_id is None or not address:
            self.metrics.failures.labels("no_buddy").inc()
            log.warning("memory snapshot %s not replicated: %s", prefix, buddy.reason)
            return
        header = agent_pb2.WriteShardHeader(job=item.job, step=item.step, rank=item.rank, tier=self.mem.name,
                                            bytes=total, source=self.node_id)
        started = self.clock()
        try:
            answer = self._stub(address).WriteShard(self._messages(header), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            err = peer_error(exc)
            reason = FAILURE_REASONS.get(type(err), "error") if err is not None else "error"
            self.metrics.failures.labels(reason).inc()
            log.warning("memory snapshot %s not replicated to %s (%s): %s", prefix, buddy.node_id, reason,
                        describe(exc))
            if reason == "unreachable":
                self._close_channel()
            return
        self.metrics.replicated_bytes.inc(total)
        self.metrics.replicated.inc()
        self.metrics.lag.set(max(0.0, self.clock() - item.queued_at))
        log.debug("replicated %s to %s: %d bytes in %.3fs (%s)", prefix, buddy.node_id, total,
                  self.clock() - started, answer.message)

    def _messages(self, header: agent_pb2.WriteShardHeader) -> Iterator[agent_pb2.WriteShardChunk]:
        yield agent_pb2.WriteShardChunk(header=header)
        try:
            for chunk in serve_shard(self.mem.backend, header.job, header.step, header.rank, self.chunk_bytes):
                wait = self.bucket.delay(len(chunk.data), self.clock())
                if wait > 0:
                    time.sleep(wait)
                yield agent_pb2.WriteShardChunk(chunk=chunk)
        except (CopyMissing, StorageError) as exc:  # replaced by a newer snapshot meanwhile: the call is cancelled
            log.debug("memory snapshot %s/%s/%s vanished while being sent: %s", header.job, header.step,
                      header.rank, exc)
            raise


# ---- the buddy's side: WriteShard --------------------------------------------------------------------


class _ReplicaSource(ChunkSource):
    """``WriteShard``'s body after the header: a chunk stream (:class:`~.peer_copy.ChunkSource`)
    whose manifest, last, must be of the header's shard and list exactly the files that arrived."""

    def __init__(self, messages: Iterator[agent_pb2.WriteShardChunk], prefix: str, ident: tuple[str, int, int],
                 declared: int) -> None:
        super().__init__(_chunks(messages), f"the replica of {prefix}", BadRequest, self._count)
        self.prefix, self.ident, self.declared, self.received = prefix, ident, declared, 0

    def _count(self, n: int) -> None:
        self.received += n
        if self.received > self.declared:
            raise BadRequest(f"the replica sends more than the {self.declared} bytes its header declared")

    def manifest(self, received: Expected) -> bytes:
        raw = super().manifest(received)
        try:
            manifest = ShardManifest.decode(self.where, raw)
        except ManifestError as exc:
            raise CopyCorrupt(str(exc)) from exc
        if (manifest.job, manifest.step, manifest.rank) != self.ident:
            raise BadRequest(f"the manifest is of {manifest.job} step {manifest.step} rank {manifest.rank}")
        listed = files_of(manifest)
        if listed != received:
            raise CopyCorrupt(f"the files received {dict(received)} are not the manifest's {listed}")
        return raw


def _chunks(messages: Iterator[agent_pb2.WriteShardChunk]) -> Iterator[agent_pb2.ShardChunk]:
    for msg in messages:
        if not msg.HasField("chunk"):
            raise BadRequest("a second header in one WriteShard stream")
        yield msg.chunk


def receive_replica(messages: Iterator[agent_pb2.WriteShardChunk], mem: Tier, node_id: str,
                    record: Callable[[checkpoint_pb2.RecordCopyRequest], Any],
                    metrics: ReplicationMetrics | None = None) -> agent_pb2.WriteShardResponse:
    """Writes a buddy's memory snapshot into this node's memory tier (through
    :func:`~ftd.checkpoints.copy.copy_shard`) and records the copy; raises an
    :class:`~.errors.AgentError` (its table gives the status to answer) when it cannot be taken."""
    started = time.monotonic()
    store = _store(mem)
    first = next(messages, None)
    if first is None or not first.HasField("header"):
        raise BadRequest("the first WriteShard message must be the header")
    h = first.header
    try:
        job, step, rank = check_job(h.job), check_step(h.step), check_rank(h.rank)
    except BadIdentifier as exc:
        raise BadRequest(f"header.{exc}") from exc
    if h.tier != mem.name:
        raise BadRequest(f"header.tier: replicas go to the memory tier {mem.name!r}, not {h.tier[:40]!r}")
    prefix = shard_prefix(job, step, rank)
    held = store.snapshots(job, rank)
    if superseded(held, step):
        return agent_pb2.WriteShardResponse(message=f"superseded: this node holds newer snapshots {held} of rank "
                                                    f"{rank}")
    what = f"the replica of {job} step {step} rank {rank} from {h.source[:100] or '?'}"
    try:
        deleted = store.admit(job, rank, step, int(h.bytes), what)
    except MemoryFull as exc:
        if metrics is not None:
            metrics.refused.labels("replica").inc()
        log.error("refused %s: %s", what, exc)
        raise NoRoom(str(exc)) from exc
    source = _ReplicaSource(messages, prefix, (job, step, rank), int(h.bytes))
    try:
        copy_shard(source, store, prefix)  # a concurrent push of the same step may win: checked the same way
    except BaseException as exc:
        for old in deleted:  # the catalog must not keep offering what this node no longer holds
            _record(record, job, old, rank, mem, node_id, present=False)
        if isinstance(exc, CopyMismatch):
            raise CopyCorrupt(str(exc)) from exc
        if isinstance(exc, InvalidKey):
            raise BadRequest(str(exc)) from exc
        raise
    _record(record, job, step, rank, mem, node_id)
    if metrics is not None:
        metrics.received.inc()
        metrics.held_bytes.set(store.used_bytes())
    return agent_pb2.WriteShardResponse(bytes=source.received, seconds=time.monotonic() - started,
                                        message=f"recorded {mem.name}@{node_id}")


def _store(mem: Tier) -> MemoryTier:
    store = mem.memory
    if store is None:
        raise NodeCannot(f"the tier {mem.name} ({mem.backend.name}) is no memory tier")
    return store


def _record(record: Callable[[checkpoint_pb2.RecordCopyRequest], Any], job: str, step: int, rank: int, mem: Tier,
            node_id: str, present: bool = True) -> None:
    try:
        record(checkpoint_pb2.RecordCopyRequest(job=job, step=step, rank=rank, tier=mem.name, location=node_id,
                                                present=present))
    except (grpc.RpcError, ConnectionError) as exc:
        if present:
            raise CoordinatorUnreachable(
                f"the replica is held but could not be recorded in the catalog: {exc}") from exc
        log.warning("could not record the deletion of %s step %d rank %d from memory: %s", job, step, rank, exc)


__all__ = ["FAILURE_REASONS", "Pending", "ReplicationMetrics", "Replicator", "receive_replica"]
