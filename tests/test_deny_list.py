"""Issue 20's identity rules as pure functions (no processes, no sleeping): the deny list and its cache,
identity from exactly one URI SAN, the server names clients verify, the admission of a new or drained
node, and the throttled denial log. On real processes: tests/test_revocation.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cryptography import x509

from ftd import ca
from ftd.authz_interceptors import Guard, identity_from_auth
from ftd.ca import bootstrap, init_ca, issue, rotate, serial_of
from ftd.coordinator import errors
from ftd.coordinator.admission import Admission, Admitted, decide_registration
from ftd.coordinator.model import Fence, NodeRecord, Role, World
from ftd.coordinator.revocations import deny_list_of, parse_identity
from ftd.coordinator.view import ClusterView
from ftd.deny_list import DenyList, DenyListCache, DenyListFollower, serial_of_pem
from ftd.identity import COORDINATOR_SERVER_NAME, Identity, PkiError, server_name
from ftd.v1 import cluster_pb2, coordinator_pb2

N1 = Identity("node", "node-1", "c1")
C = "/ftd.v1.Coordinator/"
URI = b"spiffe://ftd/c1/operator/operator"


# ---- the deny list -------------------------------------------------------------------------------------


def test_a_revoked_identity_or_serial_is_refused_naming_the_rule() -> None:
    deny = DenyList.of([("node/node-1", "stolen")], [("ABC123", "rotated")])
    assert "revoked (stolen)" in (deny.refusal(N1, None) or "") and "rule revoked" in (deny.refusal(N1, None) or "")
    node2 = Identity("node", "node-2", "c1")
    assert deny.refusal(node2, "abc123") is not None  # serials compare in lower case
    assert deny.refusal(node2, "abc124") is None and deny.refusal(node2, None) is None


def test_the_version_changes_with_every_entry() -> None:
    versions = {DenyList().version, DenyList.of([("node/a", "r")], []).version,
                DenyList.of([], [("a", "r")]).version, DenyList.of([("node/a", "r")], [("a", "r")]).version}
    assert len(versions) == 4
    assert DenyList.of([("node/a", "x")], []).version == DenyList.of([("node/a", "y")], []).version


def test_the_cache_fetches_after_its_ttl_and_retries_sooner_after_a_failure() -> None:
    cache = DenyListCache(ttl_s=5.0, retry_s=1.0)
    assert cache.due(0.0)
    assert not cache.fetched(DenyList(), 0.0)  # the same (empty) list: no change
    assert not cache.due(4.9) and cache.due(5.0)
    cache.failed(5.0)
    assert not cache.due(5.9) and cache.due(6.0)
    assert cache.fetched(DenyList.of([("node/a", "r")], []), 6.0)
    assert not cache.due(10.9) and cache.due(11.0)


def test_the_follower_keeps_the_last_list_when_the_coordinator_is_unreachable() -> None:
    answers: list[object] = [coordinator_pb2.DenyListResponse(
        version=7, identities=[coordinator_pb2.DenyListEntry(key="node/node-1", reason="stolen")])]

    def call(method: str, request: coordinator_pb2.GetDenyListRequest, **kw: object) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    follower = DenyListFollower(call, ttl_s=5.0)
    follower.refresh(0.0)
    assert follower.current().refusal(N1, None)
    answers.append(ConnectionError("no leader"))
    follower.refresh(5.0)
    assert follower.current().refusal(N1, None)  # still revoked
    answers.append(coordinator_pb2.DenyListResponse(version=follower.current().version, unchanged=True))
    follower.refresh(6.0)
    assert follower.current().refusal(N1, None) and not follower.cache.due(10.9)


def test_the_coordinator_reads_its_records_and_a_corrupt_one_still_revokes() -> None:
    deny = deny_list_of({"access/revoked-id/node/node-1": b'{"reason": "stolen"}',
                         "access/revoked-serial/ab12": b"not json", "access/admitted/node-3": b"{}"})
    assert deny.identities == {"node/node-1": "stolen"}
    assert list(deny.serials) == ["ab12"]
    assert parse_identity("spiffe://ftd/c1/node/node-1") == ("node", "node-1") == parse_identity("node/node-1")
    for bad in ("node-1", "king/node-1", "node/../x"):
        with pytest.raises(errors.InvalidArgument):
            parse_identity(bad)


def test_the_guard_refuses_a_revoked_caller_before_the_table() -> None:
    seen: list[tuple[str, str]] = []
    deny = DenyList.of([], [("ab12", "rotated")])
    guard = Guard(cluster="c1", on_denied=lambda m, r: seen.append((m, r)), deny=lambda: deny)
    request = coordinator_pb2.RegisterRequest(node_id="node-1")
    assert guard.decide(C + "Register", N1, request, "ab13").allowed
    decision = guard.decide(C + "Register", N1, request, "ab12")
    assert not decision.allowed and decision.rule == "revoked" and not decision.unauthenticated
    assert seen == [("Coordinator/Register", "revoked")]


def test_denials_are_logged_once_per_identity_method_and_rule_per_period(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    guard = Guard(cluster="c1")
    guard.log_throttle.clock = lambda: now[0]
    request = coordinator_pb2.RegisterRequest(node_id="node-0")
    with caplog.at_level(logging.WARNING, logger="ftd.rpc"):
        for _ in range(1000):
            assert not guard.decide(C + "Register", N1, request).allowed
        guard.decide(C + "Register", Identity("node", "node-2", "c1"), request)  # another identity: its own line
        now[0] = 10.0
        guard.decide(C + "Register", N1, request)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "999 similar message(s) suppressed" in lines[2]


def test_serial_of_pem(tmp_path: Path) -> None:
    init_ca(tmp_path, "c1")
    crt = issue(tmp_path, "node", "node-1")
    assert serial_of_pem(crt.read_bytes()) == f"{serial_of(crt.read_bytes()):x}"
    assert serial_of_pem(b"junk") is None


# ---- identity from exactly one URI SAN -----------------------------------------------------------


def test_identity_only_from_exactly_one_uri_san() -> None:
    tls = {"transport_security_type": [b"ssl"]}
    assert identity_from_auth({**tls, "peer_spiffe_id": [URI], "x509_uri_subject_alternative_name": [URI]}) == \
        Identity("operator", "operator", "c1")
    assert identity_from_auth({**tls, "peer_spiffe_id": [URI]}) is not None  # a gRPC without the URI property
    # the DNS SAN spelling the operator's URI (gRPC sets no peer_spiffe_id then): nobody
    assert identity_from_auth({**tls, "x509_subject_alternative_name": [URI, b"localhost"]}) is None
    two = [URI, b"spiffe://ftd/c1/node/node-1"]
    assert identity_from_auth({**tls, "x509_uri_subject_alternative_name": two}) is None
    assert identity_from_auth({**tls, "peer_spiffe_id": [URI], "x509_uri_subject_alternative_name": two}) is None
    assert identity_from_auth({**tls, "peer_spiffe_id": [b"spiffe://other/c1/operator/operator"]}) is None


# ---- server names --------------------------------------------------------------------------------


def test_servers_carry_the_name_of_their_kind_and_nobody_else_may(tmp_path: Path) -> None:
    init_ca(tmp_path, "c1")
    assert server_name("coordinator", "c0") == COORDINATOR_SERVER_NAME
    assert server_name("node", "node-1") == "node-1.agent.ftd.internal"
    assert server_name("node", "Node_1") != server_name("node", "node-1")  # not a DNS label: by its digest
    assert server_name("node", "Node_1").endswith(".h.agent.ftd.internal")  # type: ignore[union-attr]
    assert server_name("operator", "operator") is None

    def names(path: Path) -> list[str]:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)

    assert COORDINATOR_SERVER_NAME in names(issue(tmp_path, "coordinator", "c0"))
    assert not any(n.endswith("ftd.internal") for n in names(issue(tmp_path, "operator", "o1")))
    for host in ("coordinator.ftd.internal", "*.ftd.internal", "node-0.agent.ftd.internal."):
        with pytest.raises(PkiError, match=r"ftd\.internal"):
            issue(tmp_path, "node", "node-9", hosts=[host])
    rotated = rotate(tmp_path, "coordinator", "c0", hosts=["c0.example"])
    assert COORDINATOR_SERVER_NAME in names(rotated) and "c0.example" in names(rotated)


def test_ftctl_up_issues_again_a_server_certificate_without_its_name(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bootstrap(tmp_path, "c1", coordinators=["c0"])
    path = tmp_path / "coordinators" / "c0.crt"
    assert bootstrap(tmp_path, "c1", coordinators=["c0"]) == []  # it has the name: kept
    with monkeypatch.context() as patch:
        patch.setattr(ca, "server_name", lambda kind, name: None)
        ca.issue(tmp_path, "coordinator", "c0", force=True)
    old = serial_of(path.read_bytes())
    assert bootstrap(tmp_path, "c1", coordinators=["c0"]) == [path]
    assert serial_of(path.read_bytes()) != old


# ---- admission -----------------------------------------------------------------------------------


def view_of(*nodes: NodeRecord, ranks: tuple[str, ...] = ("a",)) -> ClusterView:
    view = ClusterView(nodes={n.node_id: n for n in nodes})
    view.set_world(World(epoch=3, ranks=ranks, target_size=len(ranks)), 7)
    return view


def reg(node_id: str, role: cluster_pb2.Role.ValueType = cluster_pb2.ROLE_ACTIVE,
        inc: str = "i1") -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(node_id=node_id, host="h1", role=role, incarnation=inc)


def role_of(decision: Admission | errors.CoordinatorError) -> Role:
    assert isinstance(decision, Admission) and decision.record is not None, decision
    return decision.record.requested_role


def test_a_new_node_is_active_only_when_admitted() -> None:
    view = view_of(NodeRecord("a", "h1", Role.ACTIVE, incarnation="i0"))
    decision = decide_registration(view, reg("b"), 1.0, None, frozenset({"a"}))
    assert role_of(decision) is Role.SPARE and "ftctl admit b" in decision.message  # type: ignore[union-attr]
    assert role_of(decide_registration(view, reg("b"), 1.0, None, frozenset({"a", "b"}))) is Role.ACTIVE
    assert role_of(decide_registration(view, reg("b"), 1.0, Admitted("b", True, 0.5), frozenset())) is Role.ACTIVE
    assert role_of(decide_registration(view, reg("b"), 1.0, Admitted("b", False, 0.5), frozenset())) is Role.SPARE
    assert role_of(decide_registration(view, reg("b"), 1.0, None, None)) is Role.ACTIVE  # no identities: open
    # a rank holder restarting keeps its rank whatever the list says
    assert role_of(decide_registration(view, reg("a", inc="i2"), 1.0, None, frozenset())) is Role.ACTIVE


def test_a_drained_node_comes_back_only_once_admitted_after_its_drain() -> None:
    fence = Fence(3, "planned hand-over (ftctl drain): the final checkpoint is in", 100.0)
    view = view_of(NodeRecord("d", "h1", Role.ACTIVE, incarnation="i0", fence=fence))
    refused = decide_registration(view, reg("d", cluster_pb2.ROLE_SPARE), 200.0, None, frozenset({"d"}))
    assert isinstance(refused, errors.Forbidden) and refused.rule == "admission"
    assert "drained" in str(refused) and "ftctl admit d" in str(refused)
    stale = decide_registration(view, reg("d"), 200.0, Admitted("d", True, 50.0), frozenset())
    assert isinstance(stale, errors.Forbidden)  # admitted before the drain: not again
    back = decide_registration(view, reg("d"), 200.0, Admitted("d", True, 150.0), frozenset())
    assert role_of(back) is Role.SPARE  # a fenced node rejoins as a spare
    dead = view_of(NodeRecord("x", "h1", Role.ACTIVE, incarnation="i0", fence=Fence(3, "no heartbeat", 100.0)))
    assert role_of(decide_registration(dead, reg("x", inc="i1"), 200.0, None, frozenset())) is Role.SPARE
