"""Who may join the cluster and who may heartbeat, as pure functions of the request and the view.

:func:`validate_register` checks a registration's fields; :func:`decide_registration` decides what a
valid one does to the node's record (or why it is refused); :func:`check_heartbeat` admits the first
heartbeat of a stream. None of them changes anything: the caller commits, then applies.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors, validation
from .detector import State
from .model import NodeRecord, Role
from .view import ClusterView

ROLES = {cluster_pb2.ROLE_ACTIVE: Role.ACTIVE, cluster_pb2.ROLE_SPARE: Role.SPARE}
DRAINED = "planned hand-over"  # how the fence of a drained node begins (membership's hand-over verdict)
ADMISSION_RULE = "admission"  # the rule a drained node's registration breaks (errors.Forbidden)


@dataclass(frozen=True)
class Admitted:
    """The operator's admission of a node (``ftctl admit``): as ``active`` (it may hold a rank) or as a
    spare only, at ``at_unix_s`` (a drain after it needs a new one)."""

    node_id: str
    active: bool
    at_unix_s: float


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


def decide_registration(view: ClusterView, req: coordinator_pb2.RegisterRequest, now: float,
                        admitted: Admitted | None = None,
                        preadmitted: Collection[str] | None = None) -> Admission | errors.CoordinatorError:
    """What a validated registration does, at wall-clock time ``now``. ``admitted``: the operator's
    admission of the node (``ftctl admit``); ``preadmitted``: the nodes the coordinator's settings admit
    as active (``None``: every node, the rule before issue 20, for tests of the other rules).

    * A node asking for ACTIVE is registered as a spare unless admitted as active (by the operator or
      the settings) or already holding a rank: a newly certified node neither grows the world's target
      nor takes a rank a spare should.
    * A drained node (fenced by a planned hand-over) is refused (rule ``admission``) until an operator
      admits it again after the drain: its certificate may be why it was drained.

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
    if existing is not None and existing.fence is not None and existing.fence.reason.startswith(DRAINED) and (
            admitted is None or admitted.at_unix_s <= existing.fence.at_unix_s):
        return errors.Forbidden(ADMISSION_RULE, f"node {req.node_id} was drained ({existing.fence.reason}); it may "
                                                f"register again only once an operator admits it: 'ftctl admit "
                                                f"{req.node_id} [--spare]' (rule admission)")
    if role is Role.ACTIVE and not may_be_active(view, req.node_id, admitted, preadmitted):
        role = Role.SPARE
        message = (f"registered as spare: node {req.node_id} asked for active but is not admitted as active "
                   f"(an operator runs 'ftctl admit {req.node_id}')")
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


def may_be_active(view: ClusterView, node_id: str, admitted: Admitted | None,
                  preadmitted: Collection[str] | None) -> bool:
    """Whether ``node_id`` may register as ACTIVE: admitted so by the operator or the settings, holding a
    rank already, or registered as active before without a fence since."""
    if preadmitted is None or node_id in preadmitted or view.rank_of(node_id) >= 0:
        return True
    if admitted is not None:
        return admitted.active
    existing = view.nodes.get(node_id)
    return existing is not None and existing.fence is None and existing.requested_role is Role.ACTIVE


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
