"""The coordinator's gRPC service: a thin translation between protobuf and the parts of
:class:`~.control.Controller` (membership, jobs, catalog, queries).

Errors are mapped once here (:func:`~.errors.grpc_code`); a standby's refusal carries the leader's
address in the ``ftd-leader`` trailing metadata so clients can follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn, TypeVar

import grpc
from grpc import aio
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs

from ftd.authz import AuthzFacts
from ftd.authz_interceptors import peer_identity
from ftd.client import LEADER_METADATA_KEY
from ftd.identity import Identity
from ftd.v1 import checkpoint_pb2, coordinator_pb2, coordinator_pb2_grpc

from . import errors
from .control import Controller
from .membership import ACK, Stream

log = logging.getLogger("ftd.coordinator.service")
T = TypeVar("T")


async def _abort(context: aio.ServicerContext[Any, Any], exc: errors.CoordinatorError) -> NoReturn:
    if isinstance(exc, errors.NotLeader) or (isinstance(exc, errors.ReportsPending) and exc.leader_address):
        context.set_trailing_metadata(((LEADER_METADATA_KEY, exc.leader_address),))  # retry there (ftd.client)
    await context.abort(errors.grpc_code(exc), str(exc))
    raise AssertionError("unreachable")  # context.abort raises


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, controller: Controller) -> None:
        self.ctl = controller

    async def _unary(self, context: aio.ServicerContext[Any, Any], fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except errors.CoordinatorError as exc:
            await _abort(context, exc)
        except Exception as exc:  # a bug: answer INTERNAL with what happened, keep serving
            log.exception("request failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"coordinator bug: {type(exc).__name__}: {exc}")
            raise

    async def Register(self, request: coordinator_pb2.RegisterRequest,
                       context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RegisterResponse:
        return await self._unary(context, lambda: self.ctl.membership.register(request))

    async def GetStatus(self, request: coordinator_pb2.GetStatusRequest,
                        context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.ClusterStatus:
        async def status() -> coordinator_pb2.ClusterStatus:
            return self.ctl.status()
        return await self._unary(context, status)

    async def ListNodes(self, request: coordinator_pb2.ListNodesRequest,
                        context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.ListNodesResponse:
        async def nodes() -> coordinator_pb2.ListNodesResponse:
            return self.ctl.nodes(request)
        return await self._unary(context, nodes)

    async def ListEvents(self, request: coordinator_pb2.ListEventsRequest,
                         context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.ListEventsResponse:
        return await self._unary(context, lambda: self.ctl.event_page(request))

    # ---- checkpoint catalog --------------------------------------------------------------------

    async def CommitShard(self, request: checkpoint_pb2.CommitShardRequest,
                          context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.CommitShardResponse:
        caller = peer_identity(context)
        return await self._unary(context, lambda: self.ctl.catalog.commit_shard(request, caller))

    async def RecordCopy(self, request: checkpoint_pb2.RecordCopyRequest,
                         context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.RecordCopyResponse:
        caller = peer_identity(context)
        return await self._unary(context, lambda: self.ctl.catalog.record_copy(request, caller))

    async def InvalidateCheckpoint(self, request: checkpoint_pb2.InvalidateCheckpointRequest,
                                   context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.CheckpointInfo:
        return await self._unary(context, lambda: self.ctl.catalog.invalidate(request))

    async def ListCheckpoints(self, request: checkpoint_pb2.ListCheckpointsRequest,
                              context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.ListCheckpointsResponse:
        async def listed() -> checkpoint_pb2.ListCheckpointsResponse:
            return self.ctl.catalog.list_page(request)
        return await self._unary(context, listed)

    async def GetRestoreTarget(self, request: checkpoint_pb2.GetRestoreTargetRequest,
                               context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.RestoreTarget:
        async def target() -> checkpoint_pb2.RestoreTarget:
            await self.ctl.catalog.prepare(request.job)
            answer = self.ctl.catalog.restore_target(request.job, request.world_size, request.replicated,
                                                     request.format)
            await self.ctl.catalog.floors.pin(request.job, answer)  # in etcd before it is given (restore_floors.py)
            return answer
        return await self._unary(context, target)

    async def Rollback(self, request: checkpoint_pb2.RollbackRequest,
                       context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.RollbackResponse:
        return await self._unary(context, lambda: self.ctl.catalog.rollback(request))

    async def ForgetJob(self, request: checkpoint_pb2.ForgetJobRequest,
                        context: aio.ServicerContext[Any, Any]) -> checkpoint_pb2.ForgetJobResponse:
        def job_state() -> Any:
            view = self.ctl.committer.view
            return view.jobs.get(request.job) if view is not None else None
        return await self._unary(context, lambda: self.ctl.catalog.forget(request, job_state()))

    # ---- the training job's rendezvous ------------------------------------------------------------

    async def JoinRound(self, request: coordinator_pb2.JoinRoundRequest,
                        context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        return await self._unary(context, lambda: self.ctl.jobs.join(request))

    async def GetRound(self, request: coordinator_pb2.GetRoundRequest,
                       context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        async def get() -> coordinator_pb2.RoundInfo:
            return self.ctl.jobs.get(request.job)
        return await self._unary(context, get)

    async def SetRoundStore(self, request: coordinator_pb2.SetRoundStoreRequest,
                            context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        return await self._unary(context, lambda: self.ctl.jobs.set_store(request))

    async def CloseJob(self, request: coordinator_pb2.CloseJobRequest,
                       context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        return await self._unary(context, lambda: self.ctl.jobs.close(request))

    async def ReportHang(self, request: coordinator_pb2.ReportHangRequest,
                         context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.ReportHangResponse:
        return await self._unary(context, lambda: self.ctl.jobs.report_hang(request))

    async def Drain(self, request: coordinator_pb2.DrainRequest,
                    context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.DrainResponse:
        return await self._unary(context, lambda: self.ctl.drains.drain(request))

    async def Revoke(self, request: coordinator_pb2.RevokeRequest,
                     context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RevokeResponse:
        return await self._unary(context, lambda: self.ctl.access.revoke(request))

    async def Admit(self, request: coordinator_pb2.AdmitRequest,
                    context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.AdmitResponse:
        return await self._unary(context, lambda: self.ctl.access.admit(request))

    async def GetDenyList(self, request: coordinator_pb2.GetDenyListRequest,
                          context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.DenyListResponse:
        async def get() -> coordinator_pb2.DenyListResponse:
            return self.ctl.access.get_deny_list(request)
        return await self._unary(context, get)

    async def GetGoodput(self, request: coordinator_pb2.GetGoodputRequest,
                         context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.GoodputReport:
        async def get() -> coordinator_pb2.GoodputReport:
            return self.ctl.goodput_report(request)
        return await self._unary(context, get)

    async def Heartbeat(  # type: ignore[override]  # read/write style, not an async generator
        self, request_iterator: AsyncIterator[coordinator_pb2.HeartbeatRequest],
        context: aio.ServicerContext[Any, Any],
    ) -> None:
        first = await context.read()
        if first is EOF:
            return
        try:
            stream = self.ctl.membership.open_stream(first)
        except errors.CoordinatorError as exc:
            await _abort(context, exc)
        stream.queue.put_nowait(ACK)
        reader = asyncio.create_task(self._read(stream, context))
        try:
            while True:
                item = await stream.queue.get()
                while item is not None and not stream.queue.empty():
                    item = stream.queue.get_nowait()  # coalesce: one answer carries the latest state
                if item is None:
                    break
                try:
                    response = self.ctl.membership.heartbeat_response(stream)
                except errors.CoordinatorError as exc:
                    stream.close_error = exc
                    break
                await context.write(response)
                self.ctl.metrics.heartbeat_answers.inc()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.ctl.membership.close_stream(stream)
        if stream.close_error is not None:
            await _abort(context, stream.close_error)

    async def FollowMemory(
        self, request: coordinator_pb2.FollowMemoryRequest, context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[coordinator_pb2.MemoryMirror]:
        """A standby follows this leader's memory ledger (memory_mirror.py); the authorization table lets
        only coordinator replicas' certificates call it."""
        if not self.ctl.is_leader:
            await _abort(context, errors.NotLeader(self.ctl.replica_id, self.ctl.leader_address()))
        async for msg in self.ctl.mirror_feed.follow(request.replica_id[:200]):
            yield msg

    async def _read(self, stream: Stream, context: aio.ServicerContext[Any, Any]) -> None:
        try:
            while True:
                request = await context.read()
                if request is EOF:
                    break
                try:
                    self.ctl.membership.on_heartbeat(stream, request)
                except errors.CoordinatorError as exc:
                    stream.close(exc)
                    return
                if self.ctl.membership.ack_due(stream):
                    stream.queue.put_nowait(ACK)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the client went away mid-read
            log.debug("heartbeat stream of %s ended: %r", stream.node_id, exc)
        stream.queue.put_nowait(None)


def authz_facts(controller: Controller) -> Callable[[str, Identity, Mapping[str, object]], AuthzFacts]:
    """What the authorization table's node rules need (:class:`~ftd.authz.AuthzFacts`), from the
    leader's view, for :class:`ftd.authz_interceptors.Guard`: the host the calling node registered from, the members
    of the request's job (its current round) and that round's rank 0. On a standby (or a leader that
    cannot confirm its lease) every fact is unknown: the handler refuses the call there anyway
    (``NotLeader``). A fact that is unknown on the leader is left to the handler, which acts on the
    caller alone (``ReportHang`` of a job it does not know) or refuses (``SetRoundStore`` of another
    round, or of a node that is not its rank 0: :func:`~.rendezvous.set_store`)."""
    committer = controller.committer

    def facts(method: str, identity: Identity, fields: Mapping[str, object]) -> AuthzFacts:
        view = committer.view
        if not committer.is_leader or view is None:
            return AuthzFacts()
        node = view.nodes.get(identity.name)
        job = view.jobs.get(str(fields.get("job", "") or ""))
        rank0 = None
        if job is not None and job.members and fields.get("round") == job.round:
            rank0 = job.members[0]
        return AuthzFacts(registered_host=node.host if node is not None else None,
                          job_members=frozenset(job.members) if job is not None else None,
                          round_rank0=rank0)

    return facts


def add_to_server(server: aio.Server, controller: Controller) -> None:
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorService(controller), server)
