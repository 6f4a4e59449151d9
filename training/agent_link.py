"""The training process's link to its node's agent (gRPC over the agent's Unix socket).

Every call has a deadline. The agent forwards catalog calls to the coordinator leader; a failure
reaches the caller as :class:`AgentUnavailable` (no agent, or it could not reach the coordinator)
or :class:`CatalogRefused` (the coordinator refused the change, e.g. a contradicting shard).

The restore's outcome travels with the link: :meth:`AgentLink.report_restored` tells the agent what
the world resumed from (drills and the demo report it), and :attr:`AgentLink.restored_step` goes
with every ``CommitShard`` (the catalog abandons only the older epochs' steps newer than it).

The node's tiers arrive in agent.proto's wire form (``GetTiers``, written by
``ftd.agent.tiers_wire``); :func:`tiers_from_proto` reads them back into the specs the agent
opened, so both sides open identical backends.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import grpc

from ftd import rpc
from ftd.rpc import rpc_code, rpc_details
from ftd.storage_backends.tiers import LocalSpec, S3Spec, TierSpec
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

ENV_SOCKET = "FTD_AGENT_SOCKET"
RESTORE_TARGET_RETRY_S = 30.0  # a failover plus the new leader's memory_report_deadline_s, with room


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
        self.restored_step: int | None = None  # what this world restored (-1: nothing); None: no restore asked
        self.round: int | None = None  # the job round this process runs in (FTD_ROUND); None: not known

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

    def commit_shard(self, manifest: checkpoint_pb2.ShardManifest, tier: str = "", cadence: str = "",
                     from_tier: str = "", timeout_s: float | None = None) -> checkpoint_pb2.CommitShardResponse:
        """``tier`` "" is the SSD; "mem" a memory snapshot (the agent replicates it to its buddy).
        ``from_tier`` "mem": the shard's bytes are in the memory tier, and the agent copies them to
        ``tier`` before it commits (the durable step of a memory snapshot: allow ``timeout_s``).
        :attr:`restored_step` goes with it (when a restore was asked), and :attr:`round` when known."""
        request = checkpoint_pb2.CommitShardRequest(manifest=manifest, tier=tier, cadence=cadence, from_tier=from_tier)
        if self.restored_step is not None:
            request.restored_step = self.restored_step
        if self.round is not None:
            request.job_round = self.round
        return self._call("CommitShard", request, timeout_s=timeout_s)  # type: ignore[no-any-return]

    def fetch_shard(self, request: agent_pb2.FetchShardRequest,
                    timeout_s: float = 300.0) -> agent_pb2.FetchShardResponse:
        """A copy held by another node, pulled by the agent into a local directory. ``AgentUnavailable``
        also when that node cannot be reached (the copy is skipped); ``CatalogRefused`` with NOT_FOUND
        (not there) or DATA_LOSS (corrupt)."""
        return self._call("FetchShard", request, timeout_s=timeout_s)  # type: ignore[no-any-return]

    def record_copy(self, request: checkpoint_pb2.RecordCopyRequest) -> checkpoint_pb2.RecordCopyResponse:
        return self._call("RecordCopy", request)  # type: ignore[no-any-return]

    def record_gone(self, job: str, step: int, rank: int, tier: str, location: str) -> None:
        """Best effort, never raises: this node no longer holds that copy (the catalog must not
        keep offering it; the next memory commit prunes it anyway)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.record_copy(checkpoint_pb2.RecordCopyRequest(job=job, step=step, rank=rank, tier=tier,
                                                              location=location, present=False))

    def record_corrupt(self, job: str, step: int, rank: int, tier: str, location: str, why: str) -> None:
        """Best effort, never raises: that copy failed its check (a peer's copy is recorded by its node)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.record_copy(checkpoint_pb2.RecordCopyRequest(job=job, step=step, rank=rank, tier=tier,
                                                              location=location, present=True, corrupt_reason=why))

    def invalidate(self, job: str, step: int, reason: str) -> checkpoint_pb2.CheckpointInfo:
        return self._call("InvalidateCheckpoint", checkpoint_pb2.InvalidateCheckpointRequest(  # type: ignore[no-any-return]
            job=job, step=step, reason=reason))

    def restore_target(self, job: str, replicated: bool = False, world_size: int = 0,
                       fmt: str = "") -> checkpoint_pb2.RestoreTarget:
        """The step to restore for a job of ``world_size`` ranks saving in ``fmt`` (0, "": not said):
        of that size, or of any size when the job reshards (``dcp``) or is ``replicated``. UNAVAILABLE
        (no leader yet, or a new leader still hearing the nodes' memory reports) is retried for up to
        ``RESTORE_TARGET_RETRY_S``, then raised."""
        request = checkpoint_pb2.GetRestoreTargetRequest(job=job, replicated=replicated, world_size=world_size,
                                                         format=fmt)
        deadline = time.monotonic() + RESTORE_TARGET_RETRY_S
        pause = 0.1
        while True:
            try:
                return self._call("GetRestoreTarget", request)  # type: ignore[no-any-return]
            except AgentUnavailable:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def report_restored(self, restored: cluster_pb2.Restored) -> None:
        """Best effort, never raises: what this rank restored (the agent keeps it in its progress)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self._call("ReportProgress", agent_pb2.ReportProgressRequest(rank=restored.rank, restored=restored),
                       timeout_s=2.0)

    def report(self, rank: int, step: int | None = None, loss: float | None = None, grad_norm: float | None = None,
               error: str = "", error_kind: str = "", flops: float | None = None,
               checkpoint: agent_pb2.CheckpointEvent | None = None,
               parked_step: int | None = None,
               timing: cluster_pb2.StepTiming | None = None,
               fingerprint: cluster_pb2.Fingerprint | None = None) -> agent_pb2.ReportProgressResponse:
        """``parked_step`` (with ``step``): this rank stopped there for a planned hand-over (-1: its final
        save failed); the coordinator commits the hand-over once that step is restorable."""
        request = agent_pb2.ReportProgressRequest(rank=rank, checkpoint_error=error, checkpoint_error_kind=error_kind)
        if self.round is not None:
            request.job_round = self.round
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
            if parked_step is not None:
                request.progress.parked_step = parked_step
            if timing is not None:
                request.progress.timing.CopyFrom(timing)
            if fingerprint is not None:
                request.progress.fingerprints.append(fingerprint)
        return self._call("ReportProgress", request, timeout_s=2.0)  # type: ignore[no-any-return]

    def sign_shard(self, statement: bytes) -> agent_pb2.SignShardResponse:
        """The node key's signature over a shard statement (ftd.checkpoints.signing)."""
        return self._call("SignShard", agent_pb2.SignShardRequest(statement=statement))  # type: ignore[no-any-return]

    def shard_trust(self) -> agent_pb2.ShardTrust:
        """The cluster CA shard signatures are checked against (empty: the agent runs without mTLS)."""
        return self._call("GetShardTrust", agent_pb2.GetShardTrustRequest())  # type: ignore[no-any-return]

    def close(self) -> None:
        self._channel.close()


def spec_from_proto(msg: agent_pb2.TierSpec) -> TierSpec:
    """Raises ``ValueError`` for a spec that names no storage or carries out-of-range settings."""
    which = msg.WhichOneof("storage")
    storage: LocalSpec | S3Spec
    if which == "local":
        if not msg.local.path:
            raise ValueError(f"tier {msg.name!r}: the directory tier has no path")
        storage = LocalSpec(Path(msg.local.path), msg.local.capacity_bytes)
    elif which == "s3":
        s = msg.s3
        storage = S3Spec(
            endpoint=s.endpoint, bucket=s.bucket, prefix=s.prefix, region=s.region,
            connect_timeout_s=s.connect_timeout_s, read_timeout_s=s.read_timeout_s, max_attempts=s.max_attempts,
            state_dir=Path(s.state_dir) if s.state_dir else None, part_size=s.part_size, concurrency=s.concurrency,
            backoff_s=s.backoff_s, max_backoff_s=s.max_backoff_s, part_checksum=s.part_checksum,
            spool_dir=Path(s.spool_dir) if s.spool_dir else None)
    else:
        raise ValueError(f"tier {msg.name!r} names no storage (an agent older than the training side?)")
    return TierSpec(msg.name, msg.location, storage)


def tiers_from_proto(msg: agent_pb2.Tiers) -> list[TierSpec]:
    if not msg.tiers:
        raise ValueError(f"node {msg.node_id!r} reported no tiers (an agent older than the training side?)")
    return [spec_from_proto(t) for t in msg.tiers]
