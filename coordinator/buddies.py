"""Which node holds each node's in-memory replicas (its buddy), and which agents' addresses a node is
told: pure functions over the leader's view, pushed to the agents in their assignments.

A snapshot in memory protects against a process crash; against the loss of the node it must also be
on another node, and against a rack (power, switch) on another rack. Each node's buddy is the next
alive node after it, in node-id order, whose failure-domain label (the coordinator's
``domain_label``) differs from its own, so buddies spread evenly around the ring and two nodes of one
rack never rely on each other while another rack exists. The leader chooses for every node in one pass
over the ring (:func:`choose_buddies`), so every agent acts on one picture and none lists the cluster.

What else a node is told (:func:`peers_for`): the agent addresses of the nodes it may dial. In a
cluster of at most :data:`INLINE_PEERS_MAX` reachable nodes, all of them (a spare may pull any rank's
copy, a replicated restore any other rank's); above, only its buddy, its rank neighbours (the RTT
probes) and the nodes holding copies of its own rank's shards, so the answers stay O(1) per node.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ftd.checkpoints.catalog import Catalog
from ftd.v1 import cluster_pb2

INLINE_PEERS_MAX = 256  # as the world (view.INLINE_WORLD_MAX): above, a node is told only its own peers


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


@dataclass(frozen=True)
class Listed:
    """A node as another node is told of it: its agent address and its rank (-1: not in the world)."""

    node_id: str
    address: str
    rank: int


@dataclass(frozen=True)
class PeerSet:
    """What one node is told (``Assignment.peers``); equal values need not be sent again."""

    buddy: Buddy
    listed: tuple[Listed, ...]  # in node id order
    complete: bool
    mirrors: tuple[str, ...] = ()  # the nodes whose buddy it is (the only sources of its replicas)


def choose_buddy(me: str, my_domain: str, peers: Sequence[Peer], domain_label: str = "rack") -> Buddy:
    """The buddy of ``me`` (``None`` when no other alive node exists), and why."""
    ring = sorted((p for p in peers if p.alive), key=lambda p: p.node_id)
    return next_buddy(me, my_domain, ring, [p.node_id for p in ring], domain_label)


def next_buddy(me: str, my_domain: str, ring: Sequence[Peer], ids: Sequence[str], domain_label: str = "rack") -> Buddy:
    """:func:`choose_buddy` on a ring of alive peers already sorted by node id (``ids``: their ids, for
    the search): O(log n) to find where ``me`` would be, then only as far as the first node of another
    domain. The leader answers a node outside its chosen ring (dead, fenced, registered since the last
    tick) with it: thousands of such answers after a failover cost milliseconds, not seconds."""
    n = len(ring)
    start = bisect.bisect_right(ids, me)
    after = (p for p in (ring[(start + i) % n] for i in range(n)) if p.node_id != me)
    first = next(after, None)
    if first is None:
        return Buddy(None, f"no other alive node to hold the replicas of {me}")
    for peer in itertools.chain((first,), after):
        if peer.domain != my_domain or not my_domain:
            if my_domain and peer.domain:
                return Buddy(peer.node_id, f"{peer.node_id} is the next node in another {domain_label} "
                                           f"({peer.domain}, not {my_domain})")
            break
    else:
        return Buddy(first.node_id, f"every other node is in {domain_label} {my_domain}: {first.node_id} "
                                    "(no other failure domain)")
    return Buddy(first.node_id, f"{first.node_id} is the next node (no {domain_label} labels to separate them)")


def choose_buddies(peers: Iterable[Peer], domain_label: str = "rack") -> dict[str, Buddy]:
    """:func:`choose_buddy` of every alive peer at once, in O(n log n) rather than O(n² log n): for
    each position of the sorted ring, the first later position (wrapping) in another domain."""
    ring = sorted((p for p in peers if p.alive), key=lambda p: p.node_id)
    n = len(ring)
    if n == 1:
        return {ring[0].node_id: choose_buddy(ring[0].node_id, ring[0].domain, ring, domain_label)}
    domains = [p.domain for p in ring]
    other = [-1] * n  # other[k]: the first index after k (wrapping) whose domain differs from k's; -1: none
    for i in range(2 * n - 2, -1, -1):  # twice round, backwards: the second pass sees across the wrap
        k, j = i % n, (i + 1) % n
        other[k] = j if domains[j] != domains[k] else other[j]
    chosen: dict[str, Buddy] = {}
    for k, me in enumerate(ring):
        first = ring[(k + 1) % n]
        found = ring[other[k]] if other[k] >= 0 else None
        if not me.domain or (found is not None and not found.domain):
            chosen[me.node_id] = Buddy(first.node_id, f"{first.node_id} is the next node (no {domain_label} "
                                                      "labels to separate them)")
        elif found is None:
            chosen[me.node_id] = Buddy(first.node_id, f"every other node is in {domain_label} {me.domain}: "
                                                      f"{first.node_id} (no other failure domain)")
        else:
            chosen[me.node_id] = Buddy(found.node_id, f"{found.node_id} is the next node in another {domain_label} "
                                                      f"({found.domain}, not {me.domain})")
    return chosen


def mirrored_by(chosen: Mapping[str, Buddy]) -> dict[str, tuple[str, ...]]:
    """The inverse of :func:`choose_buddies`: buddy -> the nodes whose replicas it keeps (sorted)."""
    out: dict[str, list[str]] = {}
    for node_id, buddy in sorted(chosen.items()):
        if buddy.node_id is not None:
            out.setdefault(buddy.node_id, []).append(node_id)
    return {k: tuple(v) for k, v in out.items()}


def holders(catalog: Catalog, job: str, rank: int) -> set[str]:
    """The locations (node ids, and shared names such as ``s3``) of the good copies of ``rank``'s
    shards of ``job`` that the catalog records."""
    found: set[str] = set()
    for (j, _), record in catalog.items():
        shard = record.shards.get(rank) if j == job else None
        if shard is not None:
            found.update(c.location for c in shard.good_copies())
    return found


def peers_for(node_id: str, buddy: Buddy, reachable: Mapping[str, Listed], world: Sequence[str],
              rank_holders: Iterable[str] = (), limit: int = INLINE_PEERS_MAX,
              every: tuple[Listed, ...] | None = None) -> PeerSet:
    """What ``node_id`` is told: ``reachable`` the nodes not dead nor fenced that have an agent
    address; ``world`` the node ids by rank; ``rank_holders`` where copies of its rank's shards are
    (:func:`holders`). Up to ``limit`` reachable nodes every one is listed (``every``: the same
    listing precomputed, shared by all nodes); above, the buddy, the rank neighbours and the holders."""
    if len(reachable) <= limit:
        return PeerSet(buddy, every if every is not None else tuple(reachable[n] for n in sorted(reachable)), True)
    wanted = set(rank_holders)
    if buddy.node_id is not None:
        wanted.add(buddy.node_id)
    me = reachable.get(node_id)
    if me is not None and 0 <= me.rank < len(world):
        wanted.update((world[(me.rank - 1) % len(world)], world[(me.rank + 1) % len(world)]))
    wanted.discard(node_id)
    return PeerSet(buddy, tuple(reachable[n] for n in sorted(wanted) if n in reachable), False)


def peers_proto(peers: PeerSet) -> cluster_pb2.Peers:
    return cluster_pb2.Peers(
        buddy=peers.buddy.node_id or "", buddy_reason=peers.buddy.reason, complete=peers.complete,
        mirrors=peers.mirrors,
        addresses=[cluster_pb2.PeerAddress(node_id=p.node_id, agent_address=p.address, rank=p.rank)
                   for p in peers.listed])
