"""Who may read a shard from this agent and who may write a memory replica into it: the agent's data
plane bound to the job's state, as the coordinator last told this node (its assignment).

The transport's table (:mod:`ftd.authz`) lets any node certificate call ``ReadShard``, ``OpenShard``,
``WriteShard`` and ``PullReplica``. That served any shard of any job to any node, and let any node
overwrite or evict another node's memory snapshots. These rules are pure functions of this node's
:class:`View` (built from its ``Assignment``: the world by rank, its buddy, the nodes whose buddy it
is, the cluster's current job, whether the coordinator records jobs with no round), the caller's
identity and the shard, returning a :class:`Verdict` whose reason names the node, job, step, rank
and rule; the service raises a denial as ``PERMISSION_DENIED`` (:class:`~.errors.PeerDenied`).

* A shard of the cluster's current job is read only by the node holding its rank in the current
  world (a promoted spare restoring it included), by the buddy of this node when the rank is this
  node's own, by any member of the world when the shard was saved by a world of another size (a
  resharded restore reads every old rank's shard), or by an operator.
* A memory replica is taken only from a node whose buddy this node is (the coordinator's choice), of
  a rank that node holds in the current world (never this node's own ranks: no node evicts another's
  snapshots of its own rank).
* A job with no round (not the current job) only when the coordinator records such jobs
  (``unmanaged_jobs``): then any registered node may read, and a node whose buddy this is may write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ftd.identity import Identity
from ftd.v1 import cluster_pb2


@dataclass(frozen=True)
class Rule:
    name: str  # stable: what denials name (and the label of ftd_agent_rpc_denied_total)
    text: str


PEER = Rule("data_peer", "only the cluster's registered nodes and operators reach a node's shards")
CURRENT_JOB = Rule("current_job", "a node serves and takes shards of the cluster's current job only (jobs with no "
                                  "round: only when the coordinator's unmanaged_jobs records them)")
READER = Rule("shard_reader", "a shard is read only by its rank's holder in the current world (a promoted spare "
                              "restoring it), the buddy of the node holding it, a member of a world of another "
                              "size resharding it, or an operator")
SOURCE = Rule("replica_source", "a memory replica comes only from a node whose buddy this node is, of a rank that "
                                "node holds in the current world")
RULES = (PEER, CURRENT_JOB, READER, SOURCE)
OPERATOR = "operator"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    rule: str  # the rule that allowed or denied (a name from RULES, or "operator" / "holder" ... when allowed)
    reason: str


@dataclass(frozen=True)
class View:
    """What this node knows of the job's state: its own id, the cluster's current job ("" none),
    the world's node ids by rank, its buddy (who keeps its replicas), the nodes whose buddy it is,
    the registered nodes it was told of, and whether jobs with no round are recorded.
    ``ranks_per_node``: its launcher's processes per node when it runs the training (0: unknown)."""

    me: str
    job: str = ""
    world: tuple[str, ...] = ()
    buddy: str = ""
    mirrors: frozenset[str] = frozenset()
    registered: frozenset[str] = frozenset()
    registered_complete: bool = False
    unmanaged: bool = False
    ranks_per_node: int = 0


def view_of(me: str, assignment: cluster_pb2.Assignment, ranks_per_node: int = 0) -> View:
    """The :class:`View` in ``me``'s assignment (the world from ``Assignment.world``, else from the
    ranks its peer listing gives)."""
    world: Sequence[str] = list(assignment.world)
    peers = assignment.peers
    if not world and assignment.world_size:
        by_rank = {p.rank: p.node_id for p in peers.addresses if p.rank >= 0}
        if assignment.rank >= 0:
            by_rank[assignment.rank] = me
        world = [by_rank.get(r, "") for r in range(assignment.world_size)]
    registered = frozenset({p.node_id for p in peers.addresses} | {n for n in world if n})
    return View(me=me, job=assignment.job, world=tuple(world), buddy=peers.buddy,
                mirrors=frozenset(peers.mirrors), registered=registered, registered_complete=peers.complete,
                unmanaged=assignment.unmanaged_jobs, ranks_per_node=ranks_per_node)


def holder(world: Sequence[str], world_size: int, rank: int) -> str | None:
    """The node holding training rank ``rank`` of a ``world_size``-rank world among ``world`` (node
    ids by node rank): torchrun numbers ranks node by node (coordinator/shard_rules.py's rule). None
    when the world size does not fit the world or the rank is out of it."""
    nodes = len(world)
    if nodes == 0 or world_size <= 0 or world_size % nodes or not 0 <= rank < world_size:
        return None
    return world[rank // (world_size // nodes)] or None



def _ok(rule: str, reason: str = "") -> Verdict:
    return Verdict(True, rule, reason)


def _deny(rule: Rule, reason: str) -> Verdict:
    return Verdict(False, rule.name, f"{reason} (rule {rule.name}: {rule.text})")


def _known(view: View, node: str) -> bool:
    return node in view.registered or node == view.buddy or node in view.mirrors


def _peer(view: View, caller: Identity | None, what: str) -> Verdict | str:
    """The caller's node name, or a verdict: operators pass, anyone else but a registered node fails."""
    if caller is not None and caller.kind == OPERATOR:
        return _ok(OPERATOR)
    if caller is None or caller.kind != "node":
        return _deny(PEER, f"{caller or 'an unauthenticated peer'} may not {what} on node {view.me}")
    if not _known(view, caller.name):
        return _deny(PEER, f"node {caller.name} may not {what} on node {view.me}: it is not a registered node this "
                           "node was told of")
    return caller.name


def may_read(view: View, caller: Identity | None, job: str, step: int, rank: int, world_size: int) -> Verdict:
    """Whether ``caller`` may read this node's copy of (job, step, rank), saved by a ``world_size``-rank
    world (the copy's own manifest says so; 0: unknown)."""
    what = f"read {job} step {step} rank {rank}"
    who = _peer(view, caller, what)
    if isinstance(who, Verdict):
        return who
    if job != view.job:
        if view.unmanaged:
            return _ok("unmanaged_job")
        return _deny(CURRENT_JOB, f"node {who} may not {what} on node {view.me}: the cluster's current job is "
                                  f"{view.job or 'none'}")
    if who not in view.world and who != view.buddy:
        return _deny(READER, f"node {who} may not {what} on node {view.me}: it holds no rank of job {job}'s "
                             "current world")
    owner = holder(view.world, world_size, rank)
    if owner == who:
        return _ok("holder")
    resized = (view.ranks_per_node > 0 and world_size != view.ranks_per_node * len(view.world)) or owner is None
    if resized and who in view.world:
        return _ok("reshard")
    if owner == view.me and who == view.buddy:
        return _ok("buddy")
    held = f"rank {rank} is held by {owner}" if owner else f"rank {rank} has no holder in the current world"
    return _deny(READER, f"node {who} may not {what} on node {view.me}: {held}")


def may_write(view: View, caller: Identity | None, job: str, step: int, rank: int, world_size: int,
              source: str = "") -> Verdict:
    """Whether ``caller`` may write its memory replica of (job, step, rank), saved by a
    ``world_size``-rank world (the header's, then the manifest's when it arrives; 0: unknown, refused
    for the current job), into this node's memory tier; ``source``: the sending node the request
    names ("" none)."""
    what = f"write the replica of {job} step {step} rank {rank}"
    if caller is not None and caller.kind == OPERATOR:
        return _deny(SOURCE, f"{caller} may not {what} into node {view.me}: replicas come from nodes")
    who = _peer(view, caller, what)
    if isinstance(who, Verdict):
        return who
    if source and source != who:
        return _deny(SOURCE, f"node {who} may not {what} into node {view.me} as {source[:100]!r}")
    if who not in view.mirrors:
        kept = ", ".join(sorted(view.mirrors)) or "no node"
        return _deny(SOURCE, f"node {who} may not {what} into node {view.me}: {view.me} keeps the replicas of "
                             f"{kept}")
    if job != view.job:
        if view.unmanaged:
            return _ok("unmanaged_job")
        return _deny(CURRENT_JOB, f"node {who} may not {what} into node {view.me}: the cluster's current job is "
                                  f"{view.job or 'none'}")
    if world_size <= 0:  # an older sender: whose rank it is cannot be told before room is made
        return _deny(SOURCE, f"node {who} may not {what} into node {view.me}: its header names no world size")
    current = view.ranks_per_node * len(view.world)
    if view.ranks_per_node > 0 and world_size != current:  # the replica's path has no world size: a claimed
        # smaller world would make one of this node's own ranks look like the sender's
        return _deny(SOURCE, f"node {who} may not {what} into node {view.me}: it names a {world_size}-rank world, "
                             f"the job's current world has {current} ranks")
    owner = holder(view.world, world_size, rank)
    if owner != who:
        held = f"rank {rank} is held by {owner}" if owner else f"rank {rank} has no holder in the current world"
        return _deny(SOURCE, f"node {who} may not {what} into node {view.me}: {held}")
    return _ok("buddy")


__all__ = ["CURRENT_JOB", "PEER", "READER", "RULES", "SOURCE", "Rule", "Verdict", "View", "holder", "may_read",
           "may_write", "view_of"]
