"""The training process's link to its node's agent (gRPC over the agent's Unix socket).

Every call has a deadline. The agent forwards catalog calls to the coordinator leader; a failure
reaches the caller as :class:`AgentUnavailable` (no agent, or it could not reach the coordinator)
or :class:`CatalogRefused` (the coordinator refused the change, e.g. a contradicting shard).
"""

from __future__ import annotations

import os
from typing import Any

import grpc

from ftd import rpc
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

ENV_SOCKET = "FTD_AGENT_SOCKET"


class AgentUnavailable(ConnectionError):
    pass


class CatalogRefused(RuntimeError):
    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code else '?'}: {details}")
        self.code = code


class AgentLink:
    def __init__(self, socket_path: str | None = None, timeout_s: float = 10.0) -> None:
        path = socket_path or os.environ.get(ENV_SOCKET)
        if not path:
            raise AgentUnavailable(f"no agent socket: set {ENV_SOCKET} (the ftd agent sets it for the workers it "
                                   "launches) or pass agent_socket=")
        self.socket_path = path
        self.timeout_s = timeout_s
        self._channel = rpc.channel(f"unix:{path}")
        self._stub = agent_pb2_grpc.AgentStub(self._channel)

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            code = rpc_code(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise AgentUnavailable(f"agent at unix:{self.socket_path}: {rpc_details(exc)}") from exc
            raise CatalogRefused(code, rpc_details(exc)) from exc

    def info(self) -> agent_pb2.AgentInfo:
        return self._call("GetInfo", agent_pb2.GetInfoRequest())  # type: ignore[no-any-return]

    def tiers(self) -> agent_pb2.Tiers:
        return self._call("GetTiers", agent_pb2.GetTiersRequest())  # type: ignore[no-any-return]

    def commit_shard(self, manifest: checkpoint_pb2.ShardManifest, tier: str = "",
                     cadence: str = "") -> checkpoint_pb2.CommitShardResponse:
        """``tier`` "" is the SSD; "mem" a memory snapshot (the agent replicates it to its buddy)."""
        return self._call("CommitShard", checkpoint_pb2.CommitShardRequest(  # type: ignore[no-any-return]
            manifest=manifest, tier=tier, cadence=cadence))

    def fetch_shard(self, request: agent_pb2.FetchShardRequest,
                    timeout_s: float = 300.0) -> agent_pb2.FetchShardResponse:
        """A copy held by another node, pulled by the agent into a local directory. ``AgentUnavailable``
        also when that node cannot be reached (the copy is skipped); ``CatalogRefused`` with NOT_FOUND
        (not there) or DATA_LOSS (corrupt)."""
        return self._call("FetchShard", request, timeout_s=timeout_s)  # type: ignore[no-any-return]

    def record_copy(self, request: checkpoint_pb2.RecordCopyRequest) -> checkpoint_pb2.RecordCopyResponse:
        return self._call("RecordCopy", request)  # type: ignore[no-any-return]

    def invalidate(self, job: str, step: int, reason: str) -> checkpoint_pb2.CheckpointInfo:
        return self._call("InvalidateCheckpoint", checkpoint_pb2.InvalidateCheckpointRequest(  # type: ignore[no-any-return]
            job=job, step=step, reason=reason))

    def restore_target(self, job: str, replicated: bool = False) -> checkpoint_pb2.RestoreTarget:
        return self._call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(  # type: ignore[no-any-return]
            job=job, replicated=replicated))

    def report(self, rank: int, step: int | None = None, loss: float | None = None, grad_norm: float | None = None,
               error: str = "", error_kind: str = "", flops: float | None = None,
               checkpoint: agent_pb2.CheckpointEvent | None = None) -> agent_pb2.ReportProgressResponse:
        request = agent_pb2.ReportProgressRequest(rank=rank, checkpoint_error=error, checkpoint_error_kind=error_kind)
        if checkpoint is not None:
            request.checkpoint.CopyFrom(checkpoint)
        if step is not None:
            request.progress.CopyFrom(cluster_pb2.Progress(step=step))
            if loss is not None:
                request.progress.loss = loss
            if grad_norm is not None:
                request.progress.grad_norm = grad_norm
            if flops is not None:
                request.progress.flops = flops
        return self._call("ReportProgress", request, timeout_s=2.0)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._channel.close()
