"""The authorization table (ftd/authz.py): one rule per RPC of the service descriptors, the decisions
the issue asks for, properties over random identities and requests, and docs/security.md in step."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd import authz
from ftd.authz import TABLE, AuthzFacts, authorize
from ftd.authz_interceptors import Guard, authz_fields
from ftd.identity import KINDS, LOCAL, LOCAL_IDENTITY, Identity
from ftd.v1 import agent_pb2, checkpoint_pb2, coordinator_pb2

C, A = "/ftd.v1.Coordinator/", "/ftd.v1.Agent/"
N1 = Identity("node", "node-1", "c1")
OP = Identity("operator", "alice", "c1")
RULE_NAMES = {r.name for r in authz.RULES}


def service_methods() -> set[str]:
    out = set()
    for module, service in ((coordinator_pb2, "Coordinator"), (agent_pb2, "Agent")):
        descriptor = module.DESCRIPTOR.services_by_name[service]
        out |= {f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods}
    return out


def test_every_rpc_has_exactly_one_rule() -> None:
    methods = service_methods()
    assert sorted(methods - TABLE.keys()) == [], "an RPC without a rule in ftd/authz.py TABLE"
    assert sorted(TABLE.keys() - methods) == [], "a rule for an RPC that no longer exists"
    assert {p.rule for p in TABLE.values()} <= set(authz.RULES)


def test_docs_show_the_table() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert authz.markdown_table() in doc, "docs/security.md drifted from ftd/authz.py: paste markdown_table()"


@pytest.mark.parametrize(("method", "identity", "fields", "reason"), [
    (C + "Register", N1, {"node_id": "node-0"},
     "node/node-1 may not Register as 'node-0' (node_id) (rule: nodes act only as themselves)"),
    (C + "Heartbeat", N1, {"node_id": "node-0"}, "node/node-1 may not Heartbeat as 'node-0'"),
    (C + "CommitShard", N1, {"location": "node-0"}, "node/node-1 may not CommitShard as 'node-0' (location)"),
    (C + "Rollback", N1, {}, "node/node-1 may not call Rollback (rule: only operators"),
    (C + "CloseJob", Identity("rendezvous", "node-1", "c1"), {}, "rendezvous/node-1 may not call CloseJob"),
    (C + "InvalidateCheckpoint", Identity("coordinator", "c0", "c1"), {}, "coordinator/c0 may not call"),
    (C + "Register", OP, {"node_id": "alice"}, "operator/alice may not call Register (rule: only a node's agent"),
    (C + "GetStatus", Identity("etcd", "m0", "c1"), {}, "etcd/m0 may not call GetStatus (rule: identities of"),
    (A + "Kill", N1, {}, "node/node-1 may not call Kill (rule: only operators"),
    (A + "ReportProgress", OP, {}, "operator/alice may not call ReportProgress (rule: only the training process"),
    (A + "Kill", LOCAL_IDENTITY, {}, "local (unix socket) may not call Kill"),
    (C + "Register", Identity("node", "node-1", "c2"), {"node_id": "node-1"},
     "node/node-1 of cluster 'c2' may not call Register in cluster 'c1' (rule: identities act only in their own"),
    ("/ftd.v1.Coordinator/DropEverything", OP, {}, "operator/alice may not call '/ftd.v1.Coordinator/DropEverything'"),
])
def test_denials_name_identity_and_rule(method: str, identity: Identity, fields: dict[str, object],
                                        reason: str) -> None:
    decision = authorize(method, identity, fields, AuthzFacts(cluster="c1"))
    assert not decision.allowed
    assert reason in decision.reason
    assert "(rule: " in decision.reason
    assert decision.rule in RULE_NAMES
    assert not decision.unauthenticated


@pytest.mark.parametrize(("method", "identity", "fields"), [
    (C + "Register", N1, {"node_id": "node-1"}),
    (C + "Heartbeat", N1, {"node_id": "node-1"}),
    (C + "CommitShard", N1, {"location": "node-1"}),
    (C + "RecordCopy", N1, {"location": "shared"}),
    (C + "RecordCopy", OP, {"location": "node-7"}),
    (C + "JoinRound", Identity("rendezvous", "node-1", "c1"), {"node_id": "node-1"}),
    (C + "GetStatus", Identity("coordinator", "c0", "c1"), {}),
    (C + "Rollback", OP, {}),
    (C + "CloseJob", OP, {}),
    (A + "Kill", OP, {}),
    (A + "ReportProgress", LOCAL_IDENTITY, {}),
    (A + "CommitShard", LOCAL_IDENTITY, {}),
    (A + "GetInfo", N1, {}),
])
def test_allowed(method: str, identity: Identity, fields: dict[str, object]) -> None:
    decision = authorize(method, identity, fields, AuthzFacts(cluster="c1"))
    assert decision.allowed, decision.reason
    assert decision.unchecked == ()


def test_no_identity_is_unauthenticated() -> None:
    decision = authorize(C + "GetStatus", None, {})
    assert not decision.allowed and decision.unauthenticated
    assert decision.reason == ("an unauthenticated peer may not call GetStatus "
                               "(rule: callers over TCP present a certificate of the cluster's CA)")


def test_report_hang_only_for_own_job_membership() -> None:
    fields = {"job": "j", "node_id": "node-1"}
    method = C + "ReportHang"
    assert authorize(method, N1, fields).unchecked == (authz.JOB_MEMBERS,)
    assert authorize(method, N1, fields, AuthzFacts(job_members=frozenset({"node-1", "node-2"}))).allowed
    denied = authorize(method, N1, fields, AuthzFacts(job_members=frozenset({"node-2"})))
    assert not denied.allowed and denied.rule == "job_member"
    assert "node/node-1 may not ReportHang for job 'j': it is not a member" in denied.reason


def test_set_round_store_only_from_rank0_at_its_registered_host() -> None:
    fields = {"job": "j", "round": 4, "node_id": "node-1", "address": "host-1:29500"}
    method = C + "SetRoundStore"
    assert authorize(method, N1, fields).unchecked == (authz.ROUND_RANK0_FACT, authz.REGISTERED_HOST)
    assert authorize(method, N1, fields, AuthzFacts(round_rank0="node-1", registered_host="host-1")).allowed
    not_rank0 = authorize(method, N1, fields, AuthzFacts(round_rank0="node-0", registered_host="host-1"))
    assert not not_rank0.allowed and not_rank0.rule == "round_rank0"
    assert "may not SetRoundStore for job 'j' round 4: rank 0 is 'node-0'" in not_rank0.reason
    elsewhere = authorize(method, N1, {**fields, "address": "[::1]:1"},
                          AuthzFacts(round_rank0="node-1", registered_host="host-1"))
    assert "may not SetRoundStore at host '::1': it registered from 'host-1'" in elsewhere.reason


def test_method_labels_come_from_a_fixed_set() -> None:
    assert authz.method_label(C + "Register") == "Coordinator/Register"
    assert authz.method_label(A + "CommitShard") == "Agent/CommitShard"
    assert authz.method_label("/evil/" + "x" * 1000) == authz.UNKNOWN_LABEL


def test_authz_fields_are_the_top_level_fields_the_table_reads() -> None:
    request = checkpoint_pb2.CommitShardRequest(manifest=checkpoint_pb2.ShardManifest(job="j"), location="node-1")
    assert authz_fields(request) == {"location": "node-1"}
    assert authz_fields(coordinator_pb2.SetRoundStoreRequest(job="j", round=2)) == {
        "job": "j", "round": 2, "node_id": "", "address": ""}  # defaults are present
    assert authz_fields(None) == {}


def test_guard_counts_denials() -> None:
    seen: list[tuple[str, str]] = []
    guard = Guard(cluster="c1", on_denied=lambda method, rule: seen.append((method, rule)))
    assert guard.decide(C + "Register", N1, coordinator_pb2.RegisterRequest(node_id="node-1")).allowed
    assert not guard.decide(C + "Register", N1, coordinator_pb2.RegisterRequest(node_id="node-0")).allowed
    assert not guard.decide("/x/y", N1, None).allowed
    assert seen == [("Coordinator/Register", "node_self"), ("unknown", "unknown_method")]


def test_guard_asks_for_facts_only_when_a_rule_needs_them() -> None:
    asked: list[str] = []

    def facts(method: str, identity: Identity, fields: object) -> AuthzFacts:
        asked.append(method)
        return AuthzFacts(job_members=frozenset(), cluster="ignored: the guard's own wins")

    guard = Guard(cluster="c1", facts=facts)
    assert guard.decide(C + "GetStatus", N1, coordinator_pb2.GetStatusRequest()).allowed
    hang = coordinator_pb2.ReportHangRequest(job="j", node_id="node-1")
    assert guard.decide(C + "ReportHang", N1, hang).rule == "job_member"
    assert asked == [C + "ReportHang"]


# ---- properties ----------------------------------------------------------------------------------

text = st.text(max_size=30)
identities = st.one_of(
    st.none(),
    st.just(LOCAL_IDENTITY),
    st.builds(Identity, st.sampled_from([*KINDS, "admin", ""]), st.one_of(st.sampled_from(["node-1", "alice"]), text),
              st.sampled_from(["c1", "c2", ""])),
)
field_values = st.one_of(text, st.integers(), st.none(), st.sampled_from(["node-1", "shared", "s3"]))
requests = st.dictionaries(st.sampled_from(["node_id", "location", "job", "round", "address", "other"]),
                           field_values, max_size=5)
facts = st.builds(AuthzFacts, st.sampled_from([None, "c1"]), st.one_of(st.none(), text),
                  st.one_of(st.none(), st.frozensets(st.sampled_from(["node-1", "node-2"]))),
                  st.one_of(st.none(), st.sampled_from(["node-1", "node-2"])))


@settings(max_examples=400, deadline=None)
@given(method=st.one_of(st.sampled_from(sorted(TABLE)), text), identity=identities, fields=requests, known=facts)
def test_decisions_follow_the_table(method: str, identity: Identity | None, fields: dict[str, object],
                                    known: AuthzFacts) -> None:
    decision = authorize(method, identity, fields, known)
    assert decision.rule in RULE_NAMES
    policy = TABLE.get(method)
    if not decision.allowed:
        assert f"(rule: {next(r.text for r in authz.RULES if r.name == decision.rule)})" in decision.reason
        assert (str(identity) if identity else "an unauthenticated peer") in decision.reason
        assert decision.unauthenticated == (identity is None and policy is not None)
        return
    # whatever is allowed, the table allows
    assert policy is not None and identity is not None
    assert identity.kind in policy.kinds
    if identity.kind != LOCAL and known.cluster is not None:
        assert identity.cluster == known.cluster
    if identity.kind in authz.NODE_KINDS:
        if policy.self_field:
            value = str(fields.get(policy.self_field) or "")
            assert value == identity.name or value in policy.shared
        if authz.JOB_MEMBERS in policy.facts:
            assert known.job_members is None or identity.name in known.job_members
        if authz.ROUND_RANK0_FACT in policy.facts:
            assert known.round_rank0 is None or known.round_rank0 == identity.name
        assert set(decision.unchecked) <= set(policy.facts)
    else:
        assert decision.unchecked == ()


@given(identity=identities)
def test_operator_only_methods_are_for_operators(identity: Identity | None) -> None:
    for method, policy in TABLE.items():
        if policy.rule is authz.OPERATOR_ONLY:
            allowed = authorize(method, identity, {}).allowed
            assert allowed == (identity is not None and identity.kind == "operator")


def test_drain_by_the_node_itself_or_an_operator() -> None:
    method = C + "Drain"
    assert authorize(method, N1, {"node_id": "node-1"}).allowed
    assert authorize(method, OP, {"node_id": "node-7"}).allowed
    assert authorize(method, N1, {"node_id": "node-2"}).rule == "node_self"
    assert authorize(method, Identity("rendezvous", "node-1", "c1"), {"node_id": "node-1"}).rule == "node_only"
