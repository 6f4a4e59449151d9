"""Replication to the buddy over the bulk path: the holder announces a memory snapshot with a
one-time offer on its bulk port (``PullReplica``), the buddy pulls it into its memory tier, checks
every file and records its copy; the ``WriteShard`` stream stays the fallback. Two in-process agent
services on loopback, real gRPC, real sockets, real tmpfs-like directories."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from doubles import record_copy

from ftd import rpc
from ftd.agent import bulk_copy
from ftd.agent.errors import AgentError
from ftd.agent.memory_report import FILE as INVENTORY
from ftd.agent.peers import Buddy
from ftd.agent.replica_intake import caller_host
from ftd.agent.replicator import ReplicationMetrics, Replicator
from ftd.authz import authorize
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.catalog import CheckpointRecord
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.identity import Identity
from ftd.storage_backends.base import crc32c_hex
from ftd.storage_backends.tiers import LocalSpec, Tier, TierSpec, open_tier
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2

JOB = "job"
MiB = 1 << 20


def publish(tier: Tier, step: int, rank: int, payload: bytes) -> ShardManifest:
    staging = tier.backend.stage(shard_prefix(JOB, step, rank))
    staging.put_stream("state.pt", io.BytesIO(payload))
    files = (FileEntry("state.pt", len(payload), crc32c_hex(payload)),)
    manifest = ShardManifest(JOB, step, 1, rank, 1, "torch", files)
    staging.publish(MANIFEST, manifest.encode())
    return manifest


class FakeCatalog:
    def __init__(self) -> None:
        self.records: dict[int, CheckpointRecord] = {}

    def __call__(self, method: str, request: Any) -> Any:
        assert method == "RecordCopy", method
        return record_copy(self.records, request)


class Agent(agent_pb2_grpc.AgentServicer):
    """The two replication RPCs of an agent (agent/service.py answers them the same way)."""

    def __init__(self, replicator: Replicator, pulls: bool) -> None:
        self.replicator, self.pulls = replicator, pulls

    def WriteShard(self, request_iterator: Iterator[agent_pb2.WriteShardChunk],
                   context: grpc.ServicerContext) -> agent_pb2.WriteShardResponse:
        try:
            return self.replicator.receive(request_iterator)
        except AgentError as exc:
            context.abort(exc.code, str(exc))
        raise AssertionError("unreachable")

    def PullReplica(self, request: agent_pb2.PullReplicaRequest,
                    context: grpc.ServicerContext) -> agent_pb2.WriteShardResponse:
        if not self.pulls:  # an agent of before the bulk path: what gRPC answers for a method it lacks
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        try:
            return self.replicator.receive_pull(request, context.peer())
        except AgentError as exc:
            context.abort(exc.code, str(exc))
        raise AssertionError("unreachable")


class Node:
    def __init__(self, tmp: Path, name: str, catalog: FakeCatalog, buddy: list[str], capacity: int = 0,
                 bulk: bool = True, pulls: bool = True) -> None:
        self.name = name
        self.tier = open_tier(TierSpec("mem", name, LocalSpec(tmp / name / "mem", capacity)))
        self.metrics = ReplicationMetrics()
        self.bulk = bulk_copy.BulkServer("127.0.0.1") if bulk else None
        self.replicator = Replicator(self.tier, name, lambda: Buddy(buddy[0], "the test's", buddy[1]), rpc.channel,
                                     catalog, self.metrics, chunk_bytes=256 << 10, bulk=self.bulk,
                                     node_agent=lambda node: "")  # the caller's address is used
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        agent_pb2_grpc.add_AgentServicer_to_server(Agent(self.replicator, pulls), self.server)
        self.address = f"127.0.0.1:{rpc.add_port(self.server, '127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(0)
        if self.bulk is not None:
            self.bulk.close()


@pytest.fixture
def make_pair(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(**buddy_options: Any) -> tuple[Node, Node, FakeCatalog]:
        catalog = FakeCatalog()
        target: list[str] = ["b", ""]
        a = Node(tmp_path, "a", catalog, target)
        b = Node(tmp_path, "b", catalog, ["a", a.address], **buddy_options)
        target[1] = b.address
        made.extend((a, b))
        return a, b, catalog

    yield make
    for node in made:
        node.close()


def commit(catalog: FakeCatalog, node: Node, step: int, payload: bytes, rank: int = 0) -> None:
    m = publish(node.tier, step, rank, payload)
    catalog.records[step], _ = rules.commit_shard(catalog.records.get(step), m, "mem", node.name, 0.0)
    node.replicator.enqueue(JOB, step, rank)


def counted(metrics: ReplicationMetrics, path: str) -> float:
    return metrics.by_path.labels(path)._value.get()  # type: ignore[no-any-return]


PAYLOAD = bytes(range(256)) * (4096 * 3 + 11)  # 3 MiB and a bit: several records and a short one


def held_by(node: Any) -> list[tuple[int, int, str]]:
    """The replicas ``node``'s heartbeat announces: (step, rank, owner)."""
    return [(s.manifest.step, s.manifest.rank, s.owner) for s in node.replicator.inventory.report().snapshots
            if s.replica]


def test_the_buddy_pulls_the_snapshot_over_the_bulk_port_checked_and_recorded(make_pair: Any, tmp_path: Path) -> None:
    a, b, catalog = make_pair()
    commit(catalog, a, 10, PAYLOAD)
    assert a.replicator.replicate_once()
    held = tmp_path / "b" / "mem" / shard_prefix(JOB, 10, 0)
    assert (held / "state.pt").read_bytes() == PAYLOAD
    assert ShardManifest.decode("x", (held / MANIFEST).read_bytes()).step == 10
    assert held_by(b) == [(10, 0, "a")]  # recorded in b's memory report (soft state, no catalog RPC)
    assert counted(a.metrics, "bulk") == 1 and counted(a.metrics, "stream") == 0
    assert a.metrics.fallbacks._value.get() == 0 and b.metrics.received._value.get() == 1
    assert not a.bulk._offers, "an offer is single use: none is left behind"  # type: ignore[union-attr]
    # The keep rule holds on the bulk path too: a third snapshot replaces the oldest replica.
    for step in (11, 12):
        commit(catalog, a, step, PAYLOAD[:-step])
        a.replicator.replicate_once()
    assert b.tier.memory is not None and b.tier.memory.snapshots(JOB, 0) == [11, 12]
    assert counted(a.metrics, "bulk") == 3


@pytest.mark.parametrize("options", [{"pulls": False}, {"bulk": False}], ids=["older-agent", "bulk-off"])
def test_a_buddy_without_the_bulk_path_gets_the_stream(make_pair: Any, tmp_path: Path, options: Any) -> None:
    a, b, catalog = make_pair(**options)
    commit(catalog, a, 7, PAYLOAD)
    a.replicator.replicate_once()
    assert (tmp_path / "b" / "mem" / shard_prefix(JOB, 7, 0) / "state.pt").read_bytes() == PAYLOAD
    assert counted(a.metrics, "stream") == 1 and counted(a.metrics, "bulk") == 0
    assert a.metrics.fallbacks._value.get() == 1
    assert held_by(b) == [(7, 0, "a")]


def test_a_failed_pull_falls_back_to_the_stream_which_still_checks(make_pair: Any, tmp_path: Path) -> None:
    a, b, catalog = make_pair()
    commit(catalog, a, 3, PAYLOAD)
    # The holder's copy rots at rest after it was committed: the pull's CRC32C check fails on the
    # buddy (nothing published there), the holder falls back to the stream, whose sender-side check
    # refuses to send the rotten file whole: the replica never appears.
    shard = tmp_path / "a" / "mem" / shard_prefix(JOB, 3, 0) / "state.pt"
    shard.write_bytes(b"X" + PAYLOAD[1:])
    a.replicator.replicate_once()
    assert a.metrics.fallbacks._value.get() == 1
    assert not (tmp_path / "b" / "mem" / shard_prefix(JOB, 3, 0)).exists()
    assert held_by(b) == []
    assert counted(a.metrics, "bulk") == 0 and counted(a.metrics, "stream") == 0
    # A holder whose bulk port is gone (closed, or it cannot bind it) pushes on the stream.
    commit(catalog, a, 4, PAYLOAD)
    assert a.bulk is not None
    a.bulk.close()
    a.replicator.replicate_once()
    assert counted(a.metrics, "stream") == 1 and a.metrics.fallbacks._value.get() == 2
    assert (tmp_path / "b" / "mem" / shard_prefix(JOB, 4, 0) / "state.pt").read_bytes() == PAYLOAD


def test_the_buddys_budget_refuses_the_pull_without_a_fallback(make_pair: Any, tmp_path: Path) -> None:
    a, b, catalog = make_pair(capacity=2 * MiB)
    commit(catalog, a, 1, PAYLOAD)  # 3 MiB: over b's 2 MiB
    a.replicator.replicate_once()
    assert a.metrics.failures.labels("refused")._value.get() == 1
    assert a.metrics.fallbacks._value.get() == 0 and b.metrics.refused.labels("replica")._value.get() == 1
    assert not (tmp_path / "b" / "mem" / JOB).exists() or b.tier.memory.snapshots(JOB, 0) == []  # type: ignore[union-attr]


def test_an_announcement_is_checked_before_anything_is_pulled(make_pair: Any, tmp_path: Path) -> None:
    a, b, catalog = make_pair()
    m = publish(a.tier, 5, 0, PAYLOAD)
    catalog.records[5], _ = rules.commit_shard(None, m, "mem", "a", 0.0)
    assert a.bulk is not None
    files = bulk_copy.shard_files(a.tier.backend, JOB, 5, 0)
    port, offer = a.bulk.offer(files)
    listing = [checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in files]
    total = sum(f.size for f in files)

    def request(source: str = "a", **header: Any) -> agent_pb2.PullReplicaRequest:
        h = {"job": JOB, "step": 5, "rank": 0, "tier": "mem", "bytes": total, "source": "a", **header}
        return agent_pb2.PullReplicaRequest(source=source, header=agent_pb2.WriteShardHeader(**h),
                                            offer=agent_pb2.OpenShardResponse(port=port, transfer=offer.transfer,
                                                                              key=offer.key, files=listing))

    with pytest.raises(AgentError, match="not the announcing node"):
        b.replicator.receive_pull(request(source="c"), "ipv4:127.0.0.1:1")
    with pytest.raises(AgentError, match="the header declares"):
        b.replicator.receive_pull(request(bytes=total + 1), "ipv4:127.0.0.1:1")
    with pytest.raises(AgentError, match="memory tier"):
        b.replicator.receive_pull(request(tier="ssd"), "ipv4:127.0.0.1:1")
    assert not (tmp_path / "b" / "mem" / JOB).exists(), "nothing pulled, nothing made room for"
    got = b.replicator.receive_pull(request(), "ipv4:127.0.0.1:1")
    assert got.bytes == total and "pulled" in got.message
    with pytest.raises(AgentError, match="push it with WriteShard") as err:  # the offer was used once
        b.replicator.receive_pull(request(step=5), "ipv4:127.0.0.1:1")
    assert err.value.code is grpc.StatusCode.UNIMPLEMENTED
    # Only a node itself may announce its snapshots (the caller's certificate against `source`).
    node_b = Identity("node", "b", "c1")
    assert not authorize("/ftd.v1.Agent/PullReplica", node_b, {"source": "a"}).allowed
    assert authorize("/ftd.v1.Agent/PullReplica", node_b, {"source": "b"}).allowed


def test_the_callers_host_is_read_from_grpcs_peer_string() -> None:
    assert caller_host("ipv4:10.0.0.2:53122") == "10.0.0.2"
    assert caller_host("ipv6:[::1]:53122") == "::1"
    assert caller_host("unix:/run/ftd.sock") == ""


def test_the_bandwidth_cap_paces_the_bulk_path(make_pair: Any) -> None:
    a, _, catalog = make_pair()
    paced: list[int] = []
    a.replicator.bucket.rate = 1e12  # a cap that never waits: only the pacing is observed here
    original = a.replicator._pace
    a.replicator._pace = lambda n: (paced.append(n), original(n))[1]  # type: ignore[method-assign]
    commit(catalog, a, 2, PAYLOAD)
    a.replicator.replicate_once()
    assert sum(paced) == len(PAYLOAD) + len(publish_manifest_bytes(a, 2))
    assert counted(a.metrics, "bulk") == 1


def publish_manifest_bytes(node: Node, step: int) -> bytes:
    return (Path(node.tier.backend.root) / shard_prefix(JOB, step, 0) / MANIFEST).read_bytes()  # type: ignore[attr-defined]


BIG = bytes(range(256)) * (4096 * 36 + 5)  # 9 MiB: above the landing's MIN_FILE


def test_a_new_replica_lands_in_the_pages_of_the_one_it_replaces(make_pair: Any, tmp_path: Path) -> None:
    a, b, catalog = make_pair()
    for step in (1, 2, 3):
        commit(catalog, a, step, BIG[step:])
        a.replicator.replicate_once()
    assert b.metrics.reused._value.get() == 1  # step 3's state.pt went into step 1's pages
    assert b.tier.memory is not None and b.tier.memory.snapshots(JOB, 0) == [2, 3]
    assert (tmp_path / "b" / "mem" / shard_prefix(JOB, 3, 0) / "state.pt").read_bytes() == BIG[3:]
    hidden = [p for p in (tmp_path / "b" / "mem").rglob(".*") if p.name != INVENTORY]  # the node's own inventory
    assert hidden == [], "no trash, no slot left behind"
    steps = sorted(p.name for p in (tmp_path / "b" / "mem" / JOB).iterdir())
    assert steps == ["step-000000000002", "step-000000000003"], "the evicted step's folder went with it"
    assert counted(a.metrics, "bulk") == 3


def test_a_replica_someone_reads_is_never_overwritten(make_pair: Any, tmp_path: Path) -> None:
    """A reader (a spare pulling it, a local restore mapping it) holds the replica the keep rule
    evicts: its pages are not reused — the reader's bytes stay what it verified — and the new replica
    lands in fresh pages."""
    import mmap

    a, b, catalog = make_pair()
    for step in (1, 2):
        commit(catalog, a, step, BIG[step:])
        a.replicator.replicate_once()
    with open(tmp_path / "b" / "mem" / shard_prefix(JOB, 1, 0) / "state.pt", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        commit(catalog, a, 3, BIG[3:])
        a.replicator.replicate_once()
        assert b.metrics.reused._value.get() == 0
        assert mapped[:] == BIG[1:], "the reader's replica changed under it"
        assert (tmp_path / "b" / "mem" / shard_prefix(JOB, 3, 0) / "state.pt").read_bytes() == BIG[3:]
    finally:
        mapped.close()
