"""The agent's gRPC service: the training process's local endpoint and the operator's drill handle.

Handlers raise :mod:`.errors`; :func:`answers` translates them once into the status their table
gives (a forwarded coordinator answer keeps its own).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc

from ftd.authz_interceptors import peer_identity
from ftd.checkpoints import signing
from ftd.checkpoints.copy import published_manifest
from ftd.checkpoints.layout import MANIFEST, BadIdentifier, check_job, check_rank, check_step, shard_prefix
from ftd.identity import LOCAL, Identity, identity_of
from ftd.rpc import rpc_code, rpc_details
from ftd.storage_backends.base import StorageError
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

from . import bulk_copy, errors, peer_copy, peer_rules
from .peer_limits import Ticket
from .replica_intake import SourceCheck
from .torchrun_supervisor import signal_pids

if TYPE_CHECKING:
    from .daemon import AgentDaemon

log = logging.getLogger("ftd.agent")
# The save-failure kinds that become metric labels; anything else a client sends counts as "other".
FAILURE_KINDS = frozenset({"disk_full", "memory_full", "io", "error", "checksum", "timeout", "agent"})
# Without a leader for longer than this, a durable commit fails at once: a failover takes a few seconds,
# an etcd outage longer, and waiting out the deadline of a commit that can only fail stalls the training.
DURABLE_COMMIT_GRACE_S = 5.0
F = TypeVar("F", bound=Callable[..., Any])


def answers(handler: F) -> F:
    """Wraps a handler (unary, or a response stream) so that an :class:`~.errors.AgentError` it
    raises ends the call with :func:`~.errors.grpc_code`'s status and the error's message."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from handler(self, request, context)
            except errors.AgentError as exc:
                context.abort(errors.grpc_code(exc), str(exc))
        return cast(F, stream)

    @functools.wraps(handler)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except errors.AgentError as exc:
            context.abort(errors.grpc_code(exc), str(exc))
            raise AssertionError("unreachable") from exc  # context.abort raises
    return cast(F, unary)


def bearer_token(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, daemon: AgentDaemon) -> None:
        self.daemon = daemon

    # ---- the data plane: who may read and write a shard, and how much per peer ------------------

    def _peer(self, context: grpc.ServicerContext, what: str) -> tuple[Identity | None, Ticket | None]:
        """The caller and its stream ticket (agent.peer_limits: RESOURCE_EXHAUSTED over its limits);
        no ticket for the training's own calls on the Unix socket."""
        identity = peer_identity(context)
        if identity is not None and identity.kind == LOCAL:
            return identity, None
        # Without mTLS there is no identity (nor any authorization): each connection counts alone.
        key = str(identity) if identity is not None else f"peer {context.peer() or '?'}"
        return identity, self.daemon.peer_limiter.admit(key, what, context.cancel)

    def _judge(self, method: str, decide: Callable[[peer_rules.View], peer_rules.Verdict]) -> None:
        """Raises :class:`~.errors.PeerDenied` unless the data-plane rule allows the call in this
        node's view of the job (agent.peer_rules); a refusal waits up to ``peer_view_grace_s`` for a
        newer assignment first (a buddy or a rank changed just now). Without mTLS there is no
        identity to bind: the rules are off (the daemon warns that the port is plaintext)."""
        daemon = self.daemon
        if daemon.identity is None:
            return
        deadline = time.monotonic() + daemon.settings.peer_view_grace_s

        def assignment() -> object:  # a new object on every answer from the coordinator
            session = getattr(daemon, "session", None)
            return session.assignment if session is not None else None

        while True:
            seen = assignment()
            verdict = decide(daemon.peer_view())
            if verdict.allowed:
                return
            while assignment() is seen and time.monotonic() < deadline:
                time.sleep(0.05)
            if assignment() is seen:
                break
        daemon.metrics.rpc_denied.labels(method, verdict.rule).inc()
        daemon.denials.log(logging.WARNING, f"{method}|{verdict.rule}", "denied %s: %s", method, verdict.reason)
        raise errors.PeerDenied(verdict.reason)

    def _may_read(self, identity: Identity | None, method: str, tier_backend: Any, job: str, step: int,
                  rank: int, ticket: Ticket | None) -> None:
        """The read rule for this node's copy (its manifest says which world saved it), then its
        bytes counted against the caller's bytes in flight."""
        if ticket is None:
            return
        prefix = shard_prefix(job, step, rank)
        if not tier_backend.is_published(prefix, MANIFEST):
            raise errors.CopyMissing(f"{tier_backend.name}: no published copy of {prefix}")
        manifest = published_manifest(tier_backend, prefix)
        world_size = manifest.world_size if manifest is not None else 0
        self._judge(method, lambda view: peer_rules.may_read(view, identity, job, step, rank, world_size))
        ticket.reserve(manifest.total_bytes if manifest is not None else 0)

    def GetInfo(self, request: agent_pb2.GetInfoRequest, context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        return self.daemon.info()

    @answers
    def ReportProgress(self, request: agent_pb2.ReportProgressRequest,
                       context: grpc.ServicerContext) -> agent_pb2.ReportProgressResponse:
        if request.HasField("checkpoint"):
            self.daemon.checkpoint_event(request.rank, request.checkpoint)
        if request.checkpoint_error:
            kind = request.checkpoint_error_kind or "error"
            self.daemon.metrics.save_failures.labels(kind if kind in FAILURE_KINDS else "other").inc()
            log.error("checkpoint save failed on rank %d (%s): %s", request.rank, kind, request.checkpoint_error[:500])
        if request.HasField("restored"):
            self.daemon.report_restored(request.restored)
        if not request.HasField("progress") and (request.checkpoint_error or request.HasField("checkpoint")
                                                 or request.HasField("restored")):
            return self._progress_answer()
        if not request.HasField("progress"):
            raise errors.BadRequest("progress: is required")
        if request.progress.step < 0:
            raise errors.BadRequest(f"progress.step: must be >= 0, got {request.progress.step}")
        self.daemon.report_progress(request.progress, request.rank,
                                    request.job_round if request.HasField("job_round") else None)
        return self._progress_answer()

    def _progress_answer(self) -> agent_pb2.ReportProgressResponse:
        pending = self.daemon.handover.pending
        return agent_pb2.ReportProgressResponse(assignment=self.daemon.session.assignment,
                                                handover=bool(pending.nodes), handover_reason=pending.reason)

    @answers
    def ReadShard(self, request: agent_pb2.ReadShardRequest,
                  context: grpc.ServicerContext) -> Iterator[agent_pb2.ShardChunk]:
        tier = next((t for t in self.daemon.tiering.tiers if t.name == request.tier), None)
        if tier is None:
            raise errors.CopyMissing(f"tier {request.tier[:40]!r}: not a tier of this node")
        try:
            job, step, rank = check_job(request.job), check_step(request.step), check_rank(request.rank)
        except BadIdentifier as exc:
            raise errors.BadRequest(str(exc)) from exc
        identity, ticket = self._peer(context, f"ReadShard of {job} step {step} rank {rank}")
        try:
            self._may_read(identity, "Agent/ReadShard", tier.backend, job, step, rank, ticket)
            for chunk in peer_copy.serve_shard(tier.backend, job, step, rank):
                yield chunk
                if ticket is not None:
                    ticket.touch()  # the chunk left: a reader that takes none is cancelled (peer_idle_timeout_s)
        except errors.CopyCorrupt as exc:  # corrupt at rest here: only this node may record its copy
            with contextlib.suppress(grpc.RpcError, ConnectionError):
                self.daemon.client.call("RecordCopy", checkpoint_pb2.RecordCopyRequest(
                    job=request.job, step=request.step, rank=request.rank, tier=tier.name, location=tier.location,
                    present=True, corrupt_reason=str(exc)[:400]), idempotent=True)
            raise
        except (StorageError, OSError) as exc:
            raise errors.TierUnavailable(f"tier {tier.name}: {exc}") from exc
        finally:
            if ticket is not None:
                ticket.release()

    @answers
    def OpenShard(self, request: agent_pb2.ReadShardRequest,
                  context: grpc.ServicerContext) -> agent_pb2.OpenShardResponse:
        """The fast path of ReadShard: one copy offered on the dedicated connection (agent.bulk_copy)."""
        tier = next((t for t in self.daemon.tiering.tiers if t.name == request.tier), None)
        if tier is None:
            raise errors.CopyMissing(f"tier {request.tier[:40]!r}: no fast copy from this node")
        bulk = self.daemon.bulk
        if bulk is None:
            raise errors.NoFastCopy(f"tier {request.tier[:40]!r}: no fast copy from this node")
        try:
            job, step, rank = check_job(request.job), check_step(request.step), check_rank(request.rank)
        except BadIdentifier as exc:
            raise errors.BadRequest(str(exc)) from exc
        bulk.purge()  # offers past their time release their peers' tickets first
        # The ticket is the offer's until its bulk send ends (or it expires): no idle deadline on the
        # call, the bulk connection has its own (peer_idle_timeout_s per record).
        identity, ticket = self._peer(context, f"OpenShard of {job} step {step} rank {rank}")
        if ticket is not None:
            ticket.cancel = None
        try:
            self._may_read(identity, "Agent/OpenShard", tier.backend, job, step, rank, ticket)
            try:
                files = bulk_copy.shard_files(tier.backend, job, step, rank)
            except bulk_copy.NotADirectoryTier as exc:
                raise errors.NoFastCopy(str(exc)) from exc
            except bulk_copy.CopyNotHere as exc:
                raise errors.CopyMissing(str(exc)) from exc
            # Not hashed here: the receiver checks every byte, and on a mismatch falls back to ReadShard,
            # which checks this node's copy and records it corrupt (only this node may).
            port, offer = bulk.offer(files, done=ticket.release if ticket is not None else None)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        return agent_pb2.OpenShardResponse(
            port=port, transfer=offer.transfer, key=offer.key, chunk_bytes=bulk.chunk_bytes,
            files=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in files])

    @answers
    def WriteShard(self, request_iterator: Iterator[agent_pb2.WriteShardChunk],
                   context: grpc.ServicerContext) -> agent_pb2.WriteShardResponse:
        """A buddy's memory snapshot into this node's memory tier (agent.replicator.receive_replica)."""
        if self.daemon.replicator is None:
            raise errors.NodeCannot(f"node {self.daemon.node_id} has no memory tier")
        identity, ticket = self._peer(context, "WriteShard")
        try:
            return self.daemon.replicator.receive(self._touched(request_iterator, ticket),
                                                  self._replica_rule("Agent/WriteShard", identity, ticket))
        except (StorageError, OSError) as exc:
            raise errors.TierUnavailable(f"memory tier of node {self.daemon.node_id}: {exc}") from exc
        finally:
            if ticket is not None:
                ticket.release()

    @staticmethod
    def _touched(messages: Iterator[agent_pb2.WriteShardChunk],
                 ticket: Ticket | None) -> Iterator[agent_pb2.WriteShardChunk]:
        """The stream, each message marking it alive (a sender that sends nothing is cancelled)."""
        for message in messages:
            if ticket is not None:
                ticket.touch()
            yield message

    def _replica_rule(self, method: str, identity: Identity | None, ticket: Ticket | None) -> SourceCheck:
        """What the intake calls with the header (before any room is made or a byte taken; its bytes
        then count against the sender's) and again with the manifest's world size once it arrived
        (``landed``, before it is published): :class:`~.errors.PeerDenied` unless the sender is the
        coordinator's source of that rank (agent.peer_rules.may_write)."""
        def check(header: agent_pb2.WriteShardHeader, world_size: int, landed: bool) -> None:
            if ticket is None:
                return  # the training's own call on the Unix socket
            self._judge(method, lambda view: peer_rules.may_write(
                view, identity, header.job, header.step, header.rank, world_size, header.source))
            if not landed:
                ticket.reserve(int(header.bytes))
        return check

    @answers
    def PullReplica(self, request: agent_pb2.PullReplicaRequest,
                    context: grpc.ServicerContext) -> agent_pb2.WriteShardResponse:
        """A buddy's memory snapshot pulled over its bulk port into this node's memory tier
        (agent.replica_intake.receive_pulled); UNIMPLEMENTED: the buddy pushes it with WriteShard."""
        if self.daemon.replicator is None:
            raise errors.NodeCannot(f"node {self.daemon.node_id} has no memory tier")
        identity, ticket = self._peer(context, "PullReplica")
        if ticket is not None:
            ticket.cancel = None  # the pull's own socket has the per-record deadline
        try:
            return self.daemon.replicator.receive_pull(request, context.peer() or "",
                                                       self._replica_rule("Agent/PullReplica", identity, ticket))
        except (StorageError, OSError) as exc:
            raise errors.TierUnavailable(f"memory tier of node {self.daemon.node_id}: {exc}") from exc
        finally:
            if ticket is not None:
                ticket.release()

    @answers
    def FetchShard(self, request: agent_pb2.FetchShardRequest,
                   context: grpc.ServicerContext) -> agent_pb2.FetchShardResponse:
        try:
            got = self.daemon.peers.fetch(request)
        except errors.PeerCopyError as exc:  # the same kind, naming the holder
            raise type(exc)(f"node {request.location}: {exc}") from exc
        except OSError as exc:
            raise errors.PeerCopyError(f"node {request.location}: {exc}") from exc
        return agent_pb2.FetchShardResponse(path=str(got.path), bytes=got.bytes, seconds=got.seconds,
                                            verified=got.verified)

    def CheckHealth(self, request: agent_pb2.CheckHealthRequest,
                    context: grpc.ServicerContext) -> cluster_pb2.HealthVerdict:
        return self.daemon.check_health()

    def ClearGpuFaults(self, request: agent_pb2.ClearGpuFaultsRequest,
                       context: grpc.ServicerContext) -> agent_pb2.ClearGpuFaultsResponse:
        cleared, verdict = self.daemon.clear_gpu_faults(request.reason[:300])
        return agent_pb2.ClearGpuFaultsResponse(cleared=cleared, verdict=verdict)

    @answers
    def Kill(self, request: agent_pb2.KillRequest, context: grpc.ServicerContext) -> agent_pb2.KillResponse:
        # With mTLS the authorization table has already let only operators through; the drill token,
        # when one is configured, is a second factor on top. Without mTLS it is the only one.
        daemon = self.daemon
        try:
            expected = daemon.drill_token()
        except OSError as exc:
            raise errors.NodeCannot(f"drills are unavailable on node {daemon.node_id}: {exc}") from exc
        if not expected and daemon.identity is None:
            raise errors.NodeCannot(f"drills are disabled on node {daemon.node_id}: without mTLS (pki_dir) Kill needs "
                                    "a drill token (drill_token_file)")
        if expected and not hmac.compare_digest(bearer_token(context).encode(), expected.encode()):
            daemon.metrics.rpc_denied.labels("Agent/Kill", "drill_token").inc()
            log.warning("denied Kill: no or a wrong drill token (the second factor of node %s)", daemon.node_id)
            raise errors.DrillDenied(f"Kill on node {daemon.node_id} needs its drill token as well ('authorization: "
                                     "Bearer <token>'; ftctl drill: FTD_DRILL_TOKEN or --token-file) "
                                     "(rule: drill_token)")
        training = self.daemon.training
        if request.mode == agent_pb2.KillRequest.WORKER:
            workers = training.workers() if training is not None else []
            if request.pid:
                workers = [p for p in workers if p == request.pid]
            if not workers:
                which = f" with pid {request.pid}" if request.pid else ""
                raise errors.NodeCannot(f"node {self.daemon.node_id} runs no training worker{which}")
            os.kill(workers[-1], signal.SIGKILL)
            log.warning("drill: SIGKILLed training worker %d (%s)", workers[-1], request.reason or "no reason given")
            return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=[workers[-1]])
        if request.mode == agent_pb2.KillRequest.HANG:
            stopped = training.signal_workers(signal.SIGSTOP) if training is not None else []
            if not stopped:
                raise errors.NodeCannot(f"node {self.daemon.node_id} runs no training worker")
            log.warning("drill: SIGSTOPped training workers %s (%s)", stopped, request.reason or "no reason given")
            return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=stopped)
        # a dead node's processes all die with it: the workers, the standbys, what the agent supervises
        killed = signal_pids([*training.workers(), *training.standby_pids()], signal.SIGKILL) \
            if training is not None else []
        killed += self.daemon.supervisor.kill_all()
        log.warning("drill: killing node %s now (%s); supervised pids %s SIGKILLed", self.daemon.node_id,
                    request.reason or "no reason given", killed)
        # Let the answer leave before the process disappears; SIGKILL cannot be caught or delayed.
        threading.Timer(0.05, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=killed)

    # ---- checkpoints: forwarded to the coordinator ------------------------------------------------

    def _forward(self, method: str, request: Any) -> Any:
        try:
            return self.daemon.client.call(method, request, idempotent=True)
        except grpc.RpcError as exc:
            raise errors.Forwarded(rpc_code(exc) or grpc.StatusCode.UNKNOWN, rpc_details(exc)) from exc
        except ConnectionError as exc:
            raise errors.CoordinatorUnreachable(str(exc)) from exc

    @answers
    def CommitShard(self, request: checkpoint_pb2.CommitShardRequest,
                    context: grpc.ServicerContext) -> checkpoint_pb2.CommitShardResponse:
        if not request.tier:
            request.tier = "ssd"
        replicator = self.daemon.replicator
        if request.tier == "mem" and replicator is not None and not request.from_tier:
            # Soft state: into this node's inventory, announced on the heartbeat stream (agent.memory_report);
            # answered at once, whether or not a leader is reachable now.
            if request.location not in ("", self.daemon.node_id):
                raise errors.BadRequest(f"location: a memory snapshot is recorded on its own node "
                                        f"{self.daemon.node_id}, not {request.location[:100]!r}")
            response = replicator.inventory.own(request)
            m = request.manifest
            replicator.enqueue(m.job, m.step, m.rank)  # to the buddy, in the background
            return response
        if not request.location:
            request.location = self.daemon.node_id if request.tier != "s3" else "s3"
        what = f"step {request.manifest.step} (rank {request.manifest.rank}) on {request.tier}"
        if request.from_tier:  # its bytes are in the memory tier: the first tiering hop copies them first
            self.daemon.tiering.persist(request.from_tier, request.tier, request.manifest)
            request.from_tier = ""
        # A memory snapshot is never waited for without a leader; a durable commit rides out a
        # failover (a few seconds) but not an outage, where it could only time out.
        self._need_leader(what, 0.0 if request.tier == "mem" else DURABLE_COMMIT_GRACE_S)
        response = self._forward("CommitShard", request)
        if request.tier == "mem" and self.daemon.replicator is not None:  # to the buddy, in the background
            m = request.manifest
            self.daemon.replicator.enqueue(m.job, m.step, m.rank)
        else:
            self.daemon.tiering.notify()
        return response  # type: ignore[no-any-return]

    def _need_leader(self, what: str, grace_s: float = 0.0) -> None:
        """Checkpoint bookkeeping runs in the training's save path: while no leader can record it
        (etcd down) waiting out the client's deadline would stall the next save behind this one, so it
        fails at once once the node has been without a leader for ``grace_s`` (memory snapshots: at
        once, the next step records again)."""
        away = self.daemon.session.disconnected_for()
        if not self.daemon.session.connected and away >= grace_s:
            raise errors.CoordinatorUnreachable(f"node {self.daemon.node_id} has had no coordinator leader for "
                                                f"{away:.1f}s: {what} not recorded")

    @answers
    def RecordCopy(self, request: checkpoint_pb2.RecordCopyRequest,
                   context: grpc.ServicerContext) -> checkpoint_pb2.RecordCopyResponse:
        replicator = self.daemon.replicator
        if request.tier == "mem" and replicator is not None and request.location in ("", self.daemon.node_id):
            # this node's own memory copy: the inventory stops announcing it (the heartbeat tells the leader)
            replicator.inventory.gone(request.job, request.step, request.rank)
            if not request.corrupt_reason:
                return checkpoint_pb2.RecordCopyResponse()
            request.location = self.daemon.node_id  # a corrupt mark is the leader's to keep (its ledger, not etcd)
        if request.tier == "mem":
            self._need_leader(f"memory copy of step {request.step} (rank {request.rank})")
        return self._forward("RecordCopy", request)  # type: ignore[no-any-return]

    @answers
    def InvalidateCheckpoint(self, request: checkpoint_pb2.InvalidateCheckpointRequest,
                             context: grpc.ServicerContext) -> checkpoint_pb2.CheckpointInfo:
        return self._forward("InvalidateCheckpoint", request)  # type: ignore[no-any-return]

    @answers
    def GetRestoreTarget(self, request: checkpoint_pb2.GetRestoreTargetRequest,
                         context: grpc.ServicerContext) -> checkpoint_pb2.RestoreTarget:
        return self._forward("GetRestoreTarget", request)  # type: ignore[no-any-return]

    def VerifyCopy(self, request: agent_pb2.VerifyCopyRequest,
                   context: grpc.ServicerContext) -> agent_pb2.VerifyCopyResponse:
        started = time.perf_counter()
        ok, error, size = self.daemon.tiering.verify(request.job, request.step, request.rank, request.tier)
        return agent_pb2.VerifyCopyResponse(ok=ok, error=error, bytes=size, seconds=time.perf_counter() - started)

    def GetTiers(self, request: agent_pb2.GetTiersRequest, context: grpc.ServicerContext) -> agent_pb2.Tiers:
        return self.daemon.tiers_info()

    @answers
    def SignShard(self, request: agent_pb2.SignShardRequest,
                  context: grpc.ServicerContext) -> agent_pb2.SignShardResponse:
        """A shard statement signed with this node's key (ftd.checkpoints.signing), for its training."""
        if self.daemon.identity is None:
            raise errors.NodeCannot(f"node {self.daemon.node_id} runs without mTLS: it has no key to sign shards")
        material = self.daemon.identity.load()
        try:
            signature = signing.sign_statement(request.statement, material.key_pem)
        except signing.BadSignature as exc:
            raise errors.BadRequest(f"SignShard signs shard statements only: {exc}") from exc
        return agent_pb2.SignShardResponse(signature=signature, certificate_pem=material.cert_pem)

    def GetShardTrust(self, request: agent_pb2.GetShardTrustRequest,
                      context: grpc.ServicerContext) -> agent_pb2.ShardTrust:
        if self.daemon.identity is None:
            return agent_pb2.ShardTrust()
        material = self.daemon.identity.load()
        own = identity_of(material.cert_pem)
        return agent_pb2.ShardTrust(ca_pem=material.ca_pem, cluster=own.cluster if own else "")


def add_to_server(server: Any, daemon: AgentDaemon) -> None:
    agent_pb2_grpc.add_AgentServicer_to_server(AgentService(daemon), server)
