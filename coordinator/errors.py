"""The coordinator's error hierarchy, and its one translation table to gRPC status codes.

Handlers raise these; :func:`grpc_code` maps them once at the boundary (etcd's ``v3rpc/util.go``
pattern), so the classes say what happened and only :data:`GRPC_CODES` says how a client sees it.
Every message names the thing: the node, the job, the field, the leader's address.
"""

from __future__ import annotations

from typing import Protocol

import grpc


class NamesField(Protocol):
    """A validator's error whose message already reads ``"<field>: <why>"`` (``BadIdentifier``)."""

    field: str


class CoordinatorError(Exception):
    """Base of every error a handler raises on purpose; anything else is a bug (INTERNAL)."""


class InvalidArgument(CoordinatorError):
    """A request field is malformed; ``field`` names it (``manifest.step``)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field

    @classmethod
    def naming(cls, exc: NamesField, within: str = "") -> InvalidArgument:
        """A validator's error, its field nested under ``within`` (``"manifest."``); the message is
        reused whole rather than parsed apart."""
        err = cls(within + exc.field, "")
        err.args = (f"{within}{exc}",)
        return err


class NodeNotFound(CoordinatorError):
    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id!r} is not registered with this cluster; register it first")
        self.node_id = node_id


class NodeIdTaken(CoordinatorError):
    """Another live node, on another host, holds the id."""


class NodeBeingFenced(CoordinatorError):
    """The node was declared dead and its fence is not committed yet: it may rejoin shortly."""

    def __init__(self, node_id: str, why: str) -> None:
        super().__init__(f"node {node_id!r} was declared dead ({why}) and is being fenced; "
                         "retry shortly to rejoin as a spare")
        self.node_id = node_id


class StaleIncarnation(CoordinatorError):
    """A request from a process that is no longer the node's registered incarnation."""


class NotLeader(CoordinatorError):
    """This replica is a standby (or a leader that could not confirm its lease)."""

    def __init__(self, replica_id: str, leader_address: str, why: str = "is a standby") -> None:
        where = f"the leader is at {leader_address}" if leader_address else "no leader is known yet"
        super().__init__(f"coordinator replica {replica_id} {why}; {where}")
        self.leader_address = leader_address


class ReportsPending(CoordinatorError):
    """A new leader has not heard every alive node's memory report yet (memory snapshots are soft
    state, re-announced after a failover): a restore target now could name an older step than the last
    leader did. Retryable, for at most ``memory_report_deadline_s`` after the election."""

    def __init__(self, job: str, waiting: tuple[str, ...], left_s: float, leader_address: str = "") -> None:
        more = f" and {len(waiting) - 10} more" if len(waiting) > 10 else ""
        super().__init__(f"job {job}: this leader waits for the memory reports of {len(waiting)} node(s) of the "
                         f"job's world ({', '.join(waiting[:10])}{more}) before it names a restore target; retry "
                         f"(at most {max(left_s, 0.0):.1f}s more)")
        self.job, self.waiting, self.leader_address = job, waiting, leader_address


class StateUnavailable(CoordinatorError):
    """The state store (etcd) could not be reached, so the change was not made."""


class CommitGuardFailed(StateUnavailable):
    """etcd refused a commit on its guard (this replica's lease no longer leads, or the world changed
    since it was read): nothing was written, and the leader re-checks its lease and reloads. Retryable
    like an unreachable etcd, which is why it is one (a caller's retry reaches the leader of then)."""


class StateRejected(CoordinatorError):
    """etcd refused the change itself (its database is full: the NOSPACE alarm; a transaction over
    ``--max-txn-ops``); nothing was written. Resending it unchanged does not help until an operator
    frees space (compact, defragment, ``etcdctl alarm disarm``)."""


class RateLimited(CoordinatorError):
    """A node sent writes faster than its per-node rate limit; nothing was done."""


class TooMany(CoordinatorError):
    """A cap on stored records was reached (jobs, catalog jobs); nothing was written."""


class CheckpointNotFound(CoordinatorError):
    """The catalog has no such step (or no such committed rank of it)."""

    def __init__(self, job: str, step: int, rank: int | None = None) -> None:
        what = f"job {job} has no checkpoint at step {step}" if rank is None else \
            f"step {step} of job {job} has no committed rank {rank}"
        super().__init__(what)
        self.job, self.step, self.rank = job, step, rank


class NoCheckpoints(CheckpointNotFound):
    """The catalog holds no record of the job at all."""

    def __init__(self, job: str) -> None:
        CoordinatorError.__init__(self, f"the catalog holds no checkpoint of job {job}")
        self.job, self.step, self.rank = job, -1, None


class ShardExists(CoordinatorError):
    """A rank re-commits a step with other bytes: a step is never rewritten."""


class CatalogConflict(CoordinatorError):
    """The change contradicts the catalog (another world size, an invalid step, a rollback target
    that is not valid)."""


class JobNotFound(CoordinatorError):
    """No node has joined a round of the job yet."""

    def __init__(self, job: str) -> None:
        super().__init__(f"job {job} has not rendezvoused yet")
        self.job = job


class RoundConflict(CoordinatorError):
    """The request is about a round that is over, or comes from a node that may not make it."""

    def __init__(self, job: str, why: str) -> None:
        super().__init__(why)
        self.job = job


class Forbidden(CoordinatorError):
    """A node asked for what the job's state does not let it do (a rank it does not hold, another
    epoch's shard): ``rule`` names the rule (coordinator/shard_rules.py), the message says why."""

    def __init__(self, rule: str, why: str) -> None:
        super().__init__(why)
        self.rule = rule


class NodeFenced(CoordinatorError):
    """The node was removed from the world; what was asked of it (a drain) no longer applies."""

    def __init__(self, node_id: str, what: str) -> None:
        super().__init__(f"node {node_id} is already fenced; {what}")
        self.node_id = node_id


GRPC_CODES: dict[type[CoordinatorError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NodeNotFound: grpc.StatusCode.NOT_FOUND,
    NodeIdTaken: grpc.StatusCode.ALREADY_EXISTS,
    NodeBeingFenced: grpc.StatusCode.UNAVAILABLE,  # retryable: the agent backs off and registers again
    StaleIncarnation: grpc.StatusCode.FAILED_PRECONDITION,
    NotLeader: grpc.StatusCode.UNAVAILABLE,
    StateUnavailable: grpc.StatusCode.UNAVAILABLE,
    ReportsPending: grpc.StatusCode.UNAVAILABLE,  # retryable: the agents re-announce within seconds
    StateRejected: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RateLimited: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TooMany: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CheckpointNotFound: grpc.StatusCode.NOT_FOUND,
    ShardExists: grpc.StatusCode.ALREADY_EXISTS,
    CatalogConflict: grpc.StatusCode.FAILED_PRECONDITION,
    JobNotFound: grpc.StatusCode.NOT_FOUND,
    RoundConflict: grpc.StatusCode.FAILED_PRECONDITION,
    NodeFenced: grpc.StatusCode.FAILED_PRECONDITION,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
}


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status a client sees: the nearest class in :data:`GRPC_CODES`, else INTERNAL."""
    for cls in type(exc).__mro__:
        if issubclass(cls, CoordinatorError) and cls in GRPC_CODES:
            return GRPC_CODES[cls]
    return grpc.StatusCode.INTERNAL
