"""Replication of memory snapshots to the buddy node: the memory tier survives the loss of a node.

When a training process of this node commits a memory snapshot (``CommitShard`` with tier ``mem``),
the agent queues it here; a background thread hands it to the buddy (the next alive node in
another failure domain, chosen by the coordinator and named in this node's assignment:
``coordinator/buddies.py``, :func:`.peers.buddy_of`) by one of two paths:

* **the bulk path** (``PullReplica``, when this node serves the fast peer copy path): the holder
  announces the snapshot with a one-time offer on its bulk port (:class:`~.bulk_copy.BulkServer`,
  AES-GCM records, the key given only in the mTLS call) and the buddy pulls the files over that
  connection (:func:`receive_pulled`) — a plain socket moves several times what a Python gRPC
  stream does (the 1 MiB ``WriteShard`` stream moved 0.30-0.32 GB/s here);
* **the stream** (``WriteShard``, client streaming: a header — job, step, rank, bytes — then the
  shard's files as ``ShardChunk``s, each file closed by its CRC32C, the manifest last): the
  fallback when the buddy has no bulk path (an older agent, ``peer_copy_port`` off), when the pull
  failed there (UNIMPLEMENTED either way), or when the holder's manifest gives no checksums.

Off the training's critical path and bounded:

* the queue holds at most ``max_pending`` shards, one per (job, rank): a newer snapshot of a rank
  replaces its pending older one, and the newest goes first (an old snapshot is worth little once a
  newer one exists);
* one shard is in flight at a time, read lazily ``chunk_bytes`` at a time from the memory tier, so
  the bytes in flight are bounded by the chunk and gRPC's flow-control window, whatever the shard's
  size; ``bandwidth_bytes_s`` caps the rate (0: none).

Either way the buddy (:func:`receive_pulled`, :func:`receive_replica`) checks the header against
its own budget and the per-rank limit first (:class:`~ftd.storage_backends.memory.MemoryTier`:
``RESOURCE_EXHAUSTED`` naming the sizes: never an OOM), writes the files into its memory tier with
:func:`~ftd.checkpoints.copy.copy_shard` (every file's CRC32C checked as it lands — on the bulk
path against the holder's manifest, on the stream against what the sender read —, the manifest,
checked against what arrived, published last) and records its copy itself, in its memory inventory
(agent.memory_report: announced to the leader on its heartbeat stream, no catalog RPC; a node announces
only copies at its own location).
Who may pull what: only the node an offer was sent to holds its key and transfer id (single use,
for a minute), and a node may announce only its own snapshots (``PullReplica``'s ``source`` is
checked against the caller's certificate); the buddy dials the holder at the address its own
assignment names for it (else the address the call came from).
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

from ftd.checkpoints.copy import published_manifest
from ftd.checkpoints.layout import MANIFEST, shard_prefix
from ftd.rpc import describe, parse_hostport, rpc_code
from ftd.storage_backends.base import StorageError
from ftd.storage_backends.tiers import Tier
from ftd.throttle import TokenBucket
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2

from . import bulk_copy
from .errors import AgentError, CallCancelled, CopyMissing, NoFastCopy, NoRoom, PeerUnreachable, peer_error
from .memory_report import MemoryInventory
from .peer_copy import CHUNK_BYTES, serve_shard
from .peers import Buddy
from .replica_intake import (
    ReplicationMetrics,
    SourceCheck,
    caller_host,
    memory_store,
    receive_pulled,
    receive_replica,
)

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


class Replicator:
    """Both sides of replication on one node: the queue and the pushes to this node's buddy, and the
    replicas other nodes hand to this one (``bulk``: this node's bulk server — it offers this node's
    snapshots and, being there, lets buddies' offers be pulled; ``None``: the stream only)."""

    def __init__(self, mem: Tier, node_id: str, told_buddy: Callable[[], Buddy],
                 open_channel: Callable[[str], grpc.Channel], catalog: Callable[[str, Any], Any] | None = None,
                 metrics: ReplicationMetrics | None = None,
                 max_pending: int = 4, chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 120.0,
                 bandwidth_bytes_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 bulk: bulk_copy.BulkServer | None = None, node_agent: Callable[[str], str] | None = None) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.mem = mem
        self.store = memory_store(mem)
        self.node_id = node_id
        self.told_buddy = told_buddy  # the buddy in this node's latest assignment, with its address
        self.open_channel = open_channel
        self.catalog = catalog  # (method, request) -> response, on the coordinator (unused by replicas now)
        self.inventory = MemoryInventory(self.store, node_id)  # what this node's heartbeat announces
        self.bulk = bulk
        self.node_agent = node_agent  # node id -> its agent's address, from this node's assignment ("" unknown)
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

    def receive(self, messages: Iterator[agent_pb2.WriteShardChunk],
                check: SourceCheck | None = None) -> agent_pb2.WriteShardResponse:
        """The buddy's side of ``WriteShard`` (:func:`receive_replica`) on this node's memory tier;
        ``check``: the sender's rule (agent.peer_rules, through the service)."""
        return receive_replica(messages, self.mem, self.node_id, self.recorded, self.metrics, check)

    def receive_pull(self, request: agent_pb2.PullReplicaRequest, caller: str,
                     check: SourceCheck | None = None) -> agent_pb2.WriteShardResponse:
        """The buddy's side of ``PullReplica`` (:func:`receive_pulled`): the holder is dialled at the
        address this node's assignment names for ``request.source``, else at the host the call came
        from (``caller``: gRPC's peer string, ``ipv4:10.0.0.2:53122``)."""
        if self.bulk is None:
            raise NoFastCopy(f"node {self.node_id} does not use the bulk copy path: push with WriteShard")
        address = self.node_agent(request.source) if self.node_agent is not None else ""
        host = parse_hostport(address)[0] if address else caller_host(caller)
        if not host:
            raise NoFastCopy(f"node {self.node_id} does not know where {request.source[:100]!r} is: use WriteShard")
        return receive_pulled(request, host, self.mem, self.node_id, self.recorded,
                              self.metrics, self.timeout_s, check)

    def recorded(self, request: checkpoint_pb2.RecordCopyRequest, owner: str) -> None:
        """A replica landed here (or an older one went for it): into the inventory."""
        if request.present:
            self.inventory.replica(request.job, request.step, request.rank, owner)
        else:
            self.inventory.gone(request.job, request.step, request.rank)

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
        manifest = published_manifest(backend, prefix)  # its world size tells the buddy whose rank it is
        header = agent_pb2.WriteShardHeader(job=item.job, step=item.step, rank=item.rank, tier=self.mem.name,
                                            bytes=total, source=self.node_id,
                                            world_size=manifest.world_size if manifest is not None else 0)
        started = self.clock()
        path = "bulk"
        try:
            answer = self._offer(header, address, buddy.node_id) if self.bulk is not None else None
            if answer is None:
                path = "stream"
                answer = self._stub(address).WriteShard(self._messages(header), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            err = peer_error(exc)
            reason = FAILURE_REASONS.get(type(err), "error") if err is not None else "error"
            self.metrics.failures.labels(reason).inc()
            log.warning("memory snapshot %s not replicated to %s (%s, %s): %s", prefix, buddy.node_id, reason, path,
                        describe(exc))
            if reason == "unreachable":
                self._close_channel()
            return
        except bulk_copy.CopyNotHere:
            self.metrics.failures.labels("dropped").inc()
            log.debug("%s is gone from memory (a newer snapshot replaced it): not replicated", prefix)
            return
        self.metrics.replicated_bytes.inc(total)
        self.metrics.replicated.inc()
        self.metrics.by_path.labels(path).inc()
        self.metrics.lag.set(max(0.0, self.clock() - item.queued_at))
        log.debug("replicated %s to %s (%s): %d bytes in %.3fs (%s)", prefix, buddy.node_id, path, total,
                  self.clock() - started, answer.message)

    def _offer(self, header: agent_pb2.WriteShardHeader, address: str,
               buddy: str) -> agent_pb2.WriteShardResponse | None:
        """The bulk path: the snapshot offered on this node's bulk port, the buddy asked to pull it
        (``PullReplica``). ``None``: use the stream (the buddy cannot pull, or the pull failed
        there); any other failure of the call raises its ``grpc.RpcError``."""
        assert self.bulk is not None
        try:
            files = bulk_copy.shard_files(self.mem.backend, header.job, header.step, header.rank)
        except bulk_copy.CopyNotHere:
            raise  # gone: nothing to replicate
        except bulk_copy.BulkError as exc:
            log.debug("no bulk offer of %s step %d rank %d: %s", header.job, header.step, header.rank, exc)
            return None
        if any(not f.crc32c for f in files if f.name != MANIFEST):
            self.metrics.fallbacks.inc()
            return None  # the manifest gives no checksums: the stream checks what the sender read
        header.bytes = sum(f.size for f in files)
        try:
            port, offer = self.bulk.offer(files, self._pace if self.bucket.rate > 0 else None)
        except (bulk_copy.BulkError, OSError) as exc:  # closed, or its port cannot be bound
            self.metrics.fallbacks.inc()
            log.warning("no bulk offer of %s step %d rank %d (%s); pushing it with WriteShard", header.job,
                        header.step, header.rank, exc)
            return None
        request = agent_pb2.PullReplicaRequest(source=self.node_id, header=header, offer=agent_pb2.OpenShardResponse(
            port=port, transfer=offer.transfer, key=offer.key, chunk_bytes=self.bulk.chunk_bytes,
            files=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in files]))
        try:
            return self._stub(address).PullReplica(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if rpc_code(exc) != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.metrics.fallbacks.inc()
            log.info("%s step %d rank %d: %s did not pull it (%s); pushing it with WriteShard", header.job,
                     header.step, header.rank, buddy, describe(exc))
            return None
        finally:
            self.bulk.withdraw(offer.transfer)

    def _pace(self, n: int) -> None:
        wait = self.bucket.delay(n, self.clock())
        if wait > 0:
            time.sleep(wait)

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


__all__ = ["FAILURE_REASONS", "Pending", "ReplicationMetrics", "Replicator"]
