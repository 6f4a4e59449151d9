"""Secure by default, on real processes: ``ftctl up`` (etcd, a coordinator, 2 active + 1 spare agents)
with its PKI in ``DIR/pki``. What docs/security.md promises, checked from the outside: plaintext and
certificate-less clients are refused by the coordinator, the agents and etcd; a node's certificate acts
only as that node (denials are PERMISSION_DENIED naming the identity and the rule, counted, and change
nothing); operators read and run drills; the training side's RPCs exist only on the agent's 0600 Unix
socket; no drill token exists anywhere; certificates rotate while the cluster runs.

One cluster for the module; the tests that change it (rotation, the drill) come last."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyetcd.exceptions
import pytest
from cryptography import x509

from ftd import rpc
from ftd.ca import rotate, serial_of
from ftd.etcd_client import EtcdTls, make_client
from ftd.ftctl import drill
from ftd.ftctl.cli import main
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.identity import IdentityFiles, TlsMaterial
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    # opted in to torchrun's etcd-v3 rendezvous (its tests below); the default, where no certificate a node
    # holds reaches etcd, is tests/test_etcd_privilege.py's
    c = up(tmp_path_factory.mktemp("secure") / "cluster", nodes=2, spares=1, etcd_v3_rendezvous=True)
    try:
        yield c
    finally:
        stop(c)


def ids(cluster: ClusterFile, kind: str, name: str) -> IdentityFiles:
    files = cluster.identity(kind, name)
    assert files is not None, "ftctl up must create a PKI"
    return files


def coordinator(cluster: ClusterFile) -> str:
    return cluster.coordinators[0].info["address"]


def agent(cluster: ClusterFile, node_id: str) -> Any:
    return next(a for a in cluster.agents if a.name == node_id)


def coordinator_stub(cluster: ClusterFile, kind: str, name: str) -> tuple[grpc.Channel, Any]:
    ch = rpc.channel(coordinator(cluster), tls=ids(cluster, kind, name))
    return ch, coordinator_pb2_grpc.CoordinatorStub(ch)


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def denied(metrics: dict[str, float], prefix: str, method: str, rule: str) -> float:
    return metrics.get(f'{prefix}_rpc_denied_total{{method="{method}",rule="{rule}"}}', 0.0)


def heartbeats_sent(cluster: ClusterFile, node_id: str) -> float:
    """Signs of life sent: stream heartbeats and liveness beacons (which carry the liveness when on)."""
    metrics = scrape(agent(cluster, node_id).info["metrics"])
    return metrics["ftd_agent_heartbeats_sent_total"] + metrics.get("ftd_agent_beacons_sent_total", 0.0)


def wait_heartbeats(cluster: ClusterFile, node_ids: list[str], n: int, timeout_s: float = 15.0) -> None:
    """Waits until each node sent ``n`` more heartbeats: the coordinator had every chance to act on
    what came before (a forced death, a re-registration, a dropped stream) and to show it."""
    start = {node: heartbeats_sent(cluster, node) for node in node_ids}
    wait_for(lambda: all(heartbeats_sent(cluster, node) - start[node] >= n for node in node_ids), timeout_s,
             f"{n} more heartbeats from {node_ids}")


def nodes_seen(cluster: ClusterFile) -> dict[str, coordinator_pb2.NodeInfo]:
    client = cluster.client()
    try:
        return {n.node_id: n for n in client.nodes().nodes}
    finally:
        client.close()


def served_serial(address: str, client: TlsMaterial) -> int:
    """The serial of the certificate a server presents on a new connection (Python's ssl, h2)."""
    host, port = rpc.parse_hostport(address)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=client.ca_pem.decode())
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "c.crt", Path(tmp) / "c.key"
        cert.write_bytes(client.cert_pem)
        key.write_bytes(client.key_pem)
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


# ---- the coordinator -----------------------------------------------------------------------------


def test_plaintext_call_to_the_coordinator_fails(cluster: ClusterFile) -> None:
    with grpc.insecure_channel(coordinator(cluster)) as ch, pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5)
    assert rpc.rpc_code(caught.value) is grpc.StatusCode.UNAVAILABLE


def test_tls_call_without_a_client_certificate_fails(cluster: ClusterFile) -> None:
    ca = ids(cluster, "operator", "operator").ca_path.read_bytes()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)  # verifies the server, presents nothing
    with grpc.secure_channel(coordinator(cluster), creds) as ch, pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5)
    assert rpc.rpc_code(caught.value) is grpc.StatusCode.UNAVAILABLE


def test_operator_certificate_can_call_get_status(cluster: ClusterFile) -> None:
    ch, stub = coordinator_stub(cluster, "operator", "operator")
    with ch:
        status = stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5)
    assert sorted(status.world) == ["node-0", "node-1"] and list(status.spares) == ["node-2"]


def test_a_node_certificate_acts_only_as_its_node(cluster: ClusterFile) -> None:
    """``nodes/node-1.crt``: a Register as node-0 or a ReportHang about node-0 is PERMISSION_DENIED
    naming the identity and the rule, counted in the metric, and changes nothing."""
    metrics_address = cluster.coordinators[0].info["metrics"]
    before_metrics = scrape(metrics_address)
    before = nodes_seen(cluster)["node-0"]
    client = cluster.client()
    try:
        status_before = client.status()
        events_before = len(client.events(1000).events)
    finally:
        client.close()

    ch, stub = coordinator_stub(cluster, "node", "node-1")
    with ch:
        with pytest.raises(grpc.RpcError) as register:
            stub.Register(coordinator_pb2.RegisterRequest(
                node_id="node-0", host="10.6.6.6", role=cluster_pb2.ROLE_ACTIVE, incarnation="evil",
                agent_address="10.6.6.6:1", pid=1), timeout=5)
        with pytest.raises(grpc.RpcError) as hang:
            stub.ReportHang(coordinator_pb2.ReportHangRequest(job="train", node_id="node-0", culprit=True,
                                                              reason="framed"), timeout=5)
        # what node-1 may do: read
        assert stub.GetStatus(coordinator_pb2.GetStatusRequest(), timeout=5).epoch == status_before.epoch

    assert rpc.rpc_code(register.value) is grpc.StatusCode.PERMISSION_DENIED
    assert rpc.rpc_details(register.value) == ("node/node-1 may not Register as 'node-0' (node_id) "
                                               "(rule: nodes act only as themselves)")
    assert rpc.rpc_code(hang.value) is grpc.StatusCode.PERMISSION_DENIED
    assert rpc.rpc_details(hang.value).startswith("node/node-1 may not ReportHang as 'node-0' (node_id)")

    wait_heartbeats(cluster, ["node-0"], 3)  # a forced death or a re-registration would show by now
    after = nodes_seen(cluster)["node-0"]
    assert after.state == cluster_pb2.NODE_STATE_ALIVE
    assert (after.host, after.agent_address, after.pid) == (before.host, before.agent_address, before.pid)
    client = cluster.client()
    try:
        status_after = client.status()
        assert (status_after.epoch, list(status_after.world), list(status_after.dead)) == (
            status_before.epoch, list(status_before.world), [])
        assert len(client.events(1000).events) == events_before
    finally:
        client.close()
    metrics = scrape(metrics_address)
    for method in ("Coordinator/Register", "Coordinator/ReportHang"):
        assert denied(metrics, "ftd_coordinator", method, "node_self") == \
            denied(before_metrics, "ftd_coordinator", method, "node_self") + 1


def test_rendezvous_certificate_joins_rounds_only_as_its_node_and_rank0_publishes(cluster: ClusterFile) -> None:
    """The facts the table needs come from the leader's view: the round's rank 0 and its registered host."""
    world = list(nodes_seen(cluster))  # registered nodes
    assert "node-0" in world
    client = cluster.client()
    try:
        ranks = list(client.status().world)
    finally:
        client.close()
    rank0, other = ranks[0], ranks[1]
    job = "security-e2e"
    ch0, as_rank0 = coordinator_stub(cluster, "rendezvous", rank0)
    ch1, as_other = coordinator_stub(cluster, "rendezvous", other)
    with ch0, ch1:
        info = as_other.JoinRound(coordinator_pb2.JoinRoundRequest(job=job, node_id=other, last_round=-1,
                                                                   min_nodes=2, max_nodes=2), timeout=5)
        assert info.status == coordinator_pb2.RoundInfo.READY and info.rank == 1
        with pytest.raises(grpc.RpcError) as as_someone_else:
            as_other.JoinRound(coordinator_pb2.JoinRoundRequest(job=job, node_id=rank0, last_round=-1), timeout=5)
        assert rpc.rpc_code(as_someone_else.value) is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as not_rank0:
            as_other.SetRoundStore(coordinator_pb2.SetRoundStoreRequest(
                job=job, round=info.round, node_id=other, address="127.0.0.1:5555"), timeout=5)
        assert rpc.rpc_code(not_rank0.value) is grpc.StatusCode.PERMISSION_DENIED
        assert f"rank 0 is '{rank0}'" in rpc.rpc_details(not_rank0.value)
        with pytest.raises(grpc.RpcError) as elsewhere:
            as_rank0.SetRoundStore(coordinator_pb2.SetRoundStoreRequest(
                job=job, round=info.round, node_id=rank0, address="10.9.9.9:5555"), timeout=5)
        assert "it registered from '127.0.0.1'" in rpc.rpc_details(elsewhere.value)
        published = as_rank0.SetRoundStore(coordinator_pb2.SetRoundStoreRequest(
            job=job, round=info.round, node_id=rank0, address="127.0.0.1:5555"), timeout=5)
        assert published.store_address == "127.0.0.1:5555"
        with pytest.raises(grpc.RpcError) as register:
            as_rank0.Register(coordinator_pb2.RegisterRequest(node_id=rank0), timeout=5)
        assert f"rendezvous/{rank0} may not call Register" in rpc.rpc_details(register.value)
        with pytest.raises(grpc.RpcError) as close:
            as_rank0.CloseJob(coordinator_pb2.CloseJobRequest(job=job), timeout=5)
        assert rpc.rpc_code(close.value) is grpc.StatusCode.PERMISSION_DENIED
        assert as_rank0.GetRound(coordinator_pb2.GetRoundRequest(job=job), timeout=5).status != \
            coordinator_pb2.RoundInfo.CLOSED
    ch, as_operator = coordinator_stub(cluster, "operator", "operator")
    with ch:  # only an operator closes a job
        closed = as_operator.CloseJob(coordinator_pb2.CloseJobRequest(job=job, reason="e2e done"), timeout=5)
    assert closed.status == coordinator_pb2.RoundInfo.CLOSED


def test_the_coordinator_refuses_to_start_with_a_certificate_of_another_cluster(cluster: ClusterFile) -> None:
    proc = subprocess.run([sys.executable, "-m", "ftd.coordinator.main", "--pki-dir", cluster.pki_dir,
                           "--replica-id", "coordinator-0", "--cluster", "elsewhere", "--listen", "127.0.0.1:0",
                           "--metrics-listen", "", "--etcd-endpoints", cluster.etcd_endpoints],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "is of cluster 'local', but this coordinator serves cluster 'elsewhere'" in proc.stderr


# ---- the agents ----------------------------------------------------------------------------------


def test_the_agent_tcp_port_serves_only_authenticated_peers_and_operators(cluster: ClusterFile) -> None:
    node1 = agent(cluster, "node-1")
    metrics_before = scrape(node1.info["metrics"])
    with grpc.insecure_channel(node1.info["address"]) as ch, pytest.raises(grpc.RpcError) as plaintext:
        agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=5)
    assert rpc.rpc_code(plaintext.value) is grpc.StatusCode.UNAVAILABLE

    with rpc.channel(node1.info["address"], tls=ids(cluster, "operator", "operator")) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        assert stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id == "node-1"
        # the training side's RPCs are not served over TCP, not even to an operator
        with pytest.raises(grpc.RpcError) as progress:
            stub.ReportProgress(agent_pb2.ReportProgressRequest(progress=cluster_pb2.Progress(step=7)), timeout=5)
        assert rpc.rpc_code(progress.value) is grpc.StatusCode.PERMISSION_DENIED
        assert "operator/operator may not call ReportProgress (rule: only the training process" in \
            rpc.rpc_details(progress.value)
        # an operator's Kill is authorised (this one finds no training worker to kill)
        with pytest.raises(grpc.RpcError) as nothing:
            stub.Kill(agent_pb2.KillRequest(mode=agent_pb2.KillRequest.WORKER), timeout=5)
        assert rpc.rpc_code(nothing.value) is grpc.StatusCode.FAILED_PRECONDITION
        assert "runs no training worker" in rpc.rpc_details(nothing.value)

    with rpc.channel(node1.info["address"], tls=ids(cluster, "node", "node-0")) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        assert stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id == "node-1"  # peers may read
        with pytest.raises(grpc.RpcError) as kill:
            stub.Kill(agent_pb2.KillRequest(mode=agent_pb2.KillRequest.NODE, reason="a peer"), timeout=5)
    assert rpc.rpc_code(kill.value) is grpc.StatusCode.PERMISSION_DENIED
    assert rpc.rpc_details(kill.value).startswith("node/node-0 may not call Kill (rule: only operators")

    metrics = scrape(node1.info["metrics"])
    assert denied(metrics, "ftd_agent", "Agent/Kill", "operator_only") == \
        denied(metrics_before, "ftd_agent", "Agent/Kill", "operator_only") + 1
    assert denied(metrics, "ftd_agent", "Agent/ReportProgress", "local_only") == \
        denied(metrics_before, "ftd_agent", "Agent/ReportProgress", "local_only") + 1
    assert nodes_seen(cluster)["node-1"].state == cluster_pb2.NODE_STATE_ALIVE, "the agent must survive"


def test_the_training_side_uses_the_owner_only_unix_socket(cluster: ClusterFile) -> None:
    node1 = agent(cluster, "node-1")
    sock = Path(node1.info["socket"])
    assert sock.stat().st_mode & 0o777 == 0o600 and sock.stat().st_uid == os.getuid()
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        stub.ReportProgress(agent_pb2.ReportProgressRequest(progress=cluster_pb2.Progress(step=3)), timeout=5)
        with pytest.raises(grpc.RpcError) as kill:
            stub.Kill(agent_pb2.KillRequest(), timeout=5)
    assert rpc.rpc_code(kill.value) is grpc.StatusCode.PERMISSION_DENIED
    assert "local (unix socket) may not call Kill" in rpc.rpc_details(kill.value)
    wait_for(lambda: nodes_seen(cluster)["node-1"].progress.step == 3, 5, "progress reaches the coordinator")


def test_no_drill_token_in_argv_or_files(cluster: ClusterFile) -> None:
    workdir = Path(cluster.workdir)
    saved = json.loads((workdir / "cluster.json").read_text())
    assert "drill_token" not in saved and cluster.drill_token == ""
    for ready in (workdir / "run").glob("*.json"):
        assert "token" not in ready.read_text()
    for proc in cluster.agents:
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--pki-dir" in argv and not any(b"token" in a for a in argv), argv


# ---- etcd ----------------------------------------------------------------------------------------


def test_etcd_refuses_plaintext_and_nodes_and_keeps_rendezvous_to_its_prefix(cluster: ClusterFile) -> None:
    plaintext = make_client(cluster.etcd_endpoints, timeout_s=2)
    with pytest.raises((pyetcd.exceptions.ConnectionFailedError, pyetcd.exceptions.ConnectionTimeoutError)):
        plaintext.get("/ftd/local/world")

    def client(kind: str, name: str) -> Any:
        return make_client(cluster.etcd_endpoints, timeout_s=2, tls=EtcdTls.of_identity(ids(cluster, kind, name)))

    assert client("coordinator", "coordinator-0").get("/ftd/local/world")[0] is not None
    with pytest.raises(grpc.RpcError) as caught:
        client("rendezvous", "node-0").get("/ftd/local/world")
    assert rpc.rpc_code(caught.value) is grpc.StatusCode.PERMISSION_DENIED
    for kind, name in (("node", "node-0"), ("operator", "operator")):  # no etcd client name: refused in TLS
        with pytest.raises((pyetcd.exceptions.ConnectionFailedError, pyetcd.exceptions.ConnectionTimeoutError)):
            client(kind, name).get("/ftd/local/world")
    rendezvous = client("rendezvous", "node-0")
    rendezvous.put("/torch/elastic/store/e2e/probe", "1")  # the etcd-v3 rendezvous' own prefixes
    assert rendezvous.get("/torch/elastic/store/e2e/probe")[0] == b"1"
    with pytest.raises(grpc.RpcError) as elsewhere:
        rendezvous.put("/torch/other", "1")
    assert rpc.rpc_code(elsewhere.value) is grpc.StatusCode.PERMISSION_DENIED


def test_the_etcd_v3_rendezvous_uses_the_node_rendezvous_certificate(cluster: ClusterFile) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from ftd.training.etcd_v3 import create_backend

    params = RendezvousParameters(backend="etcd-v3", endpoint=cluster.etcd_endpoints, run_id="e2e", min_nodes=1,
                                  max_nodes=1, pki_dir=cluster.pki_dir, node_id="node-0")
    backend, store = create_backend(params)
    state = backend.set_state(b"state")
    assert state is not None and state[0] == b"state" and state[2]
    store.set("key", "value")
    assert store.get("key") == b"value"


# ---- the operator's CLI --------------------------------------------------------------------------


def test_ftctl_with_the_workdir_uses_the_operator_certificate(cluster: ClusterFile,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workdir", cluster.workdir, "status", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["world"]) == ["node-0", "node-1"]
    assert main(["--workdir", cluster.workdir, "health", "--json"]) == 0
    assert {r["node"] for r in json.loads(capsys.readouterr().out)} == {"node-0", "node-1", "node-2"}
    # the same through --pki-dir and --coordinator (a real cluster has no cluster.json)
    assert main(["--coordinator", cluster.coordinator_endpoints, "--pki-dir", cluster.pki_dir, "nodes"]) == 0
    capsys.readouterr()
    # a node's certificate is no operator's: ftctl names the file it could not use
    assert main(["--workdir", cluster.workdir, "--operator", "nobody", "status"]) == 1
    assert "operators/nobody.crt" in capsys.readouterr().err


# ---- rotation and drills (they change the cluster: last) -----------------------------------------


def test_rotation_of_a_node_certificate_without_a_restart(cluster: ClusterFile) -> None:
    """The agent keeps heartbeating through the rotation; a new connection sees the new serial."""
    node1 = agent(cluster, "node-1")
    files = ids(cluster, "node", "node-1")
    operator = ids(cluster, "operator", "operator").load()
    old_serial = served_serial(node1.info["address"], operator)
    assert old_serial == serial_of(files.cert_path.read_bytes())
    before = scrape(node1.info["metrics"])

    rotate(Path(cluster.pki_dir), "node", "node-1")
    new_serial = serial_of(files.cert_path.read_bytes())
    assert new_serial != old_serial
    assert wait_for(lambda: served_serial(node1.info["address"], operator) == new_serial, 5,
                    "the agent serving its rotated certificate")
    wait_for(lambda: scrape(node1.info["metrics"])["ftd_agent_heartbeats_sent_total"]
             - before["ftd_agent_heartbeats_sent_total"] >= 2, 15, "2 stream messages on the rotated certificate")
    after = scrape(node1.info["metrics"])
    assert after["ftd_agent_reconnects_total"] == before["ftd_agent_reconnects_total"]
    assert after["ftd_agent_connected"] == 1.0
    node = nodes_seen(cluster)["node-1"]
    assert node.state == cluster_pb2.NODE_STATE_ALIVE and node.pid == node1.pid
    # New calls of the agent to the coordinator go over a channel with the new certificate: one
    # forwarded from its training side (over the Unix socket) reaches the coordinator.
    with grpc.insecure_channel(f"unix:{node1.info['socket']}") as ch:
        target = agent_pb2_grpc.AgentStub(ch).GetRestoreTarget(
            checkpoint_pb2.GetRestoreTargetRequest(job="train"), timeout=5)
    assert not target.found
    log = Path(cluster.workdir) / "logs" / "node-1.log"
    assert "using the rotated certificate of node/node-1 for new calls" in log.read_text()


def test_rotation_of_the_coordinator_certificate_without_a_restart(cluster: ClusterFile) -> None:
    operator = ids(cluster, "operator", "operator").load()
    address = coordinator(cluster)
    old_serial = served_serial(address, operator)
    rotate(Path(cluster.pki_dir), "coordinator", "coordinator-0")
    new_serial = serial_of(ids(cluster, "coordinator", "coordinator-0").cert_path.read_bytes())
    assert wait_for(lambda: served_serial(address, operator) == new_serial != old_serial, 5,
                    "the coordinator serving its rotated certificate")
    wait_heartbeats(cluster, [a.name for a in cluster.agents], 3)  # every stream through the new certificate
    assert all(n.state == cluster_pb2.NODE_STATE_ALIVE for n in nodes_seen(cluster).values())


def test_a_drill_is_authorised_by_the_operator_certificate(cluster: ClusterFile) -> None:
    client = cluster.client()
    try:
        result = drill.run(client, "node-0", mode="node", target_detect_s=3.0, timeout_s=30.0)
    finally:
        client.close()
    assert result.passed, result.verdict
    assert result.replacement == "node-2"
