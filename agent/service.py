"""The agent's gRPC service: the training process's local endpoint and the operator's drill handle."""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import grpc

from ftd.v1 import agent_pb2, agent_pb2_grpc

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
        if not request.HasField("progress"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "progress: is required")
        if request.progress.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"progress.step: must be >= 0, got {request.progress.step}")
        self.daemon.report_progress(request.progress)
        return agent_pb2.ReportProgressResponse(assignment=self.daemon.session.assignment)

    def Kill(self, request: agent_pb2.KillRequest, context: grpc.ServicerContext) -> agent_pb2.KillResponse:
        expected = self.daemon.settings.drill_token
        if not expected:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"drills are disabled on node {self.daemon.node_id}: set drill_token to enable Kill")
        if not hmac.compare_digest(bearer_token(context).encode(), expected.encode()):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"Kill on node {self.daemon.node_id} needs 'authorization: Bearer <drill token>'")
        killed = self.daemon.supervisor.kill_all()
        log.warning("drill: killing node %s now (%s); supervised pids %s SIGKILLed", self.daemon.node_id,
                    request.reason or "no reason given", killed)
        # Let the answer leave before the process disappears; SIGKILL cannot be caught or delayed.
        threading.Timer(0.05, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        return agent_pb2.KillResponse(pid=os.getpid(), killed_pids=killed)


def add_to_server(server: Any, daemon: AgentDaemon) -> None:
    agent_pb2_grpc.add_AgentServicer_to_server(AgentService(daemon), server)
