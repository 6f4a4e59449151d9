"""Who may call which RPC: the one authorization table of ftd, as data, and a pure decision over it.

Every method of ``ftd.v1.Coordinator`` and ``ftd.v1.Agent`` has exactly one :class:`Policy` in
:data:`TABLE` (``tests/test_authz.py`` fails for a method without one, and checks that
``docs/security.md`` shows :func:`markdown_table` unchanged). :func:`authorize` decides from the
caller's certificate identity, the request's fields and what the server knows (:class:`AuthzFacts`);
it never raises and denies whatever the table does not allow, unknown methods included. A denial's
reason names the identity and the rule, so an operator can tell a misconfiguration from an attack.
Enforcement (an interceptor around every handler) lives in :mod:`ftd.authz_interceptors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ftd.identity import LOCAL, Identity


@dataclass(frozen=True)
class Rule:
    """A rule of the table: ``name`` is the stable metric label, ``text`` what denials and docs say."""

    name: str
    text: str


UNKNOWN_METHOD = Rule("unknown_method", "methods without a rule are denied")
AUTHENTICATED = Rule("authenticated", "callers over TCP present a certificate of the cluster's CA")
SAME_CLUSTER = Rule("same_cluster", "identities act only in their own cluster")
READ = Rule("read", "identities of the cluster may read state")
NODE_ONLY = Rule("node_only", "only a node's agent (or its rendezvous handler, for rounds) acts for a node")
NODE_SELF = Rule("node_self", "nodes act only as themselves")
JOB_MEMBER = Rule("job_member", "nodes report hangs only for jobs they are members of")
ROUND_RANK0 = Rule("round_rank0", "only the round's rank 0 publishes its store, at its registered host")
OPERATOR_ONLY = Rule("operator_only", "only operators close jobs, roll back, invalidate checkpoints, forget a job's "
                                       "checkpoints, verify copies, clear GPU faults, run drills, revoke "
                                       "certificates and admit nodes")
LOCAL_ONLY = Rule("local_only", "only the training process on this node, over the agent's Unix socket")
AGENT_PEERS = Rule("agent_peers", "only the cluster's agents stream checkpoint shards to each other")
REPLICAS_ONLY = Rule("replicas_only", "only the cluster's coordinator replicas follow the leader's memory ledger")
REVOKED = Rule("revoked", "a revoked identity or certificate (ftctl certs revoke; the old one of a rotation) acts no "
                          "more, checked before the table")

RULES: tuple[Rule, ...] = (UNKNOWN_METHOD, AUTHENTICATED, SAME_CLUSTER, READ, NODE_ONLY, NODE_SELF, JOB_MEMBER,
                           ROUND_RANK0, OPERATOR_ONLY, LOCAL_ONLY, AGENT_PEERS, REPLICAS_ONLY, REVOKED)

# Kinds whose certificate speaks for one node: their ``self_field`` checks bind them to its name.
NODE_KINDS = frozenset({"node", "rendezvous"})
READERS = frozenset({"node", "rendezvous", "coordinator", "operator"})
SHARED_LOCATIONS = frozenset({"shared", "s3"})  # copy locations that name no node

# Fact checks a policy may need (``AuthzFacts`` fields): the server supplies them, or they stay unchecked.
JOB_MEMBERS = "job_members"
ROUND_RANK0_FACT = "round_rank0"
REGISTERED_HOST = "registered_host"


@dataclass(frozen=True)
class Policy:
    """Who may call one method: identity ``kinds``, else ``rule`` is broken. For node-scoped callers
    (:data:`NODE_KINDS`) the request field ``self_field`` must be their own name (or one of ``shared``),
    and the fact checks in ``facts`` apply."""

    kinds: frozenset[str]
    rule: Rule
    self_field: str = ""
    shared: frozenset[str] = frozenset()
    facts: tuple[str, ...] = ()


@dataclass(frozen=True)
class AuthzFacts:
    """What the server knows when it decides, about the request at hand. ``None`` = unknown: the check
    needing it is skipped and listed in :attr:`Decision.unchecked` (the handler must make it)."""

    cluster: str | None = None  # the server's own cluster: certificates of another one are refused
    registered_host: str | None = None  # the host the calling node registered with
    job_members: frozenset[str] | None = None  # the nodes of the request's job, current round
    round_rank0: str | None = None  # the node id of rank 0 of the request's round


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str  # a name from RULES: the metric label
    reason: str
    unchecked: tuple[str, ...] = field(default=())  # fact checks skipped because the fact was unknown

    @property
    def unauthenticated(self) -> bool:
        """Denied for want of an identity (``UNAUTHENTICATED``) rather than for the identity (``PERMISSION_DENIED``)."""
        return not self.allowed and self.rule == AUTHENTICATED.name


_C = "/ftd.v1.Coordinator/"
_A = "/ftd.v1.Agent/"
_NODE = frozenset({"node"})
_NODE_OR_RDZV = frozenset({"node", "rendezvous"})
_OPERATOR = frozenset({"operator"})
_LOCAL = frozenset({LOCAL})
_AGENT_READERS = READERS | _LOCAL

TABLE: dict[str, Policy] = {
    # ---- the coordinator: agents, rendezvous handlers, operators, over mTLS ----
    _C + "Register": Policy(_NODE, NODE_ONLY, "node_id"),
    _C + "Heartbeat": Policy(_NODE, NODE_ONLY, "node_id"),
    _C + "GetStatus": Policy(READERS, READ),
    _C + "ListNodes": Policy(READERS, READ),
    _C + "ListEvents": Policy(READERS, READ),
    _C + "CommitShard": Policy(_NODE, NODE_ONLY, "location", SHARED_LOCATIONS),
    _C + "RecordCopy": Policy(_NODE | _OPERATOR, NODE_ONLY, "location", SHARED_LOCATIONS),
    _C + "InvalidateCheckpoint": Policy(_OPERATOR, OPERATOR_ONLY),
    _C + "ListCheckpoints": Policy(READERS, READ),
    _C + "GetRestoreTarget": Policy(READERS, READ),
    _C + "Rollback": Policy(_OPERATOR, OPERATOR_ONLY),
    _C + "ForgetJob": Policy(_OPERATOR, OPERATOR_ONLY),
    _C + "JoinRound": Policy(_NODE_OR_RDZV, NODE_ONLY, "node_id"),
    _C + "GetRound": Policy(READERS, READ),
    _C + "GetGoodput": Policy(READERS, READ),
    _C + "SetRoundStore": Policy(_NODE_OR_RDZV, NODE_ONLY, "node_id", facts=(ROUND_RANK0_FACT, REGISTERED_HOST)),
    _C + "CloseJob": Policy(_OPERATOR, OPERATOR_ONLY),
    _C + "ReportHang": Policy(_NODE, NODE_ONLY, "node_id", facts=(JOB_MEMBERS,)),
    # a planned hand-over: the node's own agent (a spot notice) or an operator (ftctl drain)
    _C + "Drain": Policy(_NODE | _OPERATOR, NODE_ONLY, "node_id"),
    # the deny list (ftctl certs revoke) and who may hold a rank (ftctl admit): operators write them ...
    _C + "Revoke": Policy(_OPERATOR, OPERATOR_ONLY),
    _C + "Admit": Policy(_OPERATOR, OPERATOR_ONLY),
    # ... agents fetch the deny list to refuse revoked peers themselves
    _C + "GetDenyList": Policy(READERS, READ),
    # a standby follows the leader's memory ledger (coordinator/memory_mirror.py)
    _C + "FollowMemory": Policy(frozenset({"coordinator"}), REPLICAS_ONLY),
    # ---- the agent: its training process over the Unix socket, operators and peers over mTLS ----
    _A + "GetInfo": Policy(_AGENT_READERS, READ),
    _A + "ReportProgress": Policy(_LOCAL, LOCAL_ONLY),
    _A + "Kill": Policy(_OPERATOR, OPERATOR_ONLY),
    _A + "CommitShard": Policy(_LOCAL, LOCAL_ONLY),
    _A + "RecordCopy": Policy(_LOCAL, LOCAL_ONLY),
    _A + "InvalidateCheckpoint": Policy(_OPERATOR, OPERATOR_ONLY),
    _A + "GetRestoreTarget": Policy(_AGENT_READERS, READ),
    _A + "GetTiers": Policy(_AGENT_READERS, READ),
    _A + "VerifyCopy": Policy(_OPERATOR, OPERATOR_ONLY),
    # runs the node's health checks now (ftctl health): a measurement, no state changes
    _A + "CheckHealth": Policy(_AGENT_READERS, READ),
    # forgets the GPU faults (XIDs) that keep the node unhealthy: an operator's call
    _A + "ClearGpuFaults": Policy(_OPERATOR, OPERATOR_ONLY),
    # the peer copy path: another node's agent streams a shard copy from here ...
    _A + "ReadShard": Policy(_NODE, AGENT_PEERS),
    # ... on behalf of its own training process, which asks for it over the Unix socket
    _A + "FetchShard": Policy(_LOCAL, LOCAL_ONLY),
    # a node pushes its memory snapshots to its buddy's memory tier (the buddy records its own copy)
    _A + "WriteShard": Policy(_NODE, AGENT_PEERS),
    # the fast path of ReadShard: a one-time offer of a copy on a dedicated connection (agent.bulk_copy)
    _A + "OpenShard": Policy(_NODE, AGENT_PEERS),
    # the fast path of WriteShard: a node announces its own memory snapshot, its buddy pulls it
    _A + "PullReplica": Policy(_NODE, AGENT_PEERS, "source"),
    # the training process has its shard statements signed with the node key, and reads the CA to check them
    _A + "SignShard": Policy(_LOCAL, LOCAL_ONLY),
    _A + "GetShardTrust": Policy(_LOCAL, LOCAL_ONLY),
}

UNKNOWN_LABEL = "unknown"
# The request fields authorize() reads (top-level): what an enforcer extracts from each request.
FIELDS: tuple[str, ...] = tuple(sorted({p.self_field for p in TABLE.values() if p.self_field}
                                       | {"job", "round", "address"}))


def short_name(method: str) -> str:
    """``/ftd.v1.Coordinator/Register`` → ``Register``."""
    return method.rsplit("/", 1)[-1] or method


def method_label(method: str) -> str:
    """The metric label of a method: ``Coordinator/Register`` for a method of the table, else
    :data:`UNKNOWN_LABEL` (labels come from a fixed set whatever a client sends)."""
    if method not in TABLE:
        return UNKNOWN_LABEL
    service, name = method.strip("/").split("/")
    return f"{service.rsplit('.', 1)[-1]}/{name}"


def _who(identity: Identity | None) -> str:
    return "an unauthenticated peer" if identity is None else str(identity)


def _deny(rule: Rule, reason: str) -> Decision:
    return Decision(False, rule.name, f"{reason} (rule: {rule.text})")


def _host_of(address: object) -> str:
    host, sep, _ = str(address).rpartition(":")
    return host.strip("[]") if sep else ""


def authorize(method: str, identity: Identity | None, request_fields: Mapping[str, object],
              facts: AuthzFacts = AuthzFacts()) -> Decision:
    """Whether ``identity`` may call ``method`` (the full gRPC path) with a request holding
    ``request_fields`` (field name → value; missing fields read as empty), given ``facts``."""
    name = short_name(method)
    policy = TABLE.get(method)
    if policy is None:
        return _deny(UNKNOWN_METHOD, f"{_who(identity)} may not call {method[:200]!r}: no such method")
    if identity is None:
        return _deny(AUTHENTICATED, f"an unauthenticated peer may not call {name}")
    who = str(identity)
    if identity.kind != LOCAL and facts.cluster is not None and identity.cluster != facts.cluster:
        return _deny(SAME_CLUSTER, f"{who} of cluster {identity.cluster!r} may not call {name} in cluster "
                                   f"{facts.cluster!r}")
    if identity.kind not in policy.kinds:
        return _deny(policy.rule, f"{who} may not call {name}")
    if identity.kind not in NODE_KINDS:
        return Decision(True, policy.rule.name, f"{who} may call {name}")
    if policy.self_field:
        value = str(request_fields.get(policy.self_field, "") or "")
        if value != identity.name and value not in policy.shared:
            return _deny(NODE_SELF, f"{who} may not {name} as {value[:140]!r} ({policy.self_field})")
    unchecked: list[str] = []
    job = str(request_fields.get("job", "") or "")[:140]
    for fact in policy.facts:
        if fact == JOB_MEMBERS:
            if facts.job_members is None:
                unchecked.append(fact)
            elif identity.name not in facts.job_members:
                return _deny(JOB_MEMBER, f"{who} may not {name} for job {job!r}: it is not a member")
        elif fact == ROUND_RANK0_FACT:
            if facts.round_rank0 is None:
                unchecked.append(fact)
            elif facts.round_rank0 != identity.name:
                rnd = request_fields.get("round", "?")
                return _deny(ROUND_RANK0, f"{who} may not {name} for job {job!r} round {rnd}: rank 0 is "
                                          f"{facts.round_rank0[:140]!r}")
        elif fact == REGISTERED_HOST:
            host = _host_of(request_fields.get("address", ""))
            if facts.registered_host is None:
                unchecked.append(fact)
            elif host != facts.registered_host:
                return _deny(ROUND_RANK0, f"{who} may not {name} at host {host[:140]!r}: it registered from "
                                          f"{facts.registered_host[:140]!r}")
    return Decision(True, policy.rule.name, f"{who} may call {name}", tuple(unchecked))


# ---- the table as documentation ------------------------------------------------------------------

_FACT_TEXT = {
    JOB_MEMBERS: "a member of the job",
    ROUND_RANK0_FACT: "rank 0 of the round",
    REGISTERED_HOST: "publishing a store at its registered host",
}


def _kinds_text(kinds: frozenset[str]) -> str:
    order = ["operator", "node", "rendezvous", "coordinator", LOCAL]
    return ", ".join(k if k != LOCAL else "local (Unix socket)" for k in order if k in kinds)


def markdown_table() -> str:
    """The table as Markdown, the form ``docs/security.md`` shows (a test keeps the two equal)."""
    lines = ["| Method | Who may call | A node caller must also be | Rule for other callers |",
             "|---|---|---|---|"]
    for method, policy in TABLE.items():
        service, name = method.strip("/").split("/")
        conditions = []
        if policy.self_field:
            shared = f" (or {', '.join(f'`{s}`' for s in sorted(policy.shared))})" if policy.shared else ""
            conditions.append(f"itself in `{policy.self_field}`{shared}")
        conditions += [_FACT_TEXT[f] for f in policy.facts]
        lines.append(f"| `{service.rsplit('.', 1)[-1]}.{name}` | {_kinds_text(policy.kinds)} | "
                     f"{'; '.join(conditions) or '—'} | `{policy.rule.name}` |")
    lines += ["", "| Rule | Says |", "|---|---|"]
    lines += [f"| `{r.name}` | {r.text} |" for r in RULES]
    return "\n".join(lines) + "\n"
