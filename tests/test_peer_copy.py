"""The peer copy path over real gRPC on loopback: a shard streamed from one agent's tier to another
directory, verified; unreachable, missing and corrupt copies told apart."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from ftd import rpc
from ftd.agent.errors import CopyCorrupt, CopyMissing, PeerCopyError, PeerUnreachable
from ftd.agent.peer_copy import fetch_shard, receive_shard, serve_shard
from ftd.checkpoints.layout import MANIFEST, shard_prefix
from ftd.storage_backends.base import StorageBackend, crc32c_hex
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.tiers import LocalSpec, TierSpec, open_backend
from ftd.v1 import agent_pb2, agent_pb2_grpc

PAYLOAD = os.urandom(3 * (1 << 20) + 12345)  # several chunks and a partial one


class Peer(agent_pb2_grpc.AgentServicer):
    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend

    def ReadShard(self, request: agent_pb2.ReadShardRequest,
                  context: grpc.ServicerContext) -> Iterator[agent_pb2.ShardChunk]:
        try:
            yield from serve_shard(self.backend, request.job, request.step, request.rank)
        except CopyMissing as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[tuple[str, StorageBackend, grpc.Server]]:
    backend = open_backend(TierSpec("ssd", "node-1", LocalSpec(tmp_path / "ssd")))
    staging = backend.stage(shard_prefix("job", 7, 1))
    staging.put_stream("state.pt", io.BytesIO(PAYLOAD))
    staging.publish(MANIFEST, b'{"manifest": true}')  # the receiver checks the files, against the catalog
    server = grpc.server(futures.ThreadPoolExecutor(4))
    agent_pb2_grpc.add_AgentServicer_to_server(Peer(backend), server)
    port = rpc.add_port(server, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", backend, server
    finally:
        server.stop(0)


def read(address: str) -> tuple[grpc.Channel, object]:
    channel = rpc.channel(address)
    stub = agent_pb2_grpc.AgentStub(channel)
    return channel, lambda req: stub.ReadShard(req, timeout=10)


def test_a_shard_arrives_verified(peer: tuple[str, StorageBackend, grpc.Server], tmp_path: Path) -> None:
    channel, call = read(peer[0])
    with channel:
        got = fetch_shard(call, agent_pb2.ReadShardRequest(job="job", step=7, rank=1, tier="ssd"),  # type: ignore[arg-type]
                          LocalBackend(tmp_path / "in"), {"state.pt": (len(PAYLOAD), crc32c_hex(PAYLOAD))})
    assert got.path == tmp_path / "in" / shard_prefix("job", 7, 1), "laid out as on any tier"
    assert (got.path / "state.pt").read_bytes() == PAYLOAD and (got.path / MANIFEST).exists()
    assert got.bytes >= len(PAYLOAD) and not list((tmp_path / "in").rglob(".*"))


def test_a_copy_that_does_not_match_the_catalog_is_corrupt(peer: tuple[str, StorageBackend, grpc.Server],
                                                          tmp_path: Path) -> None:
    channel, call = read(peer[0])
    with channel, pytest.raises(CopyCorrupt, match=r"the catalog says \d+ bytes crc32c 00000000"):
        fetch_shard(call, agent_pb2.ReadShardRequest(job="job", step=7, rank=1, tier="ssd"),  # type: ignore[arg-type]
                    LocalBackend(tmp_path / "in"), {"state.pt": (len(PAYLOAD), "00000000")})
    assert not [p for p in (tmp_path / "in").rglob("*") if p.is_file()], "nothing half-received is left to be loaded"


def test_missing_and_unreachable_are_not_corrupt(peer: tuple[str, StorageBackend, grpc.Server],
                                                 tmp_path: Path) -> None:
    address, _, server = peer
    channel, call = read(address)
    with channel:
        with pytest.raises(CopyMissing, match="no published copy"):
            fetch_shard(call, agent_pb2.ReadShardRequest(job="job", step=8, rank=1, tier="ssd"),  # type: ignore[arg-type]
                        LocalBackend(tmp_path / "in"))
        server.stop(0).wait(5)
        with pytest.raises(PeerUnreachable):
            fetch_shard(call, agent_pb2.ReadShardRequest(job="job", step=7, rank=1, tier="ssd"),  # type: ignore[arg-type]
                        LocalBackend(tmp_path / "in"))
    assert not issubclass(PeerUnreachable, CopyCorrupt) and issubclass(PeerUnreachable, PeerCopyError)


def test_a_stream_that_lies_is_refused(tmp_path: Path) -> None:
    chunks = [agent_pb2.ShardChunk(name="../evil", size=3, data=b"abc", end_of_file=True, crc32c=crc32c_hex(b"abc"))]
    with pytest.raises(CopyCorrupt, match="refusing the file name"):
        receive_shard(chunks, LocalBackend(tmp_path / "a"), shard_prefix("job", 1, 0))
    flipped = [agent_pb2.ShardChunk(name="x", size=3, data=b"abd", end_of_file=True, crc32c=crc32c_hex(b"abc"))]
    with pytest.raises(CopyCorrupt, match="sender read"):
        receive_shard(flipped, LocalBackend(tmp_path / "b"), shard_prefix("job", 1, 0))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused stream leaves nothing behind"
