"""The peers this node was told about: the buddy the coordinator chose for it and the agent addresses
it needs, both from its assignment (``Assignment.peers``, pushed when they change; see
``coordinator/buddies.py``). Nothing here lists the cluster: the replicator, the peer copy path and
the RTT probes read the latest assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftd.v1 import cluster_pb2


@dataclass(frozen=True)
class Peer:
    node_id: str
    address: str  # its agent's HOST:PORT ("" when unknown)
    alive: bool = True  # False: the coordinator named no address for it (dead, fenced, or not listed)
    rank: int = -1


@dataclass(frozen=True)
class Buddy:
    node_id: str | None  # None: no other alive node (or no assignment yet)
    reason: str
    address: str = ""


def address_of(assignment: cluster_pb2.Assignment, node_id: str) -> str:
    """The agent address of ``node_id`` as the coordinator last told it, "" when it named none (the
    node is dead, fenced or unknown, or, above 256 nodes, not one this node needs)."""
    for peer in assignment.peers.addresses:
        if peer.node_id == node_id:
            return peer.agent_address
    return ""


def buddy_of(assignment: cluster_pb2.Assignment) -> Buddy:
    """The node holding this node's in-memory replicas, why, and its agent address."""
    if not assignment.HasField("peers"):
        return Buddy(None, "no buddy chosen yet (no answer from the coordinator's leader)")
    told = assignment.peers
    if not told.buddy:
        return Buddy(None, told.buddy_reason or "the coordinator chose no buddy")
    return Buddy(told.buddy, told.buddy_reason, address_of(assignment, told.buddy))


def ranked(me: str, assignment: cluster_pb2.Assignment) -> list[Peer]:
    """The world in rank order (``[r]`` holds rank r) as node ``me`` was told it, each with its
    address; a rank the assignment names no address for is not alive."""
    by_rank = {p.rank: p for p in assignment.peers.addresses if p.rank >= 0}
    world = list(assignment.world)
    out: list[Peer] = []
    for rank in range(assignment.world_size):
        listed = by_rank.get(rank)
        if rank == assignment.rank:
            out.append(Peer(me, "", True, rank))
        elif listed is not None:
            out.append(Peer(listed.node_id, listed.agent_address, bool(listed.agent_address), rank))
        else:
            out.append(Peer(world[rank] if rank < len(world) else f"rank-{rank}", "", False, rank))
    return out
