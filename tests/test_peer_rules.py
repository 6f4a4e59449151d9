"""The agent's data-plane rules (agent/peer_rules.py) and per-peer limits (agent/peer_limits.py) as pure
functions: who may read a shard and who may write a memory replica, in a node's view of the job; how
many streams and bytes a peer may hold, and which idle streams are cancelled; a refused replica leaves
nothing in the memory tier. No process, no sleep."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from ftd.agent import peer_limits, peer_rules
from ftd.agent.errors import PeerBusy, PeerDenied
from ftd.agent.peer_copy import serve_shard
from ftd.agent.replica_intake import receive_replica
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.identity import Identity
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.tiers import LocalSpec, TierSpec, open_tier
from ftd.v1 import agent_pb2, checkpoint_pb2, cluster_pb2

JOB = "train"


def node(name: str) -> Identity:
    return Identity("node", name, "local")


OPERATOR = Identity("operator", "operator", "local")
# node-0 holds rank 0, node-1 rank 1, node-2 is the spare; node-0 keeps node-1's replicas, node-1 node-0's.
VIEW = peer_rules.View(me="node-0", job=JOB, world=("node-0", "node-1"), buddy="node-1",
                       mirrors=frozenset({"node-1"}), registered=frozenset({"node-0", "node-1", "node-2"}),
                       registered_complete=True, ranks_per_node=1)


def read(caller: Identity | None, rank: int, world_size: int = 2, job: str = JOB,
         view: peer_rules.View = VIEW) -> peer_rules.Verdict:
    return peer_rules.may_read(view, caller, job, 7, rank, world_size)


def write(caller: Identity | None, rank: int, world_size: int = 2, job: str = JOB, source: str = "",
          view: peer_rules.View = VIEW) -> peer_rules.Verdict:
    return peer_rules.may_write(view, caller, job, 7, rank, world_size, source)


def test_a_shard_is_read_by_its_holder_the_buddy_of_its_holder_or_an_operator() -> None:
    assert read(node("node-1"), 1).allowed and read(node("node-1"), 1).rule == "holder"
    assert read(node("node-1"), 0).allowed and read(node("node-1"), 0).rule == "buddy"  # node-0's own rank
    assert read(OPERATOR, 0).allowed
    # a node that holds another rank, reading a rank held by a third node
    third = peer_rules.View(me="node-0", job=JOB, world=("node-0", "node-1", "node-2"), buddy="node-2",
                            mirrors=frozenset({"node-2"}), registered=frozenset({"node-0", "node-1", "node-2"}),
                            ranks_per_node=1)
    denied = read(node("node-1"), 2, world_size=3, view=third)
    assert not denied.allowed and denied.rule == "shard_reader"
    assert "node node-1 may not read train step 7 rank 2 on node node-0: rank 2 is held by node-2" in denied.reason


def test_a_promoted_spare_reads_the_rank_it_now_holds_and_nothing_else() -> None:
    promoted = peer_rules.View(me="node-1", job=JOB, world=("node-2", "node-1"), buddy="node-2",
                               mirrors=frozenset({"node-2"}), registered=frozenset({"node-1", "node-2"}),
                               ranks_per_node=1)
    assert read(node("node-2"), 0, view=promoted).allowed
    before = peer_rules.View(me="node-1", job=JOB, world=("node-0", "node-1"), buddy="node-0",
                             mirrors=frozenset({"node-0"}), registered=frozenset({"node-0", "node-1", "node-2"}),
                             ranks_per_node=1)
    verdict = read(node("node-2"), 0, view=before)  # still a spare: it holds no rank
    assert not verdict.allowed and verdict.rule == "shard_reader" and "holds no rank" in verdict.reason


def test_a_world_of_another_size_reads_every_old_rank_to_reshard() -> None:
    grown = peer_rules.View(me="node-0", job=JOB, world=("node-0", "node-1", "node-2"), buddy="node-1",
                            mirrors=frozenset({"node-2"}), registered=frozenset({"node-0", "node-1", "node-2"}),
                            ranks_per_node=1)
    assert read(node("node-2"), 0, world_size=2, view=grown).rule == "reshard"  # 2 does not fit 3 nodes
    shrunk = peer_rules.View(me="node-0", job=JOB, world=("node-0", "node-1"), buddy="node-1",
                             mirrors=frozenset({"node-1"}), registered=frozenset({"node-0", "node-1"}),
                             ranks_per_node=1)
    assert read(node("node-1"), 0, world_size=4, view=shrunk).rule == "reshard"  # 4 fits 2 nodes, not 1 each
    # without the ranks per node (no launcher here) a size that fits is read as the same layout
    unknown = peer_rules.View(**{**shrunk.__dict__, "ranks_per_node": 0, "buddy": ""})
    assert read(node("node-1"), 0, world_size=4, view=unknown).rule == "shard_reader"


def test_strangers_other_kinds_and_other_jobs_are_refused_naming_the_rule() -> None:
    for caller in (None, Identity("rendezvous", "node-1", "local"), node("node-9")):
        verdict = read(caller, 1)
        assert not verdict.allowed and verdict.rule == "data_peer", verdict
        assert "rule data_peer" in verdict.reason
    other = read(node("node-1"), 1, job="made-up")
    assert not other.allowed and other.rule == "current_job" and "current job is train" in other.reason
    unmanaged = peer_rules.View(**{**VIEW.__dict__, "unmanaged": True})
    assert read(node("node-2"), 0, job="made-up", view=unmanaged).allowed  # a registered node
    assert not read(node("node-9"), 0, job="made-up", view=unmanaged).allowed


def test_a_replica_comes_only_from_the_node_whose_buddy_this_is_of_a_rank_it_holds() -> None:
    assert write(node("node-1"), 1).allowed
    unsized = write(node("node-1"), 1, world_size=0)  # an older sender: the rank's holder cannot be told
    assert not unsized.allowed and "names no world size" in unsized.reason
    own = write(node("node-1"), 0)  # node-0's own rank: would evict node-0's own snapshots
    assert not own.allowed and own.rule == "replica_source" and "rank 0 is held by node-0" in own.reason
    spare = write(node("node-2"), 1)
    assert not spare.allowed and spare.rule == "replica_source" and "keeps the replicas of node-1" in spare.reason
    assert write(node("node-1"), 1, source="node-2").rule == "replica_source"
    assert not write(OPERATOR, 1).allowed
    assert write(node("node-1"), 1, job="made-up").rule == "current_job"
    unmanaged = peer_rules.View(**{**VIEW.__dict__, "unmanaged": True})
    assert write(node("node-1"), 0, job="made-up", view=unmanaged).allowed
    assert not write(node("node-2"), 0, job="made-up", view=unmanaged).allowed


def test_a_replica_naming_another_world_size_cannot_land_on_one_of_this_nodes_own_ranks() -> None:
    """Two ranks per node: node-0 holds ranks 0 and 1. A replica's path carries no world size, so
    node-1 claiming rank 1 of a 2-rank world (whose holder would be node-1) would land on node-0's own
    rank 1; only the current world's size is accepted when the launcher's ranks per node are known."""
    view = peer_rules.View(**{**VIEW.__dict__, "ranks_per_node": 2})
    assert write(node("node-1"), 3, world_size=4, view=view).allowed
    assert not write(node("node-1"), 1, world_size=4, view=view).allowed  # node-0's own rank
    claimed = write(node("node-1"), 1, world_size=2, view=view)
    assert not claimed.allowed and claimed.rule == "replica_source"
    assert "names a 2-rank world, the job's current world has 4 ranks" in claimed.reason
    unknown = peer_rules.View(**{**VIEW.__dict__, "ranks_per_node": 0})  # not known: the holder rule alone
    assert write(node("node-1"), 1, world_size=2, view=unknown).allowed


def test_the_view_comes_from_the_assignment() -> None:
    assignment = cluster_pb2.Assignment(epoch=3, rank=0, world_size=2, world=["node-0", "node-1"], job=JOB,
                                        unmanaged_jobs=True)
    assignment.peers.CopyFrom(cluster_pb2.Peers(buddy="node-1", mirrors=["node-1"], complete=True, addresses=[
        cluster_pb2.PeerAddress(node_id="node-1", agent_address="h:1", rank=1),
        cluster_pb2.PeerAddress(node_id="node-2", agent_address="h:2", rank=-1)]))
    view = peer_rules.view_of("node-0", assignment, 2)
    assert view == peer_rules.View("node-0", JOB, ("node-0", "node-1"), "node-1", frozenset({"node-1"}),
                                   frozenset({"node-0", "node-1", "node-2"}), True, True, 2)
    del assignment.world[:]  # above 256 ranks: the world from the listed ranks
    assert peer_rules.view_of("node-0", assignment).world == ("node-0", "node-1")
    assert peer_rules.holder(("a", "b"), 4, 3) == "b" and peer_rules.holder(("a", "b"), 3, 0) is None


LIMITS = peer_limits.Limits(max_streams=2, max_bytes=100, idle_timeout_s=5.0)


def test_admission_names_the_peer_and_the_limit() -> None:
    assert peer_limits.admission("node/node-1", 1, 0, 0, LIMITS, True) is None
    why = peer_limits.admission("node/node-1", 2, 0, 0, LIMITS, True)
    assert why is not None and "peer node/node-1" in why and "limit is 2 (peer_max_streams)" in why
    why = peer_limits.admission("node/node-1", 1, 60, 50, LIMITS, False)
    assert why is not None and "110 bytes" in why and "peer_max_inflight_mb" in why
    assert peer_limits.admission("node/node-1", 2, 60, 40, LIMITS, False) is None


def test_the_limiter_counts_streams_and_bytes_per_peer_and_cancels_idle_ones() -> None:
    now = [100.0]
    limiter = peer_limits.PeerLimiter(LIMITS, clock=lambda: now[0])
    cancelled: list[str] = []
    a = limiter.admit("node/node-1", "WriteShard", lambda: cancelled.append("a"))
    b = limiter.admit("node/node-1", "WriteShard", lambda: cancelled.append("b"))
    with pytest.raises(PeerBusy, match="peer node/node-1 has 2 shard streams"):
        limiter.admit("node/node-1", "WriteShard")
    other = limiter.admit("node/node-2", "ReadShard")  # another peer is not held back
    a.reserve(80)
    with pytest.raises(PeerBusy, match="120 bytes"):
        b.reserve(40)
    now[0] += 4.0
    b.touch()
    now[0] += 2.0  # a idle 6 s, b 2 s
    assert limiter.reap() == [a] and cancelled == ["a"]
    assert limiter.reap() == []  # once
    a.release()
    a.release()  # idempotent
    assert limiter.streams("node/node-1") == 1
    with limiter.admit("node/node-1", "ReadShard") as c:
        c.reserve(100)
    assert limiter.streams("node/node-1") == 1 and limiter.streams("node/node-2") == 1
    other.release()
    limiter.close()


class Refused(grpc.RpcError):
    """The catalog's answer to a RecordCopy it refuses."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "node b may not record the copy (rule copy_owner)"


def test_a_replica_refused_by_the_rule_or_the_catalog_leaves_nothing(tmp_path: Path) -> None:
    """The intake's two refusals on a real memory tier: the sender's rule on the manifest (the header
    named no world size), and the catalog refusing to record the copy: nothing stays published."""
    source = LocalBackend(tmp_path / "src")
    staging = source.stage(shard_prefix(JOB, 3, 1))
    got = staging.put_stream("state.pt", io.BytesIO(b"weights"))
    staging.publish(MANIFEST, ShardManifest(JOB, 3, 1, 1, 2, "torch", (FileEntry("state.pt", 7, got.crc32c or ""),))
                    .encode())
    mem = open_tier(TierSpec("mem", "b", LocalSpec(tmp_path / "mem", 0)))
    size = sum(i.size for i in source.list(shard_prefix(JOB, 3, 1) + "/"))
    header = agent_pb2.WriteShardHeader(job=JOB, step=3, rank=1, tier="mem", bytes=size, source="a")

    def messages() -> Iterator[agent_pb2.WriteShardChunk]:
        yield agent_pb2.WriteShardChunk(header=header)
        for chunk in serve_shard(source, JOB, 3, 1):
            yield agent_pb2.WriteShardChunk(chunk=chunk)

    seen: list[tuple[int, bool]] = []

    def rule(h: agent_pb2.WriteShardHeader, world_size: int, landed: bool) -> None:
        seen.append((world_size, landed))
        if landed:
            raise PeerDenied("rank 1 is held by c (rule replica_source)")

    with pytest.raises(PeerDenied, match="replica_source"):
        receive_replica(messages(), mem, "b", lambda req, owner: None, check=rule)
    assert seen == [(0, False), (2, True)]
    assert not mem.backend.is_published(shard_prefix(JOB, 3, 1), MANIFEST)

    def refuse(req: checkpoint_pb2.RecordCopyRequest, owner: str) -> None:
        raise Refused()

    with pytest.raises(PeerDenied, match="the catalog refused"):
        receive_replica(messages(), mem, "b", refuse)
    assert not mem.backend.is_published(shard_prefix(JOB, 3, 1), MANIFEST)
    assert not [p for p in (tmp_path / "mem").rglob("*") if p.is_file()]
