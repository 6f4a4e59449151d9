"""Issue 20's data-plane findings on real processes: ``ftctl up`` (etcd, a coordinator, node-0, node-1 and
node-2, mutual TLS), a job whose round the three joined, and node-1's own certificate in the attacker's
hands. The buddies go round by node id (node-0's replicas to node-1, node-1's to node-2, node-2's to
node-0), so node-2 is the victim node-1 has no business with: node-1 cannot read node-2's shard of a
rank it does not hold (``ReadShard``, ``OpenShard``, the bulk port), no node but node-0's assigned
source writes a replica into node-0's memory, none writes another node's own rank, and nothing of a
refused replica stays; idle streams of one peer are refused beyond its limit while the victim's own
Unix-socket calls answer at once. The rules themselves: tests/test_peer_rules.py."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_attacks import as_node, code, details, refused
from test_insider_catalog import join

from ftd import rpc
from ftd.ca import issue
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.storage_backends.local import LocalBackend
from ftd.v1 import agent_pb2, agent_pb2_grpc
from ftd.waiting import wait_for

JOB = "victim"
IDLE_S = 3.0  # the agents' peer_idle_timeout_s here (30 s by default)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("insider-agent") / "cluster", nodes=3, spares=0,
                 extra_agent_args=["--peer-idle-timeout-s", str(IDLE_S), "--peer-view-grace-s", "0.3"])
    try:
        yield started
    finally:
        stop(started)


def info(cluster: ClusterFile, node_id: str) -> dict[str, Any]:
    found: dict[str, Any] = next(a for a in cluster.agents if a.name == node_id).info
    return found


def stub(cluster: ClusterFile, as_id: str, to: str = "node-2") -> agent_pb2_grpc.AgentStub:
    """node ``to``'s agent, dialled with node ``as_id``'s own certificate."""
    return agent_pb2_grpc.AgentStub(rpc.channel(info(cluster, to)["address"], tls=cluster.identity("node", as_id)))


def plant(root: Path, rank: int, step: int, data: bytes, epoch: int) -> None:
    """A published shard of JOB (a world of 3 ranks) on a directory tier, as a save leaves it."""
    staging = LocalBackend(root).stage(shard_prefix(JOB, step, rank))
    got = staging.put_stream("state.pt", io.BytesIO(data))
    manifest = ShardManifest(JOB, step, epoch, rank, 3, "torch", (FileEntry("state.pt", len(data), got.crc32c or ""),))
    staging.publish(MANIFEST, manifest.encode())


class World:
    """The job's round (node-0, node-1, node-2) and, on node-2's SSD, step 10 of its rank and of
    node-1's: ``victim`` is node-2's rank, ``own`` node-1's; ``rank0`` node-0's."""

    def __init__(self, cluster: ClusterFile) -> None:
        clients = {n: as_node(cluster, n) for n in ("node-0", "node-1", "node-2")}
        try:
            joined = {n: join(c, n) for n, c in clients.items()}
        finally:
            for c in clients.values():
                c.close()
        self.victim, self.own = int(joined["node-2"].rank), int(joined["node-1"].rank)
        self.rank0, self.epoch = int(joined["node-0"].rank), int(joined["node-2"].epoch)
        self.ssd = Path(info(cluster, "node-2")["workdir"]) / "ssd"
        self.mem = {n: Path(info(cluster, n)["workdir"]) / "mem" for n in clients}
        plant(self.ssd, self.victim, 10, b"node-2's weights", self.epoch)
        plant(self.ssd, self.own, 10, b"node-1's weights", self.epoch)
        # node-2's agent knows the job once its assignment names it: node-1 then reads its own rank
        wait_for(lambda: b"".join(c.data for c in stub(cluster, "node-1").ReadShard(
            agent_pb2.ReadShardRequest(job=JOB, step=10, rank=self.own, tier="ssd"), timeout=5)),
                 30, "node-2 serving node-1 its own rank")


@pytest.fixture(scope="module")
def world(cluster: ClusterFile) -> World:
    return World(cluster)


def denied(err: grpc.RpcError, rule: str) -> None:
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and f"rule {rule}" in details(err), details(err)


def test_a_node_cannot_read_another_nodes_rank_by_any_path(cluster: ClusterFile, world: World) -> None:
    node1 = stub(cluster, "node-1")
    request = agent_pb2.ReadShardRequest(job=JOB, step=10, rank=world.victim, tier="ssd")
    err = refused(lambda: list(node1.ReadShard(request, timeout=10)))
    denied(err, "shard_reader")
    assert f"rank {world.victim} is held by node-2" in details(err)
    denied(refused(node1.OpenShard, request, timeout=10), "shard_reader")
    # a node certificate the coordinator never registered is nobody
    issue(Path(cluster.pki_dir), "node", "node-9")
    denied(refused(lambda: list(stub(cluster, "node-9").ReadShard(request, timeout=10))), "data_peer")
    # the bulk port sends an offer only to the transfer id the mTLS answer gave: node-1's own rank
    own = node1.OpenShard(agent_pb2.ReadShardRequest(job=JOB, step=10, rank=world.own, tier="ssd"), timeout=10)
    host = info(cluster, "node-2")["address"].rpartition(":")[0]
    for transfer, sent in ((os.urandom(16), 0), (own.transfer, sum(f.size for f in own.files) + 16 * len(own.files))):
        with socket.create_connection((host, own.port), timeout=10) as conn:
            conn.sendall(transfer)
            got = b""
            while chunk := conn.recv(1 << 16):
                got += chunk
        assert len(got) == sent  # a made-up id: nothing; the offer: each file's records with their tags


def test_only_the_assigned_source_writes_a_replica_and_nothing_refused_stays(cluster: ClusterFile,
                                                                              world: World) -> None:
    def push(to: str, rank: int) -> grpc.RpcError:
        data = b"forged weights"
        messages = [agent_pb2.WriteShardChunk(header=agent_pb2.WriteShardHeader(
            job=JOB, step=999_999, rank=rank, tier="mem", bytes=len(data), source="node-1", world_size=3)),
            agent_pb2.WriteShardChunk(chunk=agent_pb2.ShardChunk(name="state.pt", data=data))]
        return refused(stub(cluster, "node-1", to).WriteShard, iter(messages), timeout=10)

    # node-0 keeps node-2's replicas, not node-1's: node-1 is not its source
    err = push("node-0", world.own)
    denied(err, "replica_source")
    assert "node-0 keeps the replicas of node-2" in details(err)
    # node-2 keeps node-1's replicas, of node-1's rank: never of node-2's own (they would evict its snapshots)
    err = push("node-2", world.victim)
    denied(err, "replica_source")
    assert f"rank {world.victim} is held by node-2" in details(err)
    for root in world.mem.values():
        assert not [p for p in root.rglob("*") if "999999" in p.name], sorted(root.rglob("*"))


def test_idle_streams_of_one_peer_are_bounded_and_the_local_socket_answers(cluster: ClusterFile,
                                                                           world: World) -> None:
    node1 = stub(cluster, "node-1")
    release = threading.Event()

    def idle() -> Iterator[agent_pb2.WriteShardChunk]:
        release.wait(60)  # sends nothing: the stream holds its slot until the idle deadline
        return
        yield  # a generator

    calls = [node1.WriteShard.future(idle(), timeout=60) for _ in range(10)]
    try:
        busy = wait_for(lambda: [c for c in calls if c.done()] if sum(c.done() for c in calls) >= 2 else None,
                        15, "two of ten idle streams refused")
        for call in busy:
            err = call.exception()
            assert code(err) is grpc.StatusCode.RESOURCE_EXHAUSTED, details(err)
            assert "peer node/node-1 has 8 shard streams" in details(err) and "peer_max_streams" in details(err)
        local = agent_pb2_grpc.AgentStub(grpc.insecure_channel(f"unix:{info(cluster, 'node-0')['socket']}"))
        started = time.monotonic()
        tiers = local.GetTiers(agent_pb2.GetTiersRequest(), timeout=2)
        answered = time.monotonic() - started
        assert tiers.tiers and answered < 1.0, answered
        # the idle deadline frees the slots: every held stream is cancelled by node-0
        wait_for(lambda: all(c.done() for c in calls), IDLE_S + 10, "the idle streams cancelled")
        assert sum(code(c.exception()) is grpc.StatusCode.CANCELLED for c in calls) == 8
    finally:
        release.set()
    got = b"".join(c.data for c in node1.ReadShard(
        agent_pb2.ReadShardRequest(job=JOB, step=10, rank=world.own, tier="ssd"), timeout=10))
    assert b"node-1's weights" in got
