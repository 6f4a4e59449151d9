"""Who may join the cluster and who may heartbeat, as pure functions of the request and the view.

:func:`validate_register` checks a registration's fields; :func:`decide_registration` decides what a
valid one does to the node's record (or why it is refused); :func:`check_heartbeat` admits the first
heartbeat of a stream. None of them changes anything: the caller commits, then applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors, validation
from .detector import State
from .model import NodeRecord, Role
from .view import ClusterView

ROLES = {cluster_pb2.ROLE_ACTIVE: Role.ACTIVE, cluster_pb2.ROLE_SPARE: Role.SPARE}


@dataclass(frozen=True)
class Admission:
    """A registration's outcome: the record to commit (``None``: the node is registered exactly so
    already, nothing to write) and the message for the agent and the event log."""

    record: NodeRecord | None
    message: str


def validate_register(req: coordinator_pb2.RegisterRequest) -> None:
    """Raises :class:`~.errors.InvalidArgument` naming the first malformed field (the bounds are
    :mod:`.validation`')."""
    validation.validate_register(req)


def decide_registration(view: ClusterView, req: coordinator_pb2.RegisterRequest,
                        now: float) -> Admission | errors.CoordinatorError:
    """What a validated registration does, at wall-clock time ``now``.

    * The same incarnation from the same host again: nothing (an agent retrying its call).
    * A node judged dead but not fenced yet: refused for now (retryable); it rejoins as a spare once
      its fence is committed.
    * Another host claiming the id of a live node: refused.
    * A fenced node: rejoins as a spare, whatever it asked for, and never in its old epoch.
    * A node that still holds a rank (a restarted agent): keeps it, and its registration time, so
      spare choice keeps treating it as the proven node it is.
    """
    existing = view.nodes.get(req.node_id)
    role = ROLES[req.role]
    message = f"registered as {role.value}"
    registered_at = now
    if existing is not None:
        verdict = view.verdicts.get(req.node_id)
        if not existing.fenced and existing.incarnation == req.incarnation and existing.host == req.host:
            return Admission(None, "already registered")
        if not existing.fenced and verdict is not None and verdict.state is State.DEAD:
            return errors.NodeBeingFenced(req.node_id, verdict.reason)
        if not existing.fenced and existing.host != req.host and view.is_live(req.node_id):
            return errors.NodeIdTaken(f"node id {req.node_id!r} is held by a live node on host {existing.host!r} "
                                      f"(registration came from host {req.host!r})")
        if existing.fence is not None:
            role = Role.SPARE
            message = (f"node {req.node_id} was fenced at epoch {existing.fence.epoch} "
                       f"({existing.fence.reason}); it rejoins as a spare in epoch {view.world.epoch}")
        elif view.rank_of(req.node_id) >= 0:
            message = f"re-registered; keeps rank {view.rank_of(req.node_id)} in epoch {view.world.epoch}"
            registered_at = existing.registered_unix_s
    record = NodeRecord(
        node_id=req.node_id, host=req.host, requested_role=role, labels=dict(req.labels),
        agent_address=req.agent_address, pid=req.pid, incarnation=req.incarnation, registered_unix_s=registered_at,
    )
    return Admission(record, message)


def check_heartbeat(view: ClusterView, req: coordinator_pb2.HeartbeatRequest) -> NodeRecord:
    """The registered record the first heartbeat of a stream speaks for, or why it may not."""
    validation.validate_heartbeat(req)
    node = view.nodes.get(req.node_id)
    if node is None:
        raise errors.NodeNotFound(req.node_id)
    if req.incarnation != node.incarnation:
        raise errors.StaleIncarnation(
            f"node {req.node_id}: heartbeat from incarnation {req.incarnation!r}, but the registered "
            f"incarnation is {node.incarnation!r}; re-register")
    return node
