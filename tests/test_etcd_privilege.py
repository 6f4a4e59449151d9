"""Issue 20's etcd and small findings on real processes: ``ftctl up`` (etcd with a 16 MiB quota, a
coordinator, 2 agents + a spare, mutual TLS) and node-1's own certificates in the attacker's hands.

* By default no certificate a node holds reaches etcd (only those carrying etcd's client name do: the
  coordinators' and the members'): node-1's node and rendezvous certificates, and the operator's, are refused
  in the TLS handshake for every call etcd 3.4 checks no permission on (granting, listing, renewing a lease,
  its time to live, disarming an alarm, compacting) and for a write under /torch/elastic/; the torchrun
  etcd-v3 handler says which certificate lacks the name and how to issue one with it.
* Opted in (``ftctl certs issue rendezvous node-1 --etcd-client``), node-1's rendezvous certificate writes
  only under /torch/elastic/, cannot revoke the leader's lease nor read ftd's keys (but lists and could renew
  it: etcd 3.4); its flood fills etcd (NOSPACE), and the leader cleans the run, compacts, defragments and
  disarms the alarm by itself: a node killed afterwards is fenced and replaced.
* A connection that never starts TLS is closed within seconds; the metrics server answers while 100 idle
  connections are open and closes them after its timeout; what ``ftctl up`` makes is the caller's alone.
The decisions themselves: tests/test_etcd_space.py; the certificates' names: tests/test_pki.py."""

from __future__ import annotations

import shutil
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
from ftd.ftctl import certs, drill
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.identity import IdentityFiles
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


@pytest.fixture(scope="module")
def opted_in(cluster: ClusterFile, tmp_path_factory: pytest.TempPathFactory) -> IdentityFiles:
    """node-1's rendezvous certificate as a cluster that opts in to torchrun's etcd-v3 rendezvous issues it
    (``ftctl certs issue ... --etcd-client``, the cluster's CA), in a directory of its own: the cluster's
    own certificates stay as ``ftctl up`` made them, whatever order the tests run in."""
    pki = tmp_path_factory.mktemp("etcd-v3-pki")
    for name in ("ca.crt", "ca.key"):
        shutil.copy2(Path(cluster.pki_dir) / name, pki / name)
    assert certs.main(["--pki-dir", str(pki), "issue", "rendezvous", "node-1", "--etcd-client"]) == 0
    return IdentityFiles(pki, "rendezvous", "node-1")


def own(cluster: ClusterFile, kind: str, name: str) -> IdentityFiles:
    files = cluster.identity(kind, name)
    assert files is not None
    return files


def channel(cluster: ClusterFile, files: IdentityFiles) -> grpc.Channel:
    return grpc.secure_channel(cluster.etcd_endpoints.split(",")[0], client_credentials(files))


def etcd_as(cluster: ClusterFile, files: IdentityFiles) -> Any:
    return make_client(cluster.etcd_endpoints, timeout_s=5, tls=EtcdTls.of_identity(files))


def leader_lease(cluster: ClusterFile) -> int:
    _, meta = etcd_as(cluster, own(cluster, "coordinator", "coordinator-0")).get(LEADER)
    assert meta is not None and meta.lease_id
    return int(meta.lease_id)


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()  # type: ignore[attr-defined,no-any-return]


def lease_leases(ch: grpc.Channel) -> Any:
    """etcd 3.4's ``LeaseLeases`` (list every lease), which pyetcd's protos lack: the raw reply."""
    return ch.unary_unary("/etcdserverpb.Lease/LeaseLeases", request_serializer=lambda raw: raw,
                          response_deserializer=lambda raw: raw)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def unchecked_calls(ch: grpc.Channel, lease: int) -> dict[str, Any]:
    """What etcd 3.4 checks no permission on (docs/security.md), plus a write under /torch/elastic/."""
    leases, maintenance, kv = rpc_pb2_grpc.LeaseStub(ch), rpc_pb2_grpc.MaintenanceStub(ch), rpc_pb2_grpc.KVStub(ch)
    return {
        "LeaseGrant": lambda: leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=3),
        "LeaseLeases": lambda: lease_leases(ch)(b"", timeout=3),
        "LeaseKeepAlive": lambda: list(leases.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]),
                                                             timeout=3)),
        "LeaseTimeToLive": lambda: leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease, keys=True),
                                                          timeout=3),
        "LeaseRevoke": lambda: leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=3),
        "Put /torch/elastic/": lambda: kv.Put(rpc_pb2.PutRequest(key=b"/torch/elastic/store/job/probe", value=b"1"),
                                              timeout=3),
        "Alarm disarm": lambda: maintenance.Alarm(rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.DEACTIVATE,
                                                                       alarm=rpc_pb2.NOSPACE), timeout=3),
        "Compact": lambda: kv.Compact(rpc_pb2.CompactionRequest(revision=1), timeout=3),
    }


def handshakes_refused(cluster: ClusterFile) -> int:
    """How often etcd refused a client certificate without its client name (its member log says why)."""
    log = Path(cluster.workdir) / "etcd" / "etcd0.log"
    return log.read_text(errors="replace").count("client certificate authentication failed")


def test_no_certificate_a_node_holds_reaches_etcd_by_default(cluster: ClusterFile) -> None:
    lease, refused = leader_lease(cluster), handshakes_refused(cluster)
    holders = (("node", "node-1"), ("rendezvous", "node-1"), ("operator", "operator"))
    for kind, name in holders:
        with channel(cluster, own(cluster, kind, name)) as ch:
            for what, call in unchecked_calls(ch, lease).items():
                assert code_of(call) is grpc.StatusCode.UNAVAILABLE, (kind, what)
    wait_for(lambda: handshakes_refused(cluster) >= refused + len(holders), 5,
             "etcd logs each certificate's refusal in the TLS handshake", interval_s=0.1)
    assert leader_lease(cluster) == lease  # the coordinator still reaches etcd; its lease is untouched


def test_the_etcd_v3_handler_names_the_certificate_etcd_would_refuse(cluster: ClusterFile) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError

    from ftd.training.etcd_v3 import create_handler

    params = RendezvousParameters(backend="etcd-v3", endpoint=cluster.etcd_endpoints, run_id="job", min_nodes=1,
                                  max_nodes=1, pki_dir=cluster.pki_dir, node_id="node-1")
    with pytest.raises(RendezvousStateError) as refused:
        create_handler(params)
    message = str(refused.value)
    assert str(own(cluster, "rendezvous", "node-1").cert_path) in message
    assert "ftctl certs rotate rendezvous node-1 --etcd-client" in message


def test_opted_in_node_1s_rendezvous_certificate_keeps_to_the_rendezvous_and_leaves_the_leader_alone(
        cluster: ClusterFile, opted_in: IdentityFiles) -> None:
    lease = leader_lease(cluster)
    rendezvous = etcd_as(cluster, opted_in)
    rendezvous.put("/torch/elastic/store/job/probe", "1")
    assert rendezvous.get("/torch/elastic/store/job/probe")[0] == b"1"
    for call in (lambda: rendezvous.get(LEADER), lambda: rendezvous.put("/ftd/local/world", "{}"),
                 lambda: rendezvous.put("/torch/other", "1"), lambda: rendezvous.delete_prefix("/ftd/")):
        assert code_of(call) is grpc.StatusCode.PERMISSION_DENIED
    with channel(cluster, opted_in) as ch:
        calls = unchecked_calls(ch, lease)
        # etcd revokes a lease only for a user who may write every key attached to it (the leader key).
        assert code_of(calls["LeaseRevoke"]) is grpc.StatusCode.PERMISSION_DENIED
        maintenance = rpc_pb2_grpc.MaintenanceStub(ch)
        assert code_of(lambda: maintenance.Defragment(rpc_pb2.DefragmentRequest(), timeout=10)) \
            is grpc.StatusCode.UNKNOWN  # "auth: permission denied": defragmenting is root's
        # What stays open to an opted-in rendezvous certificate on etcd 3.4 (docs/security.md): it lists
        # every lease, the leader's among them, and may grant its own.
        assert b"\x08" + varint(lease) in calls["LeaseLeases"]()
        granted = calls["LeaseGrant"]().ID
        rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=granted), timeout=3)
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
        cluster: ClusterFile, opted_in: IdentityFiles) -> None:
    rendezvous = etcd_as(cluster, opted_in)
    coordinator = etcd_as(cluster, own(cluster, "coordinator", "coordinator-0"))
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


def test_a_rerun_of_ftctl_up_gives_etcd_names_as_the_cluster_asks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run of ``ftctl up`` on an older workdir: coordinator certificates issued before etcd admitted
    clients by name get it (their hosts kept); a rendezvous certificate that an older ftctl gave it loses it
    unless the cluster opts in (``--etcd-v3-rendezvous``); a node's is left alone."""
    from ftd import ca
    from ftd.ftctl.etcd_server import renew_without_etcd_name
    from ftd.identity import load_certs, paths

    with monkeypatch.context() as old_ca:
        old_ca.setattr(ca, "ETCD_CLIENT_KINDS", ())  # coordinators without etcd's client name
        ca.bootstrap(tmp_path, "local", nodes=["node-0"], coordinators=["c0"])
    ca.rotate(tmp_path, "rendezvous", "node-0", etcd_client=True)  # as every ftctl before this change did
    node_before = (tmp_path / "nodes" / "node-0.crt").read_bytes()
    assert [p.parent.name for p in renew_without_etcd_name(tmp_path)] == ["coordinators"]
    assert renew_without_etcd_name(tmp_path) == []
    rendezvous = paths(tmp_path, "rendezvous", "node-0")[0]

    def reaches_etcd() -> bool:
        return ca.has_etcd_client_name(load_certs(rendezvous, "rendezvous certificate")[0])

    assert ca.bootstrap(tmp_path, "local", nodes=["node-0"], coordinators=["c0"]) == [rendezvous]
    assert not reaches_etcd()
    assert ca.bootstrap(tmp_path, "local", nodes=["node-0"], etcd_rendezvous=True) == [rendezvous]
    assert reaches_etcd()
    assert ca.bootstrap(tmp_path, "local", nodes=["node-0"], etcd_rendezvous=True) == []
    assert (tmp_path / "nodes" / "node-0.crt").read_bytes() == node_before
