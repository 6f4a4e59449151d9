"""Which peer holds this node's in-memory replicas: a pure choice over the cluster's node list.

A snapshot in memory protects against a process crash; against the loss of the node it must also be
on another node, and against a rack (power, switch) on another rack. Each node picks the next alive
node after it, in node-id order, whose failure-domain label differs from its own, so buddies spread
evenly around the ring and two nodes of one rack never rely on each other while another rack exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    node_id: str
    domain: str  # the failure-domain label's value ("" when the node has none)
    alive: bool
    address: str = ""


@dataclass(frozen=True)
class Buddy:
    node_id: str | None
    reason: str


def choose_buddy(me: str, my_domain: str, peers: Sequence[Peer], domain_label: str = "rack") -> Buddy:
    """The buddy of ``me`` (``None`` when no other alive node exists), and why."""
    ring = sorted((p for p in peers if p.alive and p.node_id != me), key=lambda p: p.node_id)
    if not ring:
        return Buddy(None, f"no other alive node to hold the replicas of {me}")
    after = [p for p in ring if p.node_id > me] + [p for p in ring if p.node_id < me]
    for peer in after:
        if peer.domain != my_domain or not my_domain:
            if my_domain and peer.domain:
                return Buddy(peer.node_id, f"{peer.node_id} is the next node in another {domain_label} "
                                           f"({peer.domain}, not {my_domain})")
            break
    else:
        first = after[0]
        return Buddy(first.node_id, f"every other node is in {domain_label} {my_domain}: {first.node_id} "
                                    "(no other failure domain)")
    first = after[0]
    return Buddy(first.node_id, f"{first.node_id} is the next node (no {domain_label} labels to separate them)")
