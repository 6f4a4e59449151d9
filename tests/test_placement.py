"""Spare choice and membership planning: pure functions, asserted on their reasons."""

from __future__ import annotations

from ftd.coordinator.detector import State, Verdict
from ftd.coordinator.model import Fence, NodeRecord, Role, World
from ftd.coordinator.placement import REPLAN_EVERY_S, choose_spare, plan, replan_due

ALIVE = Verdict(State.ALIVE, "heartbeating", 0.1)
DEAD = Verdict(State.DEAD, "no heartbeat for 2.60s", 2.6)
SUSPECT = Verdict(State.SUSPECT, "no heartbeat for 1.30s", 1.3)


def n(node_id: str, role: Role = Role.ACTIVE, rack: str | None = None, at: float = 0.0) -> NodeRecord:
    return NodeRecord(node_id, "h", role, {"rack": rack} if rack else {}, registered_unix_s=at)


def test_same_rack_spare_is_preferred() -> None:
    dead = n("a", rack="r1")
    choice = choose_spare(dead, [n("s0", Role.SPARE, "r2", 1.0), n("s1", Role.SPARE, "r1", 2.0)])
    assert choice.node_id == "s1" and "same rack (r1)" in choice.reason


def test_other_rack_when_none_matches_and_longest_registered_wins() -> None:
    choice = choose_spare(n("a", rack="r1"), [n("s1", Role.SPARE, "r2", 5.0), n("s0", Role.SPARE, "r3", 1.0)])
    assert choice.node_id == "s0" and "no spare in rack r1" in choice.reason


def test_no_spare() -> None:
    choice = choose_spare(n("a"), [])
    assert choice.node_id is None and "no alive spare" in choice.reason


def test_dead_active_node_is_fenced_and_replaced_at_its_rank() -> None:
    world = World(epoch=4, ranks=("a", "b", "c"), target_size=3)
    nodes = {x.node_id: x for x in (n("a"), n("b"), n("c"), n("s", Role.SPARE))}
    verdicts = {"a": ALIVE, "b": DEAD, "c": ALIVE, "s": ALIVE}
    p = plan(50.0, world, nodes, verdicts)
    assert p is not None and p.world is not None
    assert p.world.epoch == 5 and p.world.ranks == ("a", "s", "c")
    fenced = {x.node_id: x for x in p.nodes}["b"]
    assert fenced.fence == Fence(5, "no heartbeat for 2.60s", 50.0)
    assert "b dead, s promoted to rank 1" in p.reason
    assert [e[0] for e in p.events] == ["node_dead", "spare_promoted", "epoch_changed"]


def test_no_spare_left_shrinks_the_world_and_says_so() -> None:
    world = World(epoch=2, ranks=("a", "b"), target_size=2)
    p = plan(1.0, world, {"a": n("a"), "b": n("b")}, {"a": DEAD, "b": ALIVE})
    assert p is not None and p.world is not None
    assert p.world.ranks == ("b",) and p.world.epoch == 3 and p.world.target_size == 2
    assert p.world.degraded and "degraded: 1 of 2 ranks" in p.world.reason


def test_a_spare_arriving_restores_a_degraded_world() -> None:
    world = World(epoch=3, ranks=("b",), target_size=2)
    nodes = {"a": n("a").with_fence(Fence(3, "dead", 1.0)), "b": n("b"), "s": n("s", Role.SPARE)}
    p = plan(2.0, world, nodes, {"b": ALIVE, "s": ALIVE, "a": DEAD})
    assert p is not None and p.world is not None and p.world.ranks == ("b", "s")


def test_suspect_spares_are_not_promoted_and_suspects_not_fenced() -> None:
    world = World(epoch=1, ranks=("a",), target_size=1)
    nodes = {"a": n("a"), "s": n("s", Role.SPARE)}
    assert plan(1.0, world, nodes, {"a": SUSPECT, "s": ALIVE}) is None
    p = plan(1.0, world, nodes, {"a": DEAD, "s": SUSPECT})
    assert p is not None and p.world is not None and p.world.ranks == ()


def test_active_registrations_join_and_grow_the_target() -> None:
    p = plan(1.0, World(), {"a": n("a", at=2.0), "b": n("b", at=1.0)}, {"a": ALIVE, "b": ALIVE})
    assert p is not None and p.world is not None
    assert p.world.ranks == ("b", "a") and p.world.target_size == 2 and p.world.epoch == 1


def test_dead_spare_is_fenced_without_an_epoch_change() -> None:
    world = World(epoch=7, ranks=("a",), target_size=1)
    p = plan(1.0, world, {"a": n("a"), "s": n("s", Role.SPARE)}, {"a": ALIVE, "s": DEAD})
    assert p is not None and p.world is None
    (fenced,) = p.nodes
    assert fenced.node_id == "s" and fenced.fence is not None and fenced.fence.epoch == 7


def test_fenced_nodes_are_left_alone() -> None:
    world = World(epoch=2, ranks=("b",), target_size=1)
    nodes = {"a": n("a").with_fence(Fence(2, "dead", 1.0)), "b": n("b")}
    assert plan(1.0, world, nodes, {"a": DEAD, "b": ALIVE}) is None


def test_two_deaths_one_spare() -> None:
    world = World(epoch=1, ranks=("a", "b", "c"), target_size=3)
    nodes = {x: n(x) for x in "abc"} | {"s": n("s", Role.SPARE)}
    p = plan(1.0, world, nodes, {"a": DEAD, "b": ALIVE, "c": DEAD, "s": ALIVE})
    assert p is not None and p.world is not None
    assert p.world.ranks == ("s", "b") and p.world.epoch == 2 and p.world.degraded


def test_a_mass_failure_is_split_into_epochs_that_fit_one_transaction() -> None:
    ids = [f"n{i:03d}" for i in range(100)]
    world = World(epoch=1, ranks=tuple(ids), target_size=100)
    nodes = {i: n(i) for i in ids}
    verdicts = {i: DEAD for i in ids[:90]} | {i: ALIVE for i in ids[90:]}
    p = plan(1.0, world, nodes, verdicts, max_fences=40)
    assert p is not None and p.world is not None
    assert len(p.nodes) == 40 and len(p.world.ranks) == 60 and p.world.epoch == 2
    assert len(p.events) <= 2 * 40 + 1


def test_a_plan_that_found_nothing_is_not_run_again_for_the_same_inputs_until_its_period() -> None:
    key = (1, 7, 3, 2000, 41, (), (), ())
    assert replan_due(10.0, key, None), "after a commit (or at first) every tick plans"
    assert not replan_due(10.0 + REPLAN_EVERY_S - 0.01, key, (key, 10.0))
    assert replan_due(10.0 + REPLAN_EVERY_S, key, (key, 10.0)), "what the key leaves out waits a period at most"
    assert replan_due(10.1, (1, 7, 3, 2000, 42, (), (), ()), (key, 10.0)), "a verdict changed state: at once"
