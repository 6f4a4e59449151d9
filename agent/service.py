"""The agent's gRPC service: the training process's local endpoint and the operator's drill handle."""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc

from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

from .training import signal_pids

if TYPE_CHECKING:
    from .daemon import AgentDaemon

log = logging.getLogger("ftd.agent")


def bearer_token(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, daemon: AgentDaemon) -> None:
        self.daemon = daemon

    def GetInfo(self, request: agent_pb2.GetInfoRequest, context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        return self.daemon.info()

    def ReportProgress(self, request: agent_pb2.ReportProgressRequest,
                       context: grpc.ServicerContext) -> agent_pb2.ReportProgressResponse:
        if request.HasField("checkpoint"):
            self.daemon.checkpoint_event(request.rank, request.checkpoint)
        if request.checkpoint_error:
            kind = request.checkpoint_error_kind or "error"
            self.daemon.metrics.save_failures.labels(kind[:40]).inc()
            log.error("checkpoint save failed on rank %d (%s): %s", request.rank, kind, request.checkpoint_error[:500])
        if not request.HasField("progress") and (request.checkpoint_error or request.HasField("checkpoint")):
            return self._progress_answer()
        if not request.HasField("progress"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "progress: is required")
        if request.progress.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"progress.step: must be >= 0, got {request.progress.step}")
        self.daemon.report_progress(request.progress)
        return self._progress_answer()

    def _progress_answer(self) -> agent_pb2.ReportProgressResponse:
        pending = self.daemon.handover.pending
        return agent_pb2.ReportProgressResponse(assignment=self.daemon.session.assignment,
                                                handover=bool(pending.nodes), handover_reason=pending.reason)

    def CheckHealth(self, request: agent_pb2.CheckHealthRequest,
                    context: grpc.ServicerContext) -> cluster_pb2.HealthVerdict:
        return self.daemon.check_health()

    def Kill(self, request: agent_pb2.KillRequest, context: grpc.ServicerContext) -> agent_pb2.KillResponse:
        expected = self.daemon.settings.drill_token
        if not expected:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"drills are disabled on node {self.daemon.node_id}: set drill_token to enable Kill")
        if not hmac.compare_digest(bearer_token(context).encode(), expected.encode()):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"Kill on node {self.daemon.node_id} needs 'authorization: Bearer <drill token>'")
        training = self.daemon.training
        if request.mode == agent_pb2.KillRequest.WORKER:
            workers = training.workers() if training is not None else []
            if request.pid:
                workers = [p for p in workers if p == request.pid]
            if not workers:
                which = f" with pid {request.pid}" if request.pid else ""
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"node {self.daemon.node_id} runs no training worker{which}")
            os.kill(workers[-1], signal.SIGKILL)
            log.warning("drill: SIGKILLed training worker %d (%s)", workers[-1], request.reason or "no reason given")
            return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=[workers[-1]])
        if request.mode == agent_pb2.KillRequest.HANG:
            stopped = training.signal_workers(signal.SIGSTOP) if training is not None else []
            if not stopped:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"node {self.daemon.node_id} runs no training worker")
            log.warning("drill: SIGSTOPped training workers %s (%s)", stopped, request.reason or "no reason given")
            return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=stopped)
        killed = signal_pids(training.workers(), signal.SIGKILL) if training is not None else []
        killed += self.daemon.supervisor.kill_all()
        log.warning("drill: killing node %s now (%s); supervised pids %s SIGKILLed", self.daemon.node_id,
                    request.reason or "no reason given", killed)
        # Let the answer leave before the process disappears; SIGKILL cannot be caught or delayed.
        threading.Timer(0.05, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=killed)

    # ---- checkpoints: forwarded to the coordinator ------------------------------------------------

    def _forward(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return self.daemon.client.call(method, request, idempotent=True)
        except grpc.RpcError as exc:
            code = rpc_code(exc) or grpc.StatusCode.UNKNOWN
            context.abort(code, rpc_details(exc))
        except ConnectionError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise AssertionError("unreachable")

    def CommitShard(self, request: checkpoint_pb2.CommitShardRequest,
                    context: grpc.ServicerContext) -> checkpoint_pb2.CommitShardResponse:
        if not request.tier:
            request.tier = "ssd"
        if not request.location:
            request.location = self.daemon.node_id if request.tier != "s3" else "s3"
        response = self._forward("CommitShard", request, context)
        self.daemon.tiering.notify()
        return response  # type: ignore[no-any-return]

    def RecordCopy(self, request: checkpoint_pb2.RecordCopyRequest,
                   context: grpc.ServicerContext) -> checkpoint_pb2.RecordCopyResponse:
        return self._forward("RecordCopy", request, context)  # type: ignore[no-any-return]

    def InvalidateCheckpoint(self, request: checkpoint_pb2.InvalidateCheckpointRequest,
                             context: grpc.ServicerContext) -> checkpoint_pb2.CheckpointInfo:
        return self._forward("InvalidateCheckpoint", request, context)  # type: ignore[no-any-return]

    def GetRestoreTarget(self, request: checkpoint_pb2.GetRestoreTargetRequest,
                         context: grpc.ServicerContext) -> checkpoint_pb2.RestoreTarget:
        return self._forward("GetRestoreTarget", request, context)  # type: ignore[no-any-return]

    def VerifyCopy(self, request: agent_pb2.VerifyCopyRequest,
                   context: grpc.ServicerContext) -> agent_pb2.VerifyCopyResponse:
        started = time.perf_counter()
        ok, error, size = self.daemon.tiering.verify(request.job, request.step, request.rank, request.tier)
        return agent_pb2.VerifyCopyResponse(ok=ok, error=error, bytes=size, seconds=time.perf_counter() - started)

    def GetTiers(self, request: agent_pb2.GetTiersRequest, context: grpc.ServicerContext) -> agent_pb2.Tiers:
        return self.daemon.tiers_info()


def add_to_server(server: Any, daemon: AgentDaemon) -> None:
    agent_pb2_grpc.add_AgentServicer_to_server(AgentService(daemon), server)
