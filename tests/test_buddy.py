"""Buddy choice: another failure domain first, spread around the ring, honest about the fallback."""

from __future__ import annotations

from ftd.agent.buddy import Peer, choose_buddy


def test_the_next_node_in_another_rack() -> None:
    peers = [Peer("a", "r1", True), Peer("b", "r1", True), Peer("c", "r2", True), Peer("d", "r2", True)]
    assert choose_buddy("a", "r1", peers).node_id == "c"
    assert choose_buddy("c", "r2", peers).node_id == "a"  # wraps around
    b = choose_buddy("d", "r2", peers)
    assert b.node_id == "a" and "another rack (r1, not r2)" in b.reason


def test_dead_nodes_are_skipped_and_fallbacks_say_so() -> None:
    peers = [Peer("a", "r1", True), Peer("b", "r1", True), Peer("c", "r2", False)]
    same = choose_buddy("a", "r1", peers)
    assert same.node_id == "b" and "no other failure domain" in same.reason
    unlabelled = choose_buddy("a", "", [Peer("b", "", True), Peer("c", "", True)])
    assert unlabelled.node_id == "b" and "no rack labels" in unlabelled.reason
    alone = choose_buddy("a", "r1", [Peer("a", "r1", True), Peer("b", "r2", False)])
    assert alone.node_id is None and "no other alive node" in alone.reason
