"""Issue 20's etcd and small findings on real processes: ``ftctl up`` (etcd with a 16 MiB quota, a
coordinator, 2 agents + a spare, mutual TLS) and node-1's own certificates in the attacker's hands.

* Only certificates that carry etcd's client name (coordinators, rendezvous handlers, members) reach etcd:
  node-1's node certificate and the operator's cannot grant, list, renew or revoke a lease, nor read the
  leader key (etcd 3.4 checks no permission on those: docs/security.md).
* node-1's rendezvous certificate writes only under /torch/elastic/, cannot revoke the leader's lease nor
  read ftd's keys; its flood fills etcd (NOSPACE), and the leader cleans the run, compacts, defragments and
  disarms the alarm by itself: a node killed afterwards is fenced and replaced.
* A connection that never starts TLS is closed within seconds; the metrics server answers while 100 idle
  connections are open and closes them after its timeout; what ``ftctl up`` makes is the caller's alone.
The decisions themselves: tests/test_etcd_space.py."""

from __future__ import annotations

import socket
import stat
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from doubles import closed_within
from pyetcd.etcdrpc import rpc_pb2, rpc_pb2_grpc

from ftd import metrics_http
from ftd.etcd_client import EtcdTls, make_client
from ftd.ftctl import drill
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.rpc import client_credentials
from ftd.waiting import wait_for

QUOTA = 16 * 1024**2
BUDGET = 1024**2
LEADER = "/ftd/local/leader"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("etcd-privilege") / "cluster", nodes=2, spares=1, etcd_quota_bytes=QUOTA,
                 extra_coordinator_args=["--rendezvous-budget-bytes", str(BUDGET)])
    try:
        yield started
    finally:
        stop(started)


def channel(cluster: ClusterFile, kind: str, name: str) -> grpc.Channel:
    files = cluster.identity(kind, name)
    assert files is not None
    return grpc.secure_channel(cluster.etcd_endpoints.split(",")[0], client_credentials(files))


def etcd_as(cluster: ClusterFile, kind: str, name: str) -> Any:
    files = cluster.identity(kind, name)
    assert files is not None
    return make_client(cluster.etcd_endpoints, timeout_s=5, tls=EtcdTls.of_identity(files))


def leader_lease(cluster: ClusterFile) -> int:
    _, meta = etcd_as(cluster, "coordinator", "coordinator-0").get(LEADER)
    assert meta is not None and meta.lease_id
    return int(meta.lease_id)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()  # type: ignore[attr-defined,no-any-return]


def test_node_and_operator_certificates_do_not_reach_etcd(cluster: ClusterFile) -> None:
    lease = leader_lease(cluster)
    for kind, name in (("node", "node-1"), ("operator", "operator")):
        with channel(cluster, kind, name) as ch:
            leases, maintenance = rpc_pb2_grpc.LeaseStub(ch), rpc_pb2_grpc.MaintenanceStub(ch)
            calls = [lambda: leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=3),  # noqa: B023
                     lambda: leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=3),  # noqa: B023
                     lambda: leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease, keys=True),  # noqa: B023
                                                    timeout=3),
                     lambda: list(leases.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]),  # noqa: B023
                                                        timeout=3)),
                     lambda: maintenance.Alarm(rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.DEACTIVATE,  # noqa: B023
                                                                    alarm=rpc_pb2.NOSPACE), timeout=3)]
            for call in calls:  # refused in the TLS handshake: the certificate lacks etcd's client name
                assert code_of(call) is grpc.StatusCode.UNAVAILABLE
    assert leader_lease(cluster) == lease  # the leader's lease is untouched


def test_node_1s_rendezvous_certificate_keeps_to_the_rendezvous_and_leaves_the_leader_alone(
        cluster: ClusterFile) -> None:
    lease = leader_lease(cluster)
    rendezvous = etcd_as(cluster, "rendezvous", "node-1")
    rendezvous.put("/torch/elastic/store/job/probe", "1")
    assert rendezvous.get("/torch/elastic/store/job/probe")[0] == b"1"
    for call in (lambda: rendezvous.get(LEADER), lambda: rendezvous.put("/ftd/local/world", "{}"),
                 lambda: rendezvous.put("/torch/other", "1"), lambda: rendezvous.delete_prefix("/ftd/")):
        assert code_of(call) is grpc.StatusCode.PERMISSION_DENIED
    with channel(cluster, "rendezvous", "node-1") as ch:
        leases = rpc_pb2_grpc.LeaseStub(ch)
        # etcd revokes a lease only for a user who may write every key attached to it (the leader key).
        assert code_of(lambda: leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=3)) \
            is grpc.StatusCode.PERMISSION_DENIED
        maintenance = rpc_pb2_grpc.MaintenanceStub(ch)
        assert code_of(lambda: maintenance.Defragment(rpc_pb2.DefragmentRequest(), timeout=10)) \
            is grpc.StatusCode.UNKNOWN  # "auth: permission denied": defragmenting is root's
    assert leader_lease(cluster) == lease


def test_connections_that_never_start_tls_are_dropped_within_seconds(cluster: ClusterFile) -> None:
    host, port = cluster.coordinator_endpoints.split(",")[0].rsplit(":", 1)
    agent = cluster.agents[0].info["address"].rsplit(":", 1)
    started = time.monotonic()
    idle = [socket.create_connection((host, int(port)), timeout=2),
            socket.create_connection((agent[0], int(agent[1])), timeout=2)]
    try:
        assert all(closed_within(s, 9.0) for s in idle)
        assert time.monotonic() - started < 9.0  # grpc.server_handshake_timeout_ms: 5 s (was 120 s)
    finally:
        for s in idle:
            s.close()


def test_the_metrics_server_answers_beside_100_idle_connections_and_closes_them(cluster: ClusterFile) -> None:
    host, port = cluster.coordinators[0].info["metrics"].rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=2) for _ in range(100)]
    try:
        opened = time.monotonic()
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=3) as resp:
            assert resp.status == 200 and b"ftd_coordinator_epoch" in resp.read()
        assert all(closed_within(s, metrics_http.TIMEOUT_S + 3) for s in idle)
        assert time.monotonic() - opened < metrics_http.TIMEOUT_S + 3
    finally:
        for s in idle:
            s.close()


def test_ftctl_up_and_the_daemons_make_files_only_their_owner_reads(cluster: ClusterFile) -> None:
    workdir = Path(cluster.workdir)
    shared = [p for p in [workdir, *workdir.rglob("*")]
              if not p.is_symlink() and p.suffix != ".crt" and stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert shared == []
    assert stat.S_IMODE((workdir / "cluster.json").stat().st_mode) == 0o600
    for proc in [*cluster.coordinators, *cluster.agents]:
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft, hard = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3:5]
        assert soft == hard, (proc.name, soft, hard)


def test_a_rendezvous_flood_that_fills_etcd_is_cleaned_and_a_killed_node_is_still_replaced(
        cluster: ClusterFile) -> None:
    rendezvous = etcd_as(cluster, "rendezvous", "node-1")
    coordinator = etcd_as(cluster, "coordinator", "coordinator-0")
    value, written = b"x" * (1024 * 1024), 0
    with pytest.raises(grpc.RpcError) as full:
        for i in range(64):  # 64 MiB: four quotas
            rendezvous.put(f"/torch/elastic/store/flood/{i}", value)
            written += 1
    assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert "database space exceeded" in (full.value.details() or "")  # type: ignore[attr-defined]

    def recovered() -> bool:
        flood = list(coordinator.get_prefix("/torch/elastic/store/flood/", keys_only=True))
        return not list(coordinator.list_alarms()) and not flood

    wait_for(recovered, 20, "the leader cleans the flood, compacts, defragments and disarms NOSPACE", interval_s=0.2)
    assert int(coordinator.status().db_size) < 0.8 * QUOTA
    assert written >= 4
    client = cluster.client()
    try:
        def recorded() -> list[str]:
            return [e.message for e in client.events(50).events
                    if e.kind == "etcd_space" and "/torch/elastic/store/flood/" in e.message
                    and "NOSPACE disarmed" in e.message]

        wait_for(recorded, 10, "the leader's etcd_space event naming the run it cleaned", interval_s=0.2)
        result = drill.run(client, "node-0", mode="node", target_detect_s=3.0, timeout_s=30.0)
    finally:
        client.close()
    assert result.passed, result.verdict
    assert result.replacement == "node-2"


def test_certificates_issued_before_etcd_admitted_clients_by_name_are_renewed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run of ``ftctl up`` on an older workdir: its coordinator and rendezvous certificates lack the
    name etcd now admits clients by, and get new ones (their hosts kept); a node's is left alone."""
    from ftd import ca
    from ftd.ftctl.etcd_server import renew_without_etcd_name

    with monkeypatch.context() as old_ca:
        old_ca.setattr(ca, "ETCD_CLIENT_KINDS", ())
        ca.bootstrap(tmp_path, "local", nodes=["node-0"], coordinators=["c0"])
    node_before = (tmp_path / "nodes" / "node-0.crt").read_bytes()
    assert sorted(p.parent.name for p in renew_without_etcd_name(tmp_path)) == ["coordinators", "rendezvous"]
    assert renew_without_etcd_name(tmp_path) == []
    assert (tmp_path / "nodes" / "node-0.crt").read_bytes() == node_before
