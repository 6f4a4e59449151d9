"""Buddies on real processes: etcd, a coordinator and three agents over mTLS (``ftctl up``). The
coordinator chooses each node's buddy and sends it, with the peers' agent addresses, in the node's
assignment; when the buddy dies the node is told its new one, though the world does not change."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ftd import rpc
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd


def told(cluster: ClusterFile, node_id: str) -> cluster_pb2.Assignment:
    """The assignment as the node's agent holds it (GetInfo, as the cluster's operator)."""
    agent = next(a for a in cluster.agents if a.name == node_id)
    with rpc.channel(agent.info["address"], tls=cluster.operator) as channel:
        info = agent_pb2_grpc.AgentStub(channel).GetInfo(agent_pb2.GetInfoRequest(), timeout=5)
    return info.assignment


def told_buddy(cluster: ClusterFile, node_id: str, buddy: str) -> cluster_pb2.Assignment | None:
    """The node's assignment once it names ``buddy``, else None."""
    assignment = told(cluster, node_id)
    return assignment if assignment.peers.buddy == buddy else None


def test_the_assignment_carries_the_buddy_and_the_next_one_when_it_dies(tmp_path: Path) -> None:
    # node-0 (rack r0) holds the only rank; spares node-1 (r1) and node-2 (r0). node-0's buddy is node-1,
    # the next node in another rack; once node-1 is dead, every other node is in r0: node-2.
    cluster = up(tmp_path / "cluster", nodes=1, spares=2, racks=2)
    client = cluster.client()
    try:
        first = wait_for(lambda: told_buddy(cluster, "node-0", "node-1"), 20, "node-0 told its buddy node-1")
        assert first.peers.buddy_reason == "node-1 is the next node in another rack (r1, not r0)"
        addresses = {p.node_id: p.agent_address for p in first.peers.addresses}
        assert set(addresses) == {"node-0", "node-1", "node-2"} and first.peers.complete
        assert addresses["node-1"] == next(a.info["address"] for a in cluster.agents if a.name == "node-1")
        assert told(cluster, "node-2").peers.buddy == "node-1"
        epoch = client.status().epoch

        os.kill(next(a.pid for a in cluster.agents if a.name == "node-1"), signal.SIGKILL)
        after = wait_for(lambda: told_buddy(cluster, "node-0", "node-2"), 20, "node-0 told its new buddy node-2")
        assert "every other node is in rack r0" in after.peers.buddy_reason
        assert {p.node_id for p in after.peers.addresses} == {"node-0", "node-2"}
        assert told(cluster, "node-2").peers.buddy == "node-0"
        assert client.status().epoch == epoch, "a dead spare changes no world: the buddy alone was pushed"
    finally:
        client.close()
        stop(cluster)
