"""mTLS and authorization over real gRPC on 127.0.0.1 (ftd/rpc.py): plaintext, certificate-less and
foreign-CA clients are refused; the server sees the identity in the client's SAN; a rotated server
certificate reaches new connections without a restart; the table is enforced by the blocking and the
asyncio interceptors (the ``ftd.v1`` services with fake servicers), and denials change nothing."""

from __future__ import annotations

import asyncio
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc import aio

from ftd import rpc
from ftd.authz import OPERATOR_ONLY, AuthzFacts
from ftd.authz_interceptors import AioAuthzInterceptor, AuthzInterceptor, Guard, peer_identity
from ftd.ca import init_ca, issue, rotate, serial_of, write_atomic
from ftd.identity import Identity, IdentityFiles, TlsMaterial, load_identity, paths
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

CLUSTER = "c1"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mtls") / "pki"
    init_ca(path, CLUSTER)
    for kind, name in (("node", "n1"), ("node", "n2"), ("operator", "operator"), ("coordinator", "c0"),
                       ("rendezvous", "n1")):
        issue(path, kind, name)
    foreign = path.parent / "foreign"
    init_ca(foreign, CLUSTER)  # same cluster name, another CA
    issue(foreign, "operator", "operator")
    return path


def ids(root: Path, kind: str, name: str) -> TlsMaterial:
    return load_identity(root, kind, name)


def served_serial(port: int, client: TlsMaterial, host: str = "127.0.0.1") -> int:
    """The serial of the certificate the server presents on a new connection (Python's ssl, h2)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=client.ca_pem.decode())
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp) / "c.crt", Path(tmp) / "c.key"
        cert.write_bytes(client.cert_pem)
        key.write_bytes(client.key_pem)
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


# ---- a blocking server: the Agent service -----------------------------------------------------------


class FakeAgent(agent_pb2_grpc.AgentServicer):
    def __init__(self) -> None:
        self.kills = 0

    def GetInfo(self, request: agent_pb2.GetInfoRequest, context: grpc.ServicerContext) -> agent_pb2.AgentInfo:
        return agent_pb2.AgentInfo(node_id=str(peer_identity(context)))

    def ReportProgress(self, request: agent_pb2.ReportProgressRequest,
                       context: grpc.ServicerContext) -> agent_pb2.ReportProgressResponse:
        return agent_pb2.ReportProgressResponse()

    def Kill(self, request: agent_pb2.KillRequest, context: grpc.ServicerContext) -> agent_pb2.KillResponse:
        self.kills += 1
        return agent_pb2.KillResponse(pid=1)


class AgentServer:
    def __init__(self, tls: rpc.Tls | None, sock: Path, plaintext_tcp: bool = False) -> None:
        self.denied: list[tuple[str, str]] = []
        guard = Guard(cluster=CLUSTER, on_denied=lambda m, r: self.denied.append((m, r)))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=rpc.SERVER_OPTIONS,
                                  interceptors=[AuthzInterceptor(guard)])
        self.servicer = FakeAgent()
        agent_pb2_grpc.add_AgentServicer_to_server(self.servicer, self.server)
        self.port = rpc.add_port(self.server, "127.0.0.1:0", None if plaintext_tcp else tls)
        assert self.port
        rpc.add_port(self.server, f"unix:{sock}", tls)  # plaintext whatever tls says
        self.server.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def agent(root: Path, tmp_path: Path) -> Iterator[AgentServer]:
    server = AgentServer(IdentityFiles(root, "node", "n1"), tmp_path / "agent.sock")
    yield server
    server.server.stop(None)


def info(target: str, tls: rpc.Tls | None, **kw: Any) -> str:
    with rpc.channel(target, tls=tls, **kw) as ch:
        return agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id


def refused(target: str, tls: rpc.Tls | None, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        info(target, tls, **kw)
    return caught.value


def test_right_certificate_shows_its_san_identity(agent: AgentServer, root: Path) -> None:
    assert info(agent.target, ids(root, "operator", "operator")) == "operator/operator"
    assert info(agent.target, IdentityFiles(root, "node", "n2")) == "node/n2"
    assert info(f"localhost:{agent.port}", ids(root, "coordinator", "c0")) == "coordinator/c0"


def test_plaintext_client_is_refused(agent: AgentServer) -> None:
    assert rpc.rpc_code(refused(agent.target, None)) is grpc.StatusCode.UNAVAILABLE


def test_tls_client_without_certificate_is_refused(agent: AgentServer, root: Path) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=ids(root, "node", "n2").ca_pem)
    with grpc.secure_channel(agent.target, creds) as ch, pytest.raises(grpc.RpcError) as caught:
        agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=5)
    assert rpc.rpc_code(caught.value) is grpc.StatusCode.UNAVAILABLE


def test_certificate_of_a_foreign_ca_is_refused(agent: AgentServer, root: Path) -> None:
    foreign = ids(root.parent / "foreign", "operator", "operator")
    assert rpc.rpc_code(refused(agent.target, foreign)) is grpc.StatusCode.UNAVAILABLE
    # and a client trusting only the foreign CA refuses the server
    mixed = TlsMaterial(foreign.ca_pem, ids(root, "node", "n2").cert_pem, ids(root, "node", "n2").key_pem)
    assert rpc.rpc_code(refused(agent.target, mixed)) is grpc.StatusCode.UNAVAILABLE
    assert agent.servicer.kills == 0 and agent.denied == []


def test_server_name_override(root: Path, tmp_path: Path) -> None:
    """127.0.0.2 is not in the server's certificate: refused, unless verified as a name it carries."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_AgentServicer_to_server(FakeAgent(), server)
    port = rpc.add_port(server, "0.0.0.0:0", ids(root, "node", "n1"))
    server.start()
    try:
        client = ids(root, "node", "n2")
        assert rpc.rpc_code(refused(f"127.0.0.2:{port}", client)) is grpc.StatusCode.UNAVAILABLE
        assert info(f"127.0.0.2:{port}", client, server_name="localhost") == "node/n2"
    finally:
        server.stop(None)


def test_an_agents_client_connects_the_standbys_before_a_failover_needs_them(root: Path) -> None:
    """``CoordinatorClient.warm``: the channels of the other coordinator endpoints finish their TCP and
    TLS handshakes with no call made, so a failover moves the streams over connections already up."""
    from ftd.client import CoordinatorClient
    from ftd.waiting import wait_for

    servers, ports = [], []
    for _ in range(3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=rpc.SERVER_OPTIONS)
        ports.append(rpc.add_port(server, "127.0.0.1:0", ids(root, "coordinator", "c0")))
        server.start()
        servers.append(server)
    client = CoordinatorClient([f"127.0.0.1:{p}" for p in ports], tls=ids(root, "node", "n1"))
    try:
        states: dict[str, list[grpc.ChannelConnectivity]] = {}
        assert client.warm() == [f"127.0.0.1:{p}" for p in ports[1:]]
        for endpoint in client.endpoints[1:]:
            seen = states.setdefault(endpoint, [])
            client._channels[endpoint].subscribe(seen.append, try_to_connect=False)  # watches, never connects
        wait_for(lambda: all(grpc.ChannelConnectivity.READY in s for s in states.values()), 15,
                 "the standbys' channels ready without a call")
        assert client.endpoints[0] not in client._channels  # the current endpoint connects on its first call
    finally:
        client.close()
        for server in servers:
            server.stop(None)


def test_a_failover_skips_a_replica_that_refuses_connections(root: Path) -> None:
    """With no leader named, ``follow`` moves to the next replica whose channel is not broken: a
    SIGKILLed replica's refused connections are seen by its channel, not paid for with a backoff."""
    from ftd.client import CoordinatorClient, next_endpoint
    from ftd.waiting import wait_for

    assert next_endpoint(["a", "b", "c"], "a") == "b"
    assert next_endpoint(["a", "b", "c"], "a", {"b"}) == "c"
    assert next_endpoint(["a", "b"], "b", {"a"}) == "b", "a standby knowing no leader yet is asked again"
    assert next_endpoint(["a", "b"], "b", {"a", "b"}) == "a", "all broken: plain rotation"
    servers, ports = [], []
    for _ in range(3):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=rpc.SERVER_OPTIONS)
        ports.append(rpc.add_port(server, "127.0.0.1:0", ids(root, "coordinator", "c0")))
        server.start()
        servers.append(server)
    client = CoordinatorClient([f"127.0.0.1:{p}" for p in ports], tls=ids(root, "node", "n1"))
    try:
        client.warm()
        dead = client.endpoints[1]
        wait_for(lambda: client.endpoints[2] not in client.broken and dead not in client.broken
                 and len(client._channels) == 2, 15, "the standbys' channels up")
        servers[1].stop(None)  # as a SIGKILLed replica: its port refuses
        wait_for(lambda: dead in client.broken, 30, f"{dead}'s channel seen broken")
        client.follow(RuntimeError("no leader named"))
        assert client.current == client.endpoints[2], f"went to {client.current}"
    finally:
        client.close()
        for server in servers:
            server.stop(None)


def test_unix_socket_is_local_and_plaintext(agent: AgentServer, tmp_path: Path, root: Path) -> None:
    target = f"unix:{tmp_path / 'agent.sock'}"
    assert info(target, IdentityFiles(root, "node", "n1")) == "local (unix socket)"  # tls ignored for unix:
    with rpc.channel(target) as ch:
        agent_pb2_grpc.AgentStub(ch).ReportProgress(agent_pb2.ReportProgressRequest(), timeout=5)


def test_denials_are_permission_denied_counted_and_change_nothing(agent: AgentServer, root: Path) -> None:
    with rpc.channel(agent.target, tls=ids(root, "node", "n2")) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Kill(agent_pb2.KillRequest(), timeout=5)
        assert rpc.rpc_code(caught.value) is grpc.StatusCode.PERMISSION_DENIED
        assert rpc.rpc_details(caught.value) == f"node/n2 may not call Kill (rule: {OPERATOR_ONLY.text})"
        with pytest.raises(grpc.RpcError) as caught:
            stub.ReportProgress(agent_pb2.ReportProgressRequest(), timeout=5)
        assert "node/n2 may not call ReportProgress (rule: only the training process" in rpc.rpc_details(caught.value)
    assert agent.servicer.kills == 0
    assert agent.denied == [("Agent/Kill", "operator_only"), ("Agent/ReportProgress", "local_only")]
    with rpc.channel(agent.target, tls=ids(root, "operator", "operator")) as ch:
        assert agent_pb2_grpc.AgentStub(ch).Kill(agent_pb2.KillRequest(), timeout=5).pid == 1
    assert agent.servicer.kills == 1


def test_plaintext_tcp_peer_is_unauthenticated(root: Path, tmp_path: Path) -> None:
    server = AgentServer(None, tmp_path / "s.sock", plaintext_tcp=True)
    try:
        error = refused(server.target, None)
        assert rpc.rpc_code(error) is grpc.StatusCode.UNAUTHENTICATED
        assert rpc.rpc_details(error).startswith("an unauthenticated peer may not call GetInfo")
        assert server.denied == [("Agent/GetInfo", "authenticated")]
    finally:
        server.server.stop(None)


def test_rotation_reaches_new_connections_without_restart(agent: AgentServer, root: Path, tmp_path: Path) -> None:
    # the server's own files, copied so that rotating them does not disturb the other tests
    own = tmp_path / "pki"
    init_ca(own, CLUSTER)
    issue(own, "coordinator", "c9")
    issue(own, "operator", "operator")
    client = load_identity(own, "operator", "operator")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[AuthzInterceptor(Guard())])
    agent_pb2_grpc.add_AgentServicer_to_server(FakeAgent(), server)
    port = rpc.add_port(server, "127.0.0.1:0", IdentityFiles(own, "coordinator", "c9"))
    server.start()
    try:
        first = served_serial(port, client)
        assert first == serial_of(load_identity(own, "coordinator", "c9").cert_pem)
        with rpc.channel(f"127.0.0.1:{port}", tls=client) as old_channel:
            stub = agent_pb2_grpc.AgentStub(old_channel)
            assert stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id == "operator/operator"
            rotate(own, "coordinator", "c9")
            rotated = serial_of(load_identity(own, "coordinator", "c9").cert_pem)
            assert rotated != first
            assert served_serial(port, client) == rotated
            assert stub.GetInfo(agent_pb2.GetInfoRequest(), timeout=5).node_id == "operator/operator"
        assert info(f"127.0.0.1:{port}", client) == "operator/operator"
        # a bad file on disk (another CA's certificate): the server keeps serving the good one
        foreign = tmp_path / "foreign"
        init_ca(foreign, CLUSTER)
        issue(foreign, "coordinator", "c9")
        write_atomic(own / "coordinators/c9.crt", (foreign / "coordinators/c9.crt").read_bytes(), 0o644)
        write_atomic(own / "coordinators/c9.key", (foreign / "coordinators/c9.key").read_bytes(), 0o600)
        assert served_serial(port, client) == rotated
        assert info(f"127.0.0.1:{port}", client) == "operator/operator"
    finally:
        server.stop(None)


# ---- an asyncio server: the Coordinator service -----------------------------------------------------


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.registered: list[str] = []
        self.beats: list[str] = []

    async def Register(self, request: coordinator_pb2.RegisterRequest,
                       context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RegisterResponse:
        self.registered.append(request.node_id)
        return coordinator_pb2.RegisterResponse(message=str(peer_identity(context)))

    async def SetRoundStore(self, request: coordinator_pb2.SetRoundStoreRequest,
                            context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        return coordinator_pb2.RoundInfo(job=request.job, store_address=request.address)

    async def Heartbeat(  # type: ignore[override]  # read/write style, as the real coordinator's
            self, request_iterator: AsyncIterator[coordinator_pb2.HeartbeatRequest],
            context: aio.ServicerContext[Any, Any]) -> None:
        try:
            while True:
                request = await context.read()
                if request is aio.EOF:  # type: ignore[attr-defined]
                    return
                self.beats.append(request.node_id)
                await context.write(coordinator_pb2.HeartbeatResponse(leader_id="c0"))
        except Exception:  # like the real one: a read that fails ends the stream quietly
            return


class FakeRendezvous(FakeCoordinator):
    async def JoinRound(self, request: coordinator_pb2.JoinRoundRequest,
                        context: aio.ServicerContext[Any, Any]) -> coordinator_pb2.RoundInfo:
        return coordinator_pb2.RoundInfo(job=request.job, message=str(peer_identity(context)))


async def _serve(root: Path, body: Any) -> Any:
    denied: list[tuple[str, str]] = []

    def facts(method: str, identity: Identity, fields: Any) -> AuthzFacts:
        return AuthzFacts(round_rank0="n1", registered_host="127.0.0.1")

    guard = Guard(cluster=CLUSTER, facts=facts, on_denied=lambda m, r: denied.append((m, r)))
    server = aio.server(options=rpc.SERVER_OPTIONS, interceptors=[AioAuthzInterceptor(guard)])
    servicer = FakeRendezvous()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = rpc.add_port(server, "127.0.0.1:0", IdentityFiles(root, "coordinator", "c0"))
    await server.start()
    try:
        return await body(f"127.0.0.1:{port}", servicer, denied)
    finally:
        await server.stop(None)


def test_aio_server_enforces_the_table(root: Path) -> None:
    async def body(target: str, servicer: FakeCoordinator, denied: list[tuple[str, str]]) -> None:
        async with rpc.aio_channel(target, tls=IdentityFiles(root, "node", "n1")) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            ok = await stub.Register(coordinator_pb2.RegisterRequest(node_id="n1"), timeout=5)
            assert ok.message == "node/n1"
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.Register(coordinator_pb2.RegisterRequest(node_id="n2"), timeout=5)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert caught.value.details() == ("node/n1 may not Register as 'n2' (node_id) "
                                              "(rule: nodes act only as themselves)")
            assert servicer.registered == ["n1"]
            store = coordinator_pb2.SetRoundStoreRequest(job="j", round=1, node_id="n1", address="127.0.0.1:5")
            assert (await stub.SetRoundStore(store, timeout=5)).store_address == "127.0.0.1:5"
            store.address = "10.9.9.9:5"
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.SetRoundStore(store, timeout=5)
            assert "may not SetRoundStore at host '10.9.9.9'" in str(caught.value.details())
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.Rollback(checkpoint_pb2.RollbackRequest(job="j", step=1), timeout=5)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        async with rpc.aio_channel(target, tls=ids(root, "rendezvous", "n1")) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            joined = await stub.JoinRound(coordinator_pb2.JoinRoundRequest(job="j", node_id="n1"), timeout=5)
            assert joined.message == "rendezvous/n1"
            with pytest.raises(aio.AioRpcError) as caught:
                await stub.Register(coordinator_pb2.RegisterRequest(node_id="n1"), timeout=5)
            assert "rendezvous/n1 may not call Register" in str(caught.value.details())
        assert denied == [("Coordinator/Register", "node_self"), ("Coordinator/SetRoundStore", "round_rank0"),
                          ("Coordinator/Rollback", "operator_only"), ("Coordinator/Register", "node_only")]

    asyncio.run(_serve(root, body))


def test_aio_heartbeat_stream_checks_every_message(root: Path) -> None:
    def beat(node: str) -> coordinator_pb2.HeartbeatRequest:
        return coordinator_pb2.HeartbeatRequest(node_id=node, health=cluster_pb2.Health())

    async def body(target: str, servicer: FakeCoordinator, denied: list[tuple[str, str]]) -> None:
        async with rpc.aio_channel(target, tls=ids(root, "node", "n1")) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            call = stub.Heartbeat(timeout=5)
            await call.write(beat("n1"))
            assert (await call.read()).leader_id == "c0"
            await call.write(beat("n2"))  # the servicer swallows the abort, as the real one does
            assert await call.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "node/n1 may not Heartbeat as 'n2'" in str(await call.details())
        async with rpc.aio_channel(target, tls=ids(root, "operator", "operator")) as ch:
            call = coordinator_pb2_grpc.CoordinatorStub(ch).Heartbeat(timeout=5)
            await call.write(beat("n1"))
            assert await call.code() is grpc.StatusCode.PERMISSION_DENIED
        assert servicer.beats == ["n1"]
        assert denied == [("Coordinator/Heartbeat", "node_self"), ("Coordinator/Heartbeat", "node_only")]

    asyncio.run(_serve(root, body))


def test_aio_listener_rotates_too(root: Path, tmp_path: Path) -> None:
    own = tmp_path / "pki"
    init_ca(own, CLUSTER)
    issue(own, "coordinator", "c0")
    issue(own, "operator", "operator")
    client = load_identity(own, "operator", "operator")

    async def body(target: str, servicer: FakeCoordinator, denied: list[tuple[str, str]]) -> None:
        port = int(target.rsplit(":", 1)[1])
        first = await asyncio.to_thread(served_serial, port, client)
        rotate(own, "coordinator", "c0")
        second = await asyncio.to_thread(served_serial, port, client)
        assert first != second == serial_of((own / "coordinators/c0.crt").read_bytes())

    asyncio.run(_serve(own, body))


# ---- request streams read by iteration (blocking and asyncio) ---------------------------------------


def _heartbeat_handler(behavior: Any) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
    return grpc.method_handlers_generic_handler("ftd.v1.Coordinator", {
        "Heartbeat": grpc.stream_stream_rpc_method_handler(
            behavior, request_deserializer=coordinator_pb2.HeartbeatRequest.FromString,
            response_serializer=coordinator_pb2.HeartbeatResponse.SerializeToString)})


def _beats(*nodes: str) -> list[coordinator_pb2.HeartbeatRequest]:
    return [coordinator_pb2.HeartbeatRequest(node_id=n) for n in nodes]


def test_blocking_request_stream_is_checked_per_message(root: Path) -> None:
    seen: list[str] = []

    def heartbeat(requests: Iterator[coordinator_pb2.HeartbeatRequest],
                  context: grpc.ServicerContext) -> Iterator[coordinator_pb2.HeartbeatResponse]:
        for request in requests:
            seen.append(request.node_id)
            yield coordinator_pb2.HeartbeatResponse(leader_id=request.node_id)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         interceptors=[AuthzInterceptor(Guard(cluster=CLUSTER))])
    server.add_generic_rpc_handlers((_heartbeat_handler(heartbeat),))
    port = rpc.add_port(server, "127.0.0.1:0", ids(root, "coordinator", "c0"))
    server.start()
    try:
        with rpc.channel(f"127.0.0.1:{port}", tls=ids(root, "node", "n1")) as ch:
            responses = coordinator_pb2_grpc.CoordinatorStub(ch).Heartbeat(iter(_beats("n1", "n2", "n1")), timeout=5)
            assert next(responses).leader_id == "n1"
            with pytest.raises(grpc.RpcError) as caught:
                next(responses)
        assert rpc.rpc_code(caught.value) is grpc.StatusCode.PERMISSION_DENIED
        assert "node/n1 may not Heartbeat as 'n2'" in rpc.rpc_details(caught.value)
        assert seen == ["n1"]
    finally:
        server.stop(None)


def test_aio_request_stream_iterated_by_an_async_generator(root: Path) -> None:
    seen: list[str] = []

    async def heartbeat(requests: AsyncIterator[coordinator_pb2.HeartbeatRequest],
                        context: aio.ServicerContext[Any, Any]) -> AsyncIterator[coordinator_pb2.HeartbeatResponse]:
        async for request in requests:
            seen.append(request.node_id)
            yield coordinator_pb2.HeartbeatResponse(leader_id=request.node_id)

    async def main() -> None:
        server = aio.server(interceptors=[AioAuthzInterceptor(Guard(cluster=CLUSTER))])
        server.add_generic_rpc_handlers((_heartbeat_handler(heartbeat),))
        port = rpc.add_port(server, "127.0.0.1:0", ids(root, "coordinator", "c0"))
        await server.start()
        try:
            async with rpc.aio_channel(f"127.0.0.1:{port}", tls=ids(root, "node", "n1")) as ch:
                call = coordinator_pb2_grpc.CoordinatorStub(ch).Heartbeat(iter(_beats("n1", "n2")), timeout=5)
                with pytest.raises(aio.AioRpcError) as caught:
                    async for response in call:
                        assert response.leader_id == "n1"
                assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert seen == ["n1"]


# ---- etcd with the cluster PKI (the flags docs/security.md gives) -----------------------------------


@pytest.mark.etcd
def test_etcd_with_mutual_tls(root: Path, tmp_path: Path) -> None:
    import subprocess

    import pyetcd

    from ftd.etcd_client import CHANNEL_OPTIONS, RETRY_FAILED_MEMBER_S
    from ftd.ftctl.etcd_server import etcd_binary, free_port
    from ftd.waiting import wait_for

    issue(root, "etcd", "m0", force=True)
    crt, key = paths(root, "etcd", "m0")
    ca = root / "ca.crt"
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"https://127.0.0.1:{client_port}", f"https://127.0.0.1:{peer_port}"
    cmd = [etcd_binary(), "--name", "m0", "--data-dir", str(tmp_path / "data"),
           "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
           "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
           "--initial-cluster", f"m0={peer_url}",
           "--cert-file", str(crt), "--key-file", str(key), "--trusted-ca-file", str(ca), "--client-cert-auth",
           "--peer-cert-file", str(crt), "--peer-key-file", str(key), "--peer-trusted-ca-file", str(ca),
           "--peer-client-cert-auth", "--peer-cert-allowed-cn", "ftd-etcd"]
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def client(creds: grpc.ChannelCredentials | None) -> Any:
        endpoint = pyetcd.Endpoint("127.0.0.1", client_port, secure=creds is not None, creds=creds,
                                   time_retry=RETRY_FAILED_MEMBER_S, opts=CHANNEL_OPTIONS)
        return pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=2, failover=True)

    try:
        coordinator_creds = rpc.client_credentials(IdentityFiles(root, "coordinator", "c0"))
        coordinator = client(coordinator_creds)
        wait_for(lambda: coordinator.put("/ftd/c1/probe", "1") or True, 20, "etcd over mTLS",
                 not_yet=(pyetcd.exceptions.ConnectionFailedError, pyetcd.exceptions.NoServerAvailableError))
        assert coordinator.get("/ftd/c1/probe")[0] == b"1"
        for creds in (None, rpc.client_credentials(ids(root.parent / "foreign", "operator", "operator"))):
            with pytest.raises((pyetcd.exceptions.ConnectionFailedError,
                                pyetcd.exceptions.ConnectionTimeoutError)):
                client(creds).get("/ftd/c1/probe")
        node = client(rpc.client_credentials(ids(root, "node", "n1")))
        assert node.get("/ftd/c1/probe")[0] == b"1"  # any certificate of the CA: until etcd's auth is on
        # etcd's auth, as docs/security.md says: the client certificate's CN is the user
        from pyetcd.etcdrpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

        with grpc.secure_channel(f"127.0.0.1:{client_port}", coordinator_creds) as ch:
            auth = rpc_pb2_grpc.AuthStub(ch)
            auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password="unused-root"), timeout=5)
            auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
            auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="ftd-coordinator", password="unused-cn"), timeout=5)
            auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="ftd"), timeout=5)
            auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name="ftd", perm=auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE, key=b"/ftd/", range_end=b"/ftd0")), timeout=5)
            auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="ftd-coordinator", role="ftd"), timeout=5)
            auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=5)
        coordinator.put("/ftd/c1/probe", "2")
        assert coordinator.get("/ftd/c1/probe")[0] == b"2"
        with pytest.raises(grpc.RpcError) as caught:
            node.get("/ftd/c1/probe")
        assert rpc.rpc_code(caught.value) is grpc.StatusCode.PERMISSION_DENIED
    finally:
        proc.terminate()
        proc.wait(10)
