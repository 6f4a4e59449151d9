"""The coordinator's error hierarchy, and its one translation table to gRPC status codes.

Handlers raise these; :func:`grpc_code` maps them once at the boundary (etcd's ``v3rpc/util.go``
pattern). Every message names the thing: the node, the field, the leader's address.
"""

from __future__ import annotations

import grpc


class CoordinatorError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(CoordinatorError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class NodeNotFound(CoordinatorError):
    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id!r} is not registered with this cluster; register it first")
        self.node_id = node_id


class NodeIdTaken(CoordinatorError):
    code = grpc.StatusCode.ALREADY_EXISTS


class StaleIncarnation(CoordinatorError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotLeader(CoordinatorError):
    """This replica is a standby (or a leader that could not confirm its lease)."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, replica_id: str, leader_address: str, why: str = "is a standby") -> None:
        where = f"the leader is at {leader_address}" if leader_address else "no leader is known yet"
        super().__init__(f"coordinator replica {replica_id} {why}; {where}")
        self.leader_address = leader_address


class StateUnavailable(CoordinatorError):
    """The state store (etcd) could not be reached, so the change was not made."""

    code = grpc.StatusCode.UNAVAILABLE


class StateRejected(CoordinatorError):
    """etcd refused the change itself (e.g. its database is full); nothing was written."""

    code = grpc.StatusCode.INTERNAL


class CheckpointNotFound(CoordinatorError):
    code = grpc.StatusCode.NOT_FOUND


class ShardExists(CoordinatorError):
    """A rank re-commits a step with other bytes: a step is never rewritten."""

    code = grpc.StatusCode.ALREADY_EXISTS


class CatalogConflict(CoordinatorError):
    """The change contradicts the catalog (another world size, an invalid step, a rollback target
    that is not valid)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    return exc.code if isinstance(exc, CoordinatorError) else grpc.StatusCode.INTERNAL
