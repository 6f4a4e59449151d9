"""etcd faults: losing 1 of 3 members disrupts nothing; losing all of them for 20 s makes the
coordinator hold every decision (no death, no epoch change) and resume normal service afterwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pyetcd
import pytest

from chaos_tests.faults import EtcdMemberKill, EtcdOutage, injected
from chaos_tests.observe import watch
from ftd.client import CoordinatorClient
from ftd.coordinator.etcd_store import EtcdStore
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def raft_leader_index(etcd: EtcdCluster) -> int:
    m = etcd.members[0]
    client = pyetcd.client(host="127.0.0.1", port=m.client_port, timeout=2)
    try:
        leader_name = client.status().leader.name
    finally:
        client.close()
    return next(i for i, member in enumerate(etcd.members) if member.name == leader_name)


def promote_after_kill(cluster: ClusterFile, client: CoordinatorClient) -> None:
    """Normal service: a SIGKILLed active node is replaced by the spare in a new epoch."""
    before = client.status(deadline_s=15)
    victim = next(a for a in cluster.agents if a.name in before.world)
    os.kill(victim.pid, signal.SIGKILL)
    after = wait_for(lambda: (s := client.status()).epoch == before.epoch + 1 and s, 15, "promotion after kill")
    assert victim.name not in after.world and len(after.world) == len(before.world)


def test_sigkill_of_one_etcd_member_disrupts_nothing(tmp_path: Path, etcd3: EtcdCluster) -> None:
    cluster = up(tmp_path / "c", nodes=2, spares=1, etcd_endpoints=etcd3.endpoints)
    client = CoordinatorClient(cluster.coordinator_endpoints, timeout_s=2.0)
    try:
        epoch = client.status().epoch
        with injected(EtcdMemberKill(etcd3, raft_leader_index(etcd3))):
            seen = watch(cluster, seconds=6.0)
            assert seen.status_failed == 0 and seen.longest_gap_s < 1.5, seen
            assert seen.dead_seen == set() and seen.epochs_seen == {epoch}
            # Writes still commit with two members left.
            promote_after_kill(cluster, client)
    finally:
        client.close()
        stop(cluster)


def test_all_etcd_members_down_for_20s_holds_every_decision(tmp_path: Path, etcd3: EtcdCluster) -> None:
    cluster = up(tmp_path / "c", nodes=2, spares=1, etcd_endpoints=etcd3.endpoints)
    client = CoordinatorClient(cluster.coordinator_endpoints, timeout_s=2.0)
    try:
        epoch = client.status().epoch
        with injected(EtcdOutage(etcd3)):
            seen = watch(cluster, seconds=20.0, query_coordinator=False)
        # While etcd was gone no agent was fenced and no epoch changed.
        assert seen.fenced_agents == set() and seen.epochs_seen == {epoch}, seen

        # Normal service once etcd is back: the leader confirms its lease and every node is alive.
        status = wait_for(lambda: client.status(deadline_s=1.0), 20, "coordinator serving again")
        assert status.epoch == epoch and not status.dead and status.etcd_reachable
        wait_for(lambda: all(n.state == 1 for n in client.nodes().nodes), 15, "all nodes alive again")
        store = EtcdStore(etcd3.endpoints, cluster="local")
        try:
            snap = store.load()
            assert snap.world.epoch == epoch and all(n.fence is None for n in snap.nodes.values())
            assert not [e for e in store.list_events(100) if e.kind == "node_dead"]
        finally:
            store.close()
        promote_after_kill(cluster, client)
    finally:
        client.close()
        stop(cluster)
