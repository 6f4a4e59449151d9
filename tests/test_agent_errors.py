"""The agent's one error table (ftd.agent.errors): every error answers with the status its table
gives, a peer's status reads back as the class that sent it, and the service's translation does so
over real gRPC on loopback, for a unary call and a response stream."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from ftd import rpc
from ftd.agent import errors
from ftd.agent.service import answers
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2

EXPECTED = {
    errors.BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NodeCannot: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DrillDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.PeerDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.PeerBusy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NoRoom: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NoFastCopy: grpc.StatusCode.UNIMPLEMENTED,
    errors.TierUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.CoordinatorUnreachable: grpc.StatusCode.UNAVAILABLE,
    errors.PeerCopyError: grpc.StatusCode.UNAVAILABLE,
    errors.PeerUnreachable: grpc.StatusCode.UNAVAILABLE,
    errors.CallCancelled: grpc.StatusCode.UNAVAILABLE,
    errors.PeerRefusedIdentity: grpc.StatusCode.UNAVAILABLE,
    errors.CopyMissing: grpc.StatusCode.NOT_FOUND,
    errors.CopyCorrupt: grpc.StatusCode.DATA_LOSS,
}


def all_subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(all_subclasses(c) for c in found))


def test_every_error_has_its_status() -> None:
    assert all_subclasses(errors.AgentError) - {errors.Forwarded} == set(EXPECTED), "a class missing from EXPECTED"
    for cls, code in EXPECTED.items():
        exc = cls("node n-1: why")
        assert errors.grpc_code(exc) is code and exc.code is code, cls.__name__
    assert errors.grpc_code(errors.Forwarded(grpc.StatusCode.ALREADY_EXISTS, "step 5 exists")) \
        is grpc.StatusCode.ALREADY_EXISTS
    assert errors.grpc_code(ValueError("a bug")) is grpc.StatusCode.UNKNOWN


def test_a_peers_status_reads_back_as_the_class_that_sent_it() -> None:
    for code, cls in errors.PEER_ERRORS.items():
        if code in EXPECTED.values():  # what an agent answers (the rest come from the transport)
            assert errors.grpc_code(cls("x")) is code, code
    # restore skips what did not answer and blames only what arrived wrong
    assert issubclass(errors.PEER_ERRORS[grpc.StatusCode.DEADLINE_EXCEEDED], errors.PeerUnreachable)
    assert issubclass(errors.PEER_ERRORS[grpc.StatusCode.UNAUTHENTICATED], errors.PeerUnreachable)
    assert not issubclass(errors.PeerUnreachable, errors.CopyCorrupt)


class Agent(agent_pb2_grpc.AgentServicer):
    @answers
    def GetInfo(self, request: agent_pb2.GetInfoRequest, context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        raise errors.NodeCannot("node n-1 has no memory tier")

    @answers
    def ReadShard(self, request: agent_pb2.ReadShardRequest,
                  context: grpc.ServicerContext) -> Iterator[agent_pb2.ShardChunk]:
        yield agent_pb2.ShardChunk(name="state.pt", data=b"x")
        raise errors.CopyCorrupt(f"step {request.step} rank {request.rank}: state.pt: crc32c 00000000 read")

    @answers
    def GetRestoreTarget(self, request: checkpoint_pb2.GetRestoreTargetRequest,
                         context: grpc.ServicerContext) -> checkpoint_pb2.RestoreTarget:
        raise errors.Forwarded(grpc.StatusCode.NOT_FOUND, "job j has no restorable checkpoint")


@pytest.fixture
def stub() -> Iterator[agent_pb2_grpc.AgentStub]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    agent_pb2_grpc.add_AgentServicer_to_server(Agent(), server)
    port = rpc.add_port(server, "127.0.0.1:0")
    server.start()
    channel = rpc.channel(f"127.0.0.1:{port}")
    try:
        yield agent_pb2_grpc.AgentStub(channel)
    finally:
        channel.close()
        server.stop(0)


def test_the_service_answers_by_the_table(stub: agent_pb2_grpc.AgentStub) -> None:
    with pytest.raises(grpc.RpcError) as unary:
        stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=10)
    assert rpc.rpc_code(unary.value) is grpc.StatusCode.FAILED_PRECONDITION
    assert rpc.rpc_details(unary.value) == "node n-1 has no memory tier"

    chunks = stub.ReadShard(agent_pb2.ReadShardRequest(job="j", step=7, rank=1), timeout=10)
    assert next(chunks).name == "state.pt"
    with pytest.raises(grpc.RpcError) as stream:
        next(chunks)
    assert rpc.rpc_code(stream.value) is grpc.StatusCode.DATA_LOSS
    got = errors.peer_error(stream.value)
    assert isinstance(got, errors.CopyCorrupt) and "step 7 rank 1: state.pt" in str(got)

    with pytest.raises(grpc.RpcError) as forwarded:
        stub.GetRestoreTarget(checkpoint_pb2.GetRestoreTargetRequest(job="j"), timeout=10)
    assert rpc.rpc_code(forwarded.value) is grpc.StatusCode.NOT_FOUND
    assert rpc.rpc_details(forwarded.value) == "job j has no restorable checkpoint"


def test_a_status_outside_the_table_is_left_to_the_caller() -> None:
    assert errors.peer_error(ValueError("not a call")) is None
