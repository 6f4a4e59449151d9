"""Issue 20's identity findings (item 7, and 3's "a new node registers as a spare") as regression tests on
real processes: ``ftctl up`` (etcd, a coordinator, 2 agents + a spare, mutual TLS) and certificates of
the cluster's own CA in the attacker's hands.

* a CA-signed certificate whose DNS SAN spells the operator's URI (or with two URI SANs) is nobody;
* a rogue "coordinator" (or agent) served with another node's certificate is refused by the clients;
* a newly certified node asking for ACTIVE registers as a spare, and the world's target stays;
* ``ftctl certs revoke`` refuses an identity on the coordinator and, within the deny list's TTL, on an
  agent (PERMISSION_DENIED naming "revoked"); ``ftctl certs rotate`` revokes the old pair;
* a drained node cannot register again until ``ftctl admit``;
* last, node-1's own identity revoked while its agent runs: refused everywhere, it leaves the world.

One cluster for the module. The rules themselves: tests/test_deny_list.py."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from test_attacks import code, details, refused

from ftd import rpc
from ftd.ca import issue
from ftd.client import CoordinatorClient, CoordinatorUnreachable
from ftd.ftctl.cli import main as ftctl
from ftd.ftctl.localcluster import CLUSTER, ClusterFile, stop, up
from ftd.identity import IdentityFiles, TlsMaterial, ca_paths
from ftd.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("revocation") / "cluster", nodes=2, spares=1)
    try:
        yield started
    finally:
        stop(started)


def pki(cluster: ClusterFile) -> Path:
    return Path(cluster.pki_dir)


def identity(cluster: ClusterFile, kind: str, name: str) -> IdentityFiles:
    """``kind``/``name``'s files, issued now if the cluster has none (a node the operator certified)."""
    files = IdentityFiles(pki(cluster), kind, name)
    if not files.cert_path.exists():
        issue(pki(cluster), kind, name)
    return files


def client(cluster: ClusterFile, tls: IdentityFiles | TlsMaterial) -> CoordinatorClient:
    return CoordinatorClient(cluster.coordinator_endpoints, timeout_s=5.0, tls=tls)


def forged(cluster: ClusterFile, uris: list[str], dns: list[str]) -> TlsMaterial:
    """A certificate the cluster's CA signed with these SANs (what a careless or fooled CA issues)."""
    crt, key_path = ca_paths(pki(cluster))
    ca = x509.load_pem_x509_certificate(crt.read_bytes())
    ca_key = serialization.load_pem_private_key(key_path.read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    sans: list[x509.GeneralName] = [*(x509.UniformResourceIdentifier(u) for u in uris),
                                    *(x509.DNSName(d) for d in dns)]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ftd-operator")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return TlsMaterial(crt.read_bytes(), cert.public_bytes(serialization.Encoding.PEM),
                       key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


def status(c: CoordinatorClient) -> coordinator_pb2.ClusterStatus:
    return c.status(deadline_s=5.0)


def agent_info(cluster: ClusterFile, node_id: str, tls: IdentityFiles | TlsMaterial) -> agent_pb2.GetInfoResponse:
    address = next(a.info["address"] for a in cluster.agents if a.name == node_id)
    with rpc.channel(address, tls=tls) as ch:
        return agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=5)  # type: ignore[no-any-return]


def test_a_dns_san_spelling_the_operator_is_nobody(cluster: ClusterFile) -> None:
    operator_uri = f"spiffe://ftd/{CLUSTER}/operator/operator"
    dns_only = forged(cluster, [], [operator_uri, "localhost"])
    c = client(cluster, dns_only)
    err = refused(c.call, "CloseJob", coordinator_pb2.CloseJobRequest(job="x", reason="attack"), idempotent=True)
    assert code(err) is grpc.StatusCode.UNAUTHENTICATED, details(err)
    assert code(refused(status, c)) is grpc.StatusCode.UNAUTHENTICATED
    two = forged(cluster, [operator_uri, f"spiffe://ftd/{CLUSTER}/node/node-1"], ["localhost"])
    assert code(refused(status, client(cluster, two))) is grpc.StatusCode.UNAUTHENTICATED
    # the same CA signing exactly one URI SAN is the operator: the refusals above are the SANs' doing
    assert status(client(cluster, forged(cluster, [operator_uri], ["localhost"]))).world


class _Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def GetStatus(self, request: Any, context: Any) -> coordinator_pb2.ClusterStatus:
        return coordinator_pb2.ClusterStatus(leader_id="rogue")


def rogue(files: IdentityFiles) -> tuple[grpc.Server, str]:
    """A "coordinator" (and, by its port, an agent) served with ``files``' certificate on loopback."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Coordinator(), server)
    port = rpc.add_port(server, "127.0.0.1:0", files)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_rogue_coordinator_with_a_node_certificate_is_refused(cluster: ClusterFile) -> None:
    operator = identity(cluster, "operator", "operator")
    server, address = rogue(identity(cluster, "node", "node-1"))
    try:
        for caller in (operator, identity(cluster, "node", "node-0")):  # ftctl, an agent
            with pytest.raises(CoordinatorUnreachable):
                CoordinatorClient(address, timeout_s=0.5, tls=caller).status(deadline_s=1.0)
        # an agent dialled for node-0 refuses node-1's certificate too
        with rpc.agent_channel(address, "node-0", operator) as ch, pytest.raises(grpc.RpcError):
            coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(), timeout=2)
    finally:
        server.stop(None)
    # the same server with a coordinator's certificate is accepted: the refusal above is the certificate's
    server, address = rogue(identity(cluster, "coordinator", "coordinator-0"))
    try:
        assert CoordinatorClient(address, timeout_s=2.0, tls=operator).status().leader_id == "rogue"
    finally:
        server.stop(None)


def test_a_new_node_registers_as_a_spare_and_the_target_stays(cluster: ClusterFile) -> None:
    operator = cluster.client()
    before = status(operator)
    newcomer = client(cluster, identity(cluster, "node", "node-7"))
    reply = newcomer.register(coordinator_pb2.RegisterRequest(
        node_id="node-7", host="127.0.0.1", role=cluster_pb2.ROLE_ACTIVE, pid=1, incarnation="i1"))
    assert "registered as spare" in reply.message and "ftctl admit node-7" in reply.message, reply.message
    assert reply.assignment.rank < 0
    after = status(operator)
    assert list(after.world) == list(before.world) and after.epoch == before.epoch
    assert after.target_world_size == before.target_world_size == 2


def test_a_revoked_identity_is_refused_by_the_coordinator_and_an_agent(cluster: ClusterFile) -> None:
    node9 = identity(cluster, "node", "node-9")
    assert status(client(cluster, node9)).world  # it works before the revocation
    assert agent_info(cluster, "node-0", node9).node_id == "node-0"
    assert ftctl(["--workdir", cluster.workdir, "certs", "revoke", "node/node-9", "--reason", "stolen"]) == 0
    err = refused(status, client(cluster, node9))
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "revoked" in details(err), details(err)
    assert "stolen" in details(err)
    # a flood of refused calls: one log line per identity, method and rule per 10 s, not one per call
    flood = client(cluster, node9)
    for _ in range(300):
        refused(status, flood)
    log = (Path(cluster.workdir) / "logs" / "coordinator-0.log").read_text()
    lines = [line for line in log.splitlines() if "denied" in line and "node/node-9 is revoked" in line]
    assert 1 <= len(lines) <= 2, lines
    err = wait_for(lambda: _agent_refusal(cluster, node9), 15.0, "node-0's agent refusing the revoked node-9")
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "revoked" in details(err), details(err)
    assert agent_info(cluster, "node-0", identity(cluster, "node", "node-1")).node_id == "node-0"  # others pass


def _agent_refusal(cluster: ClusterFile, tls: IdentityFiles) -> grpc.RpcError | None:
    try:
        agent_info(cluster, "node-0", tls)
    except grpc.RpcError as exc:
        return exc
    return None


def test_a_rotation_revokes_the_old_pair(cluster: ClusterFile, tmp_path: Path) -> None:
    files = identity(cluster, "node", "node-8")
    old = files.load()
    assert status(client(cluster, old)).world
    assert ftctl(["--workdir", cluster.workdir, "certs", "rotate", "node", "node-8"]) == 0
    err = refused(status, client(cluster, old))
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "revoked" in details(err), details(err)
    assert status(client(cluster, files.load())).world  # the new pair works


def test_a_drained_node_cannot_register_again_until_admitted(cluster: ClusterFile) -> None:
    operator = cluster.client()
    assert ftctl(["--workdir", cluster.workdir, "drain", "node-2", "--reason", "suspected"]) == 0
    wait_for(lambda: any(n.node_id == "node-2" and n.state == cluster_pb2.NODE_STATE_FENCED
                         for n in operator.nodes().nodes), 15.0, "the drained spare fenced")
    node2 = client(cluster, identity(cluster, "node", "node-2"))
    again = coordinator_pb2.RegisterRequest(node_id="node-2", host="127.0.0.1", role=cluster_pb2.ROLE_SPARE, pid=1,
                                            incarnation="back")
    err = refused(node2.register, again)
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "drained" in details(err), details(err)
    assert "ftctl admit node-2" in details(err)
    assert ftctl(["--workdir", cluster.workdir, "admit", "node-2", "--spare"]) == 0
    back = node2.register(again)
    # node-2's own agent retries its registration too and may be first once admitted (then this call
    # replaces an unfenced spare record): either way the node is back, and only as a spare
    assert back.assignment.role == cluster_pb2.ROLE_SPARE, back.message
    assert "rejoins as a spare" in back.message or back.message.startswith("registered as spare"), back.message


def test_revoking_a_running_node_refuses_it_everywhere_and_its_rank_goes(cluster: ClusterFile) -> None:
    """Last: node-1's own identity revoked while its agent runs (a stolen key, step 1 of the procedure)."""
    operator = cluster.client()
    node1 = identity(cluster, "node", "node-1")
    assert "node-1" in status(operator).world
    assert ftctl(["--workdir", cluster.workdir, "certs", "revoke", "node/node-1", "--reason", "key stolen"]) == 0
    err = refused(status, client(cluster, node1))
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "node/node-1 is revoked" in details(err), details(err)
    err = wait_for(lambda: _agent_refusal(cluster, node1), 15.0, "node-0's agent refusing node-1")
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and "revoked" in details(err), details(err)
    # its own heartbeats are refused too: it is declared dead and leaves the world, like a crashed node
    wait_for(lambda: "node-1" not in status(operator).world, 30.0, "node-1 out of the world")
