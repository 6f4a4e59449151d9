"""Replication of memory snapshots to the buddy node: the memory tier survives the loss of a node.

When a training process of this node commits a memory snapshot (``CommitShard`` with tier ``mem``),
the agent queues it here; a background thread pushes it to the buddy (:func:`.buddy.choose_buddy`:
the next alive node in another failure domain, the ``rack`` label) with the client-streaming
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
first (``RESOURCE_EXHAUSTED`` naming the sizes: never an OOM), writes the files into its memory tier
through the same staging protocol (every file's CRC32C checked as it lands, the manifest — checked
against what arrived — published last) and records its copy in the catalog itself
(``RecordCopy(tier="mem", location=<its own id>)``: a node records only copies at its own location).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

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
from ftd.rpc import describe, rpc_code
from ftd.storage_backends.base import AlreadyPublished, InvalidKey, StorageBackend, StorageError
from ftd.storage_backends.tiers import LocalSpec, Tier
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2, coordinator_pb2

from . import memory_tier
from .buddy import Buddy, Peer, choose_buddy
from .peer_copy import CHUNK_BYTES, CopyMissing, serve_shard
from .tiering import TokenBucket

log = logging.getLogger("ftd.agent.replicator")
MAX_MANIFEST_BYTES = 1 << 20
DOMAIN_LABEL = "rack"


class ReplicaRefused(Exception):
    """The buddy refuses a replica; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


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


def peers_from_nodes(nodes: Iterable[coordinator_pb2.NodeInfo], label: str = DOMAIN_LABEL) -> list[Peer]:
    """The coordinator's node list as :class:`~.buddy.Peer`s (alive = state ALIVE, with an agent)."""
    return [Peer(n.node_id, n.labels.get(label, ""), n.state == cluster_pb2.NODE_STATE_ALIVE and bool(n.agent_address),
                 n.agent_address) for n in nodes]


class Replicator:
    def __init__(self, mem: Tier, node_id: str, list_nodes: Callable[[], Iterable[coordinator_pb2.NodeInfo]],
                 open_channel: Callable[[str], grpc.Channel], catalog: Callable[[str, Any], Any] | None = None,
                 metrics: ReplicationMetrics | None = None,
                 max_pending: int = 4, chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 120.0,
                 bandwidth_bytes_s: float = 0.0, peers_ttl_s: float = 5.0, domain_label: str = DOMAIN_LABEL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.mem = mem
        self.root = _root(mem)
        self.capacity_bytes = mem.spec.storage.capacity_bytes if isinstance(mem.spec.storage, LocalSpec) else 0
        self.node_id = node_id
        self.list_nodes = list_nodes
        self.open_channel = open_channel
        self.catalog = catalog  # (method, request) -> response, on the coordinator
        self.metrics = metrics or ReplicationMetrics()
        self.max_pending = max_pending
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.bucket = TokenBucket(bandwidth_bytes_s, burst=max(bandwidth_bytes_s, float(chunk_bytes)))
        self.peers_ttl_s = peers_ttl_s
        self.domain_label = domain_label
        self.clock = clock
        self.last_buddy = Buddy(None, "not chosen yet")
        self._pending: OrderedDict[tuple[str, int], Pending] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._peers: list[Peer] = []
        self._peers_at = -1e18
        self._channel: tuple[str, grpc.Channel] | None = None
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # snapshots are the job's state: owner only
        os.chmod(self.root, 0o700)

    def receive(self, messages: Iterator[agent_pb2.WriteShardChunk]) -> agent_pb2.WriteShardResponse:
        """The buddy's side of ``WriteShard`` (:func:`receive_replica`) on this node's memory tier."""
        catalog = self.catalog
        if catalog is None:
            raise ReplicaRefused(grpc.StatusCode.FAILED_PRECONDITION, f"node {self.node_id} cannot record replicas")
        return receive_replica(messages, self.mem, self.node_id, self.capacity_bytes,
                               lambda req: catalog("RecordCopy", req), self.metrics)

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

    def buddy(self, refresh: bool = False) -> tuple[Buddy, str]:
        """This node's buddy and its agent address (the node list is cached ``peers_ttl_s``)."""
        now = self.clock()
        if refresh or now - self._peers_at >= self.peers_ttl_s:
            try:
                self._peers = peers_from_nodes(self.list_nodes(), self.domain_label)
                self._peers_at = now
            except (grpc.RpcError, ConnectionError) as exc:
                log.warning("node list unavailable, keeping the previous buddy: %s", exc)
        me = next((p for p in self._peers if p.node_id == self.node_id), None)
        chosen = choose_buddy(self.node_id, me.domain if me is not None else "", self._peers, self.domain_label)
        if chosen.node_id != self.last_buddy.node_id:
            log.info("memory replicas of %s go to %s", self.node_id, chosen.reason)
        self.last_buddy = chosen
        address = next((p.address for p in self._peers if p.node_id == chosen.node_id), "")
        return chosen, address

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
        buddy, address = self.buddy()
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
            code = rpc_code(exc)
            reason = {grpc.StatusCode.RESOURCE_EXHAUSTED: "refused", grpc.StatusCode.UNAVAILABLE: "unreachable",
                      grpc.StatusCode.DEADLINE_EXCEEDED: "unreachable", grpc.StatusCode.CANCELLED: "dropped"}.get(
                          code, "error") if code is not None else "error"
            self.metrics.failures.labels(reason).inc()
            log.warning("memory snapshot %s not replicated to %s (%s): %s", prefix, buddy.node_id, reason,
                        describe(exc))
            if reason == "unreachable":
                self.buddy(refresh=True)
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


class _FileStream:
    """One file of a chunk stream, as a readable stream for :meth:`Staging.put_stream`."""

    def __init__(self, first: agent_pb2.ShardChunk, rest: Iterator[agent_pb2.WriteShardChunk],
                 budget: Callable[[int], None]) -> None:
        self.name = first.name
        self._next: agent_pb2.ShardChunk | None = first
        self._rest = rest
        self._budget = budget
        self.sent_crc = ""
        self.done = False

    def read(self, n: int = -1) -> bytes:
        while not self.done:
            chunk = self._next
            self._next = None
            if chunk is None:
                msg = next(self._rest, None)
                if msg is None or not msg.HasField("chunk"):
                    raise ReplicaRefused(grpc.StatusCode.DATA_LOSS, f"{self.name}: the stream ended inside the file")
                chunk = msg.chunk
            if chunk.name != self.name:
                raise ReplicaRefused(grpc.StatusCode.DATA_LOSS,
                                     f"{self.name}: the stream moved to {chunk.name[:100]!r} before the file ended")
            self._budget(len(chunk.data))
            if chunk.end_of_file:
                self.done, self.sent_crc = True, chunk.crc32c
            if chunk.data:
                return bytes(chunk.data)
        return b""


def receive_replica(messages: Iterator[agent_pb2.WriteShardChunk], mem: Tier, node_id: str, capacity_bytes: int,
                    record: Callable[[checkpoint_pb2.RecordCopyRequest], Any],
                    metrics: ReplicationMetrics | None = None) -> agent_pb2.WriteShardResponse:
    """Writes a buddy's memory snapshot into this node's memory tier and records the copy; raises
    :class:`ReplicaRefused` (the gRPC status to answer) when it cannot be taken."""
    started = time.monotonic()
    first = next(messages, None)
    if first is None or not first.HasField("header"):
        raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, "the first WriteShard message must be the header")
    h = first.header
    try:
        job, step, rank = check_job(h.job), check_step(h.step), check_rank(h.rank)
    except BadIdentifier as exc:
        raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"header.{exc}") from exc
    if h.tier != mem.name:
        raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT,
                             f"header.tier: replicas go to the memory tier {mem.name!r}, not {h.tier[:40]!r}")
    backend = mem.backend
    root = _root(mem)
    prefix = shard_prefix(job, step, rank)
    held = memory_tier.snapshots(root, job, rank)
    if step not in held and len(held) >= memory_tier.KEEP and step < held[-memory_tier.KEEP]:
        return agent_pb2.WriteShardResponse(message=f"superseded: this node holds newer snapshots {held} of rank "
                                                    f"{rank}")
    what = f"the replica of {job} step {step} rank {rank} from {h.source[:100] or '?'}"
    try:
        deleted = memory_tier.admit(backend, root, capacity_bytes, job, rank, step, int(h.bytes), what)
    except memory_tier.MemoryFull as exc:
        if metrics is not None:
            metrics.refused.labels("replica").inc()
        log.error("refused %s: %s", what, exc)
        raise ReplicaRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
    try:
        received = _write(backend, prefix, messages, int(h.bytes), (job, step, rank))
    except BaseException:
        for old in deleted:  # the catalog must not keep offering what this node no longer holds
            _record(record, job, old, rank, mem, node_id, present=False)
        raise
    _record(record, job, step, rank, mem, node_id)
    if metrics is not None:
        metrics.received.inc()
        metrics.held_bytes.set(memory_tier.used_bytes(root))
    return agent_pb2.WriteShardResponse(bytes=received, seconds=time.monotonic() - started,
                                        message=f"recorded {mem.name}@{node_id}")


def _root(mem: Tier) -> Path:
    root = getattr(mem.backend, "root", None)
    if not isinstance(root, Path):
        raise ReplicaRefused(grpc.StatusCode.FAILED_PRECONDITION, f"the memory tier {mem.backend.name} is no directory")
    return root


def _write(backend: StorageBackend, prefix: str, messages: Iterator[agent_pb2.WriteShardChunk], declared: int,
           ident: tuple[str, int, int]) -> int:
    received = [0]

    def budget(n: int) -> None:
        received[0] += n
        if received[0] > declared:
            raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"the replica sends more than the {declared} bytes its header declared")

    staging = backend.stage(prefix)
    try:
        files: dict[str, tuple[int, str]] = {}
        manifest_raw = b""
        for msg in messages:
            if not msg.HasField("chunk"):
                raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one WriteShard stream")
            stream = _FileStream(msg.chunk, messages, budget)
            if stream.name == MANIFEST:
                while block := stream.read():
                    manifest_raw += block
                    if len(manifest_raw) > MAX_MANIFEST_BYTES:
                        raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, "the manifest is too large")
                break  # the manifest comes last
            if stream.name in files:
                raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{stream.name}: sent twice")
            try:
                info = staging.put_stream(stream.name, stream)  # type: ignore[arg-type]
            except InvalidKey as exc:
                raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
            if info.crc32c != stream.sent_crc:
                raise ReplicaRefused(grpc.StatusCode.DATA_LOSS, f"{stream.name}: received crc32c {info.crc32c}, the "
                                                                f"sender read {stream.sent_crc}")
            files[stream.name] = (info.size, info.crc32c or "")
        try:
            manifest = ShardManifest.decode(f"the replica of {prefix}", manifest_raw)
        except ManifestError as exc:
            raise ReplicaRefused(grpc.StatusCode.DATA_LOSS, str(exc)) from exc
        if (manifest.job, manifest.step, manifest.rank) != ident:
            raise ReplicaRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"the manifest is of {manifest.job} step {manifest.step} rank {manifest.rank}")
        listed = {f.name: (f.size, f.crc32c) for f in manifest.files}
        if listed != files:
            raise ReplicaRefused(grpc.StatusCode.DATA_LOSS, f"the files received {files} are not the manifest's "
                                                            f"{listed}")
        staging.publish(MANIFEST, manifest_raw)
        return received[0]
    except AlreadyPublished:
        return received[0]  # a concurrent push of the same step won; it was checked the same way
    except BaseException:
        staging.abort()
        raise


def _record(record: Callable[[checkpoint_pb2.RecordCopyRequest], Any], job: str, step: int, rank: int, mem: Tier,
            node_id: str, present: bool = True) -> None:
    try:
        record(checkpoint_pb2.RecordCopyRequest(job=job, step=step, rank=rank, tier=mem.name, location=node_id,
                                                present=present))
    except (grpc.RpcError, ConnectionError) as exc:
        if present:
            raise ReplicaRefused(grpc.StatusCode.UNAVAILABLE,
                                 f"the replica is held but could not be recorded in the catalog: {exc}") from exc
        log.warning("could not record the deletion of %s step %d rank %d from memory: %s", job, step, rank, exc)


__all__ = ["Pending", "ReplicaRefused", "ReplicationMetrics", "Replicator", "peers_from_nodes", "receive_replica"]
