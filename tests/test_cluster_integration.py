"""The control plane as real processes: etcd on free loopback ports, a coordinator and agents over
gRPC sockets. register → heartbeat → kill -9 → dead within bound → spare promoted into the dead
node's rank → epoch + 1 in etcd; the fenced node comes back only as a spare. Everything over mTLS,
as ``ftctl up`` runs it: the tests dial as the cluster's operator, or as a node where a node must call
(tests/test_security_e2e.py checks the refusals)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from ftd import rpc
from ftd.ca import issue
from ftd.client import CoordinatorClient
from ftd.coordinator.etcd_store import EtcdStore
from ftd.etcd_client import EtcdTls, using_tls
from ftd.ftctl.localcluster import ClusterFile, spawn_agent, wait_agent
from ftd.identity import IdentityFiles
from ftd.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd


def agent_pid(cluster: ClusterFile, node_id: str) -> int:
    return next(a.pid for a in cluster.agents if a.name == node_id)


def state_of(client: CoordinatorClient, node_id: str) -> int:
    return next(n.state for n in client.nodes().nodes if n.node_id == node_id)


def identity(cluster: ClusterFile, kind: str, name: str) -> IdentityFiles:
    files = cluster.identity(kind, name)
    assert files is not None
    return files


def etcd_store(cluster: ClusterFile) -> EtcdStore:
    """The cluster's state in etcd, read as a coordinator (etcd's auth lets only those read /ftd/)."""
    with using_tls(EtcdTls.of_identity(identity(cluster, "coordinator", "coordinator-0"))):
        return EtcdStore(cluster.etcd_endpoints, cluster="local")


def formed_status(client: CoordinatorClient) -> coordinator_pb2.ClusterStatus:
    """The status once both actives hold a rank: admitted in one commit or two, in either order."""
    return wait_for(lambda: sorted((s := client.status()).world) == ["node-0", "node-1"] and s, 10, "world formed")


def test_kill_active_agent_spare_takes_its_rank_and_fenced_node_returns_as_spare(local_cluster: ClusterFile) -> None:
    client = local_cluster.client()
    store = etcd_store(local_cluster)
    try:
        before = store.load()
        assert sorted(before.world.ranks) == ["node-0", "node-1"]
        assert set(before.nodes) == {"node-0", "node-1", "node-2"}
        victim_rank = before.world.rank_of("node-0")
        expected = tuple("node-2" if n == "node-0" else n for n in before.world.ranks)
        # Heartbeats flow: every node is alive and reports the current epoch.
        wait_for(lambda: all(n.state == cluster_pb2.NODE_STATE_ALIVE and n.epoch == before.world.epoch
                             for n in client.nodes().nodes), 5, "all nodes heartbeating in the current epoch")

        os.kill(agent_pid(local_cluster, "node-0"), signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: state_of(client, "node-0") in (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED),
                 10, "node-0 declared dead")
        detected = time.monotonic() - killed
        assert detected < 5.0, f"detection took {detected:.2f}s"  # generous; bench/detection.py measures p99

        after = wait_for(lambda: (s := store.load()).world.epoch == before.world.epoch + 1 and s, 10, "epoch + 1")
        assert after.world.ranks == expected, "the spare must take the dead node's rank"
        fence = after.nodes["node-0"].fence
        assert fence is not None and fence.epoch == after.world.epoch and "dead_after" in fence.reason
        status = client.status()
        assert status.epoch == after.world.epoch and list(status.dead) == ["node-0"]

        # The promoted spare learns its new rank within a heartbeat.
        spare = next(a for a in local_cluster.agents if a.name == "node-2")
        with rpc.channel(spare.info["address"], tls=local_cluster.operator) as ch:
            info = wait_for(lambda: (i := agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest()))
                            .assignment.epoch == after.world.epoch and i, 2, "node-2 learns the new epoch")
        assert info.assignment.rank == victim_rank and info.assignment.role == cluster_pb2.ROLE_ACTIVE
        assert tuple(info.assignment.world) == expected

        # node-0's agent comes back asking to be active: it may only be a spare of the current epoch.
        proc, _, _ = spawn_agent(local_cluster, "node-0", "active")
        wait_agent(local_cluster, "node-0", proc)
        wait_for(lambda: "node-0" in client.status().spares, 10, "node-0 back as a spare")
        final = store.load()
        assert final.world.ranks == expected and final.world.epoch == after.world.epoch
        assert final.nodes["node-0"].fence is None and final.nodes["node-0"].requested_role.value == "spare"
    finally:
        client.close()
        store.close()


def test_world_shrinks_without_spare_and_status_says_so(local_cluster: ClusterFile) -> None:
    client = local_cluster.client()
    try:
        # The actives may have been admitted in one commit or two: compare with the epoch found.
        formed = formed_status(client)
        os.kill(agent_pid(local_cluster, "node-2"), signal.SIGKILL)  # the only spare
        wait_for(lambda: "node-2" in client.status().dead, 10, "spare declared dead")
        assert client.status().epoch == formed.epoch, "a dead spare does not change the world"
        os.kill(agent_pid(local_cluster, "node-1"), signal.SIGKILL)
        status = wait_for(lambda: (s := client.status()).epoch == formed.epoch + 1 and s, 10, "the next epoch")
        assert list(status.world) == ["node-0"] and status.degraded
        assert "1 of 2 ranks" in status.degraded_reason
        assert "no spare" in status.last_change_reason
    finally:
        client.close()


def test_bad_input_gets_precise_grpc_errors(local_cluster: ClusterFile) -> None:
    """Authorization first (a node acts only as itself), then the request's own checks."""
    client = local_cluster.client()
    pki_dir = Path(local_cluster.pki_dir)
    for name in ("ghost-7", "n9"):
        issue(pki_dir, "node", name)  # certificates of nodes the coordinator has never seen
    channels = {name: rpc.channel(local_cluster.coordinator_endpoints.split(",")[0],
                                  tls=identity(local_cluster, "node", name))
                for name in ("ghost-7", "n9", "node-1")}
    stubs = {name: coordinator_pb2_grpc.CoordinatorStub(ch) for name, ch in channels.items()}
    try:
        formed = formed_status(client)

        def heartbeat_error(stub: coordinator_pb2_grpc.CoordinatorStub,
                            req: coordinator_pb2.HeartbeatRequest) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Heartbeat(iter([req]), timeout=5))
            return err.value

        err = heartbeat_error(stubs["ghost-7"], coordinator_pb2.HeartbeatRequest(node_id="ghost-7", incarnation="x"))
        assert err.code() is grpc.StatusCode.NOT_FOUND and "ghost-7" in err.details()
        err = heartbeat_error(stubs["ghost-7"], coordinator_pb2.HeartbeatRequest(node_id="../x", incarnation="x"))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED and "node/ghost-7 may not Heartbeat as '../x'" in \
            err.details()

        existing = next(n for n in client.nodes().nodes if n.node_id == "node-1")
        with pytest.raises(grpc.RpcError) as conflict:
            stubs["node-1"].Register(coordinator_pb2.RegisterRequest(
                node_id="node-1", host="10.9.9.9", role=cluster_pb2.ROLE_ACTIVE, incarnation="other",
                agent_address="10.9.9.9:1"), timeout=5)
        assert conflict.value.code() is grpc.StatusCode.ALREADY_EXISTS
        assert "node-1" in conflict.value.details() and existing.host in conflict.value.details()

        with pytest.raises(grpc.RpcError) as bad:  # no node_id: not the caller's own
            stubs["n9"].Register(coordinator_pb2.RegisterRequest(host="h", role=1, incarnation="i"), timeout=5)
        assert bad.value.code() is grpc.StatusCode.PERMISSION_DENIED
        for field, req in [
            ("host", coordinator_pb2.RegisterRequest(node_id="n9", role=1, incarnation="i")),
            ("role", coordinator_pb2.RegisterRequest(node_id="n9", host="h", incarnation="i")),
            ("agent_address", coordinator_pb2.RegisterRequest(node_id="n9", host="h", role=2, incarnation="i",
                                                              agent_address="no-port")),
        ]:
            with pytest.raises(grpc.RpcError) as bad:
                stubs["n9"].Register(req, timeout=5)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert bad.value.details().startswith(field), bad.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            client.stub().ListEvents(coordinator_pb2.ListEventsRequest(limit=99999), timeout=5)
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "limit" in bad.value.details()
        # Nothing valid was lost on the way.
        assert {n.node_id for n in client.nodes().nodes} == {"node-0", "node-1", "node-2"}
        assert client.status().epoch == formed.epoch
    finally:
        client.close()
        for ch in channels.values():
            ch.close()


def test_agent_endpoint_progress_and_kill_authorisation(local_cluster: ClusterFile) -> None:
    client = local_cluster.client()
    agent = next(a for a in local_cluster.agents if a.name == "node-1")
    try:
        # The training side reports progress over the agent's Unix socket; it reaches the coordinator.
        with grpc.insecure_channel(f"unix:{agent.info['socket']}") as ch:
            resp = agent_pb2_grpc.AgentStub(ch).ReportProgress(
                agent_pb2.ReportProgressRequest(progress=cluster_pb2.Progress(step=42, loss=1.5)), timeout=5)
            assert resp.assignment.rank == list(client.status().world).index("node-1")
            with pytest.raises(grpc.RpcError) as bad:
                agent_pb2_grpc.AgentStub(ch).ReportProgress(agent_pb2.ReportProgressRequest(), timeout=5)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        wait_for(lambda: next(n for n in client.nodes().nodes if n.node_id == "node-1").progress.step == 42, 3,
                 "step 42 visible at the coordinator")
        node = next(n for n in client.nodes().nodes if n.node_id == "node-1")
        assert {d.tier for d in node.health.disks} == {"ssd", "hdd"}
        assert all(d.free_bytes > 0 for d in node.health.disks)
        assert not node.health.HasField("gpu")  # no NVML here: absent, not "0 GPUs"

        # Kill is for operators: another node's certificate is refused, whatever token it sends.
        with rpc.channel(agent.info["address"], tls=identity(local_cluster, "node", "node-0")) as ch:
            stub = agent_pb2_grpc.AgentStub(ch)
            with pytest.raises(grpc.RpcError) as denied:
                stub.Kill(agent_pb2.KillRequest(), timeout=5, metadata=(("authorization", "Bearer wrong"),))
            assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "rule: only operators" in denied.value.details()
            assert stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id == "node-1", "agent must survive"
    finally:
        client.close()


def test_metrics_endpoints(local_cluster: ClusterFile) -> None:
    def scrape(address: str) -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    client = local_cluster.client()
    try:
        epoch = formed_status(client).epoch
    finally:
        client.close()

    # Gauges are refreshed once a second and on every change.
    def published() -> str | None:
        text = scrape(local_cluster.coordinators[0].info["metrics"])
        return text if 'ftd_coordinator_nodes{state="alive"} 3.0' in text else None

    coordinator = wait_for(published, 5, "gauges published")
    for name in ("ftd_coordinator_nodes{state=\"alive\"} 3.0", "ftd_coordinator_heartbeats_received_total",
                 "ftd_coordinator_detection_latency_seconds_bucket", f"ftd_coordinator_epoch {epoch}.0",
                 "ftd_coordinator_is_leader 1.0", "ftd_coordinator_etcd_errors_total",
                 "ftd_coordinator_etcd_writes_total"):
        assert name in coordinator, name
    def agent_epoch() -> str | None:
        text = scrape(local_cluster.agents[0].info["metrics"])
        return text if f"ftd_agent_epoch {epoch}.0" in text else None

    agent = wait_for(agent_epoch, 5, "the agent acting on the current epoch")
    for name in ("ftd_agent_heartbeats_sent_total", "ftd_agent_connected 1.0",
                 'ftd_agent_disk_free_bytes{tier="ssd"}'):
        assert name in agent, name
