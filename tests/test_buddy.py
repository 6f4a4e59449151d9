"""The coordinator's buddy choice (coordinator/buddies.py): another failure domain first, spread around
the ring, honest about the fallback; every node's at once equals each one's alone; what a node is told
of its peers, in small clusters and above the inline bound."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord
from ftd.coordinator.buddies import Buddy, Listed, Peer, choose_buddies, choose_buddy, holders, next_buddy, peers_for


def test_the_next_node_in_another_rack() -> None:
    peers = [Peer("a", "r1", True), Peer("b", "r1", True), Peer("c", "r2", True), Peer("d", "r2", True)]
    assert choose_buddy("a", "r1", peers).node_id == "c"
    assert choose_buddy("c", "r2", peers).node_id == "a"  # wraps around
    b = choose_buddy("d", "r2", peers)
    assert b.node_id == "a" and "another rack (r1, not r2)" in b.reason
    zone = choose_buddy("d", "r2", peers, domain_label="zone")
    assert zone.node_id == "a" and "another zone (r1, not r2)" in zone.reason  # the label is the coordinator's


def test_dead_nodes_are_skipped_and_fallbacks_say_so() -> None:
    peers = [Peer("a", "r1", True), Peer("b", "r1", True), Peer("c", "r2", False)]
    same = choose_buddy("a", "r1", peers)
    assert same.node_id == "b" and "no other failure domain" in same.reason
    unlabelled = choose_buddy("a", "", [Peer("b", "", True), Peer("c", "", True)])
    assert unlabelled.node_id == "b" and "no rack labels" in unlabelled.reason
    alone = choose_buddy("a", "r1", [Peer("a", "r1", True), Peer("b", "r2", False)])
    assert alone.node_id is None and "no other alive node" in alone.reason
    assert choose_buddies([Peer("a", "r1", True), Peer("b", "r2", False)]) == {"a": alone}
    assert choose_buddies([]) == {}


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["", "r1", "r2", "r3"]), st.booleans()),
                max_size=25, unique_by=lambda t: t[0]))
def test_every_nodes_buddy_at_once_is_each_nodes_alone(nodes: list[tuple[int, str, bool]]) -> None:
    peers = [Peer(f"n{i:02d}", domain, alive) for i, domain, alive in nodes]
    together = choose_buddies(peers, "rack")
    assert set(together) == {p.node_id for p in peers if p.alive}
    for p in peers:
        if p.alive:
            assert together[p.node_id] == choose_buddy(p.node_id, p.domain, peers, "rack"), p


def reference_buddy(me: str, my_domain: str, peers: list[Peer], label: str = "rack") -> Buddy:
    """The rule as first written (whole sorted ring, O(n log n) per node): the oracle of next_buddy."""
    ring = sorted((p for p in peers if p.alive and p.node_id != me), key=lambda p: p.node_id)
    if not ring:
        return Buddy(None, f"no other alive node to hold the replicas of {me}")
    after = [p for p in ring if p.node_id > me] + [p for p in ring if p.node_id < me]
    for peer in after:
        if peer.domain != my_domain or not my_domain:
            if my_domain and peer.domain:
                return Buddy(peer.node_id, f"{peer.node_id} is the next node in another {label} "
                                           f"({peer.domain}, not {my_domain})")
            break
    else:
        return Buddy(after[0].node_id, f"every other node is in {label} {my_domain}: {after[0].node_id} "
                                       "(no other failure domain)")
    return Buddy(after[0].node_id, f"{after[0].node_id} is the next node (no {label} labels to separate them)")


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["", "r1", "r2", "r3"]), st.booleans()),
                max_size=25, unique_by=lambda t: t[0]),
       st.integers(0, 31), st.sampled_from(["", "r1", "r2", "r3"]))
def test_the_buddy_of_a_node_outside_the_ring_is_found_by_search_as_by_the_whole_ring(
        nodes: list[tuple[int, str, bool]], me: int, domain: str) -> None:
    """What the leader answers a dead, fenced or newly registered node (membership.peers_of)."""
    peers = [Peer(f"n{i:02d}", d, alive) for i, d, alive in nodes]
    ring = sorted((p for p in peers if p.alive), key=lambda p: p.node_id)
    name = f"n{me:02d}"
    assert next_buddy(name, domain, ring, [p.node_id for p in ring]) == reference_buddy(name, domain, peers)


def test_thousands_of_answers_outside_the_ring_stay_cheap() -> None:
    """After a failover at 2,000 nodes every stream re-opened before the first tick (and every fenced
    node's) was answered by sorting the whole ring: ~600 fenced streams took seconds of the loop."""
    ring = [Peer(f"n{i:05d}", f"r{i // 40}", True) for i in range(10_000)]
    ids = [p.node_id for p in ring]
    began = time.process_time()
    for i in range(2_000):
        assert next_buddy(f"n{i * 5:05d}x", f"r{i // 8}", ring, ids).node_id is not None
    assert time.process_time() - began < 1.0  # generous: ~10 ms here; sorting the ring each time took ~2 s


def listed(n: int) -> dict[str, Listed]:
    return {f"n{i:03d}": Listed(f"n{i:03d}", f"10.0.{i // 250}.{i % 250}:9500", i if i < n - 2 else -1)
            for i in range(n)}


def test_a_small_cluster_is_told_every_reachable_node() -> None:
    reachable = listed(5)  # n000..n002 hold ranks 0..2, n003 and n004 are spares
    told = peers_for("n000", Buddy("n001", "why"), reachable, ["n000", "n001", "n002"])
    assert told.complete and told.buddy == Buddy("n001", "why")
    assert [p.node_id for p in told.listed] == sorted(reachable)
    assert told == peers_for("n000", Buddy("n001", "why"), reachable, ["n000", "n001", "n002"])  # equal: not resent


def test_a_large_cluster_is_told_its_buddy_its_neighbours_and_its_ranks_holders() -> None:
    reachable = listed(300)
    world = [f"n{i:03d}" for i in range(298)]
    told = peers_for("n000", Buddy("n150", "why"), reachable, world, {"n297", "n299", "s3", "gone"}, limit=256)
    # rank 0's neighbours are rank 297 (wrapping) and rank 1; the holders named that are reachable nodes
    assert not told.complete
    assert [p.node_id for p in told.listed] == ["n001", "n150", "n297", "n299"]
    spare = peers_for("n299", Buddy(None, "none"), reachable, world, (), limit=256)
    assert spare.listed == () and not spare.complete


def test_holders_are_the_locations_of_good_copies_of_that_rank() -> None:
    def record(step: int, copies: dict[int, set[CopyRef]], bad: dict[str, str] | None = None) -> CheckpointRecord:
        shards = {r: ShardRecord(r, 10, "c", (), frozenset(c), bad or {}) for r, c in copies.items()}
        return CheckpointRecord("job", step, 1, 2, "torch", 0.0, shards)

    catalog = {("job", 1): record(1, {0: {CopyRef("mem", "a"), CopyRef("mem", "b")}, 1: {CopyRef("mem", "c")}},
                                  {"mem@b": "crc mismatch"}),
               ("job", 2): record(2, {0: {CopyRef("ssd", "a"), CopyRef("s3", "s3")}}),
               ("other", 1): record(1, {0: {CopyRef("mem", "z")}})}
    assert holders(catalog, "job", 0) == {"a", "s3"}
    assert holders(catalog, "job", 1) == {"c"}
    assert holders(catalog, "job", 5) == set()
