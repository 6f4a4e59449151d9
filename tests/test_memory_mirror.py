"""A standby follows the leader's memory ledger (coordinator/memory_mirror.py) and answers restore
targets at once after a failover; the restore floor (coordinator/restore_floors.py) keeps an answer from
a mirror that lags the last leader from going older than what it answered. On the controller harness
(two controllers on one in-memory store and fake clock); the feed's stream is driven by hand, its
messages those gRPC carries (tests/test_memory_soft_state_e2e.py runs it over real processes)."""

from __future__ import annotations

from typing import Any

import pytest
from controller_harness import Clock, cluster, make, run
from test_memory_ledger import JOB, man, report, snap

from ftd.agent.memory_report import manifest_proto
from ftd.coordinator import errors, memory_mirror, restore_floors
from ftd.coordinator.memory_mirror import mirror_usable
from ftd.coordinator.store import MemoryStore
from ftd.v1 import checkpoint_pb2, coordinator_pb2


async def leader_and_follower() -> tuple[Any, Any, Clock, Any]:
    """c0 leads a, b (active) and s (spare, an empty memory tier) with step 10 durable; c1 is a standby
    following c0's memory ledger (the feed's stream driven by hand: its messages are what gRPC carries)."""
    clock = Clock()
    store = MemoryStore(clock=clock)
    c0 = make(store, clock, "c0")
    await cluster(c0, clock)
    for rank, node in ((0, "a"), (1, "b")):
        await c0.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
            manifest=manifest_proto(man(10, rank)), tier="ssd", location=node))
    c1 = make(store, clock, "c1")
    await c1.leadership_step()
    assert not c1.is_leader and c1._follow_target() == ("c0", c0.address)
    c0.mirror_feed.interval_s = 0.01
    return c0, c1, clock, c0.mirror_feed.follow("c1")


async def take_over(c0: Any, c1: Any, clock: Clock) -> None:
    """c0 dies (no more keep-alives): c1 campaigns once c0's lease ran out."""
    clock.advance(c0.settings.leader_ttl_s + 0.1)
    await c1.leadership_step()
    assert c1.is_leader


def step_12_on_every_node(c0: Any) -> None:
    """c0 takes step 12 from a and b (each its rank and the other's replica) and s's empty memory tier."""
    c0._take_memory("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
    c0._take_memory("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
    c0._take_memory("s", "i1", report())


def test_a_standby_following_the_leaders_memory_ledger_answers_at_once_after_a_failover() -> None:
    async def go() -> None:
        c0, c1, clock, feed = await leader_and_follower()
        c0._take_memory("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        c0._take_memory("s", "i1", report())
        c1.mirror.apply(await feed.__anext__())  # everything the leader holds
        assert set(c1.catalog.memory.reports) == {"a", "s"} and c1.mirror.source == "c0"
        c0._take_memory("b", "i1", report(snap(12, 1), snap(12, 0, owner="a"), snap(11, 0, owner="b")))
        delta = await feed.__anext__()  # what changed since: b's report, as c0 took it
        assert [r.node_id for r in delta.reports] == ["b"] and not delta.full
        assert len(delta.reports[0].report.snapshots) == 2, "the snapshot c0 refused is not forwarded"
        c1.mirror.apply(delta)
        answered = c0.catalog.restore_target(JOB)
        await c0.catalog.floors.pin(JOB, answered)
        assert answered.checkpoint.step == 12
        await take_over(c0, c1, clock)
        assert c1.catalog.memory.mirrored == {"a", "b", "s"}
        first = c1.catalog.restore_target(JOB)  # no agent has reported to c1
        assert first.checkpoint.step == 12 and first.checkpoint.on_tier["mem"] and "not counted" not in first.reason
        c1.catalog.take_report("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        assert c1.catalog.memory.mirrored == {"b", "s"}, "a node's own report replaces its mirrored one"
        await feed.aclose()

    run(go)


def test_a_mirror_lacking_the_report_behind_the_last_answer_waits_for_the_agents_up_to_the_deadline() -> None:
    """The mirror lags the leader by up to an interval: a report it missed may have made the step the last
    leader answered complete. The floor in etcd (pinned before that answer) makes the new leader wait."""
    async def go() -> None:
        c0, c1, clock, feed = await leader_and_follower()
        step_12_on_every_node(c0)
        c1.mirror.apply(await feed.__anext__())
        c0._take_memory("a", "i1", report(snap(14, 0), snap(14, 1, owner="b"), version=2))
        c0._take_memory("b", "i1", report(snap(14, 1), snap(14, 0, owner="a"), version=2))
        answered = c0.catalog.restore_target(JOB)
        await c0.catalog.floors.pin(JOB, answered)  # 14 answered; c0 dies before its next mirror message
        assert answered.checkpoint.step == 14
        assert c0.committer.require_leader().floors[JOB].step == 14
        await take_over(c0, c1, clock)
        assert c1.committer.require_leader().floors[JOB].step == 14, "the floor is read back from the store"
        with pytest.raises(errors.ReportsPending, match=r"3 node\(s\).*a, b, s"):
            c1.catalog.restore_target(JOB)  # 12 from the mirror: older than the floor
        c1.catalog.take_report("a", "i1", report(snap(14, 0), snap(14, 1, owner="b"), version=2))
        assert c1.catalog.restore_target(JOB).checkpoint.step == 14, "a's own report completes step 14"
        clock.advance(c1.catalog.memory_deadline_s)
        assert c1.catalog.restore_target(JOB).checkpoint.step == 14
        await feed.aclose()

    run(go)


def test_after_the_deadline_an_answer_older_than_the_floor_says_so_and_a_rollback_voids_the_floor() -> None:
    async def go() -> None:
        c0, c1, clock, feed = await leader_and_follower()
        step_12_on_every_node(c0)
        await c0.catalog.floors.pin(JOB, c0.catalog.restore_target(JOB))
        c0._take_memory("a", "i1", report(version=2))  # both nodes' memory went (the copies of 12 with it)
        c0._take_memory("b", "i1", report(version=2))
        c1.mirror.apply(await feed.__anext__())
        await take_over(c0, c1, clock)
        with pytest.raises(errors.ReportsPending):
            c1.catalog.restore_target(JOB)
        for _ in range(2):  # past the deadline, c1 keeping its lease
            clock.advance(c1.catalog.memory_deadline_s / 2 + 0.1)
            await c1.leadership_step()
        late = c1.catalog.restore_target(JOB)
        assert late.checkpoint.step == 10 and "older than step 12, which a leader answered before" in late.reason
        await c1.catalog.rollback(checkpoint_pb2.RollbackRequest(job=JOB, step=10))
        view = c1.committer.require_leader()
        assert restore_floors.floor_of(view.floors, JOB, view.rollbacks[JOB].at_unix_s) is None
        await feed.aclose()

    run(go)


def test_a_stale_or_partial_mirror_is_not_kept_at_an_election() -> None:
    async def go() -> None:
        c0, c1, clock, feed = await leader_and_follower()
        c0._take_memory("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        c1.mirror.apply(coordinator_pb2.MemoryMirror(leader_replica_id="c0", reports=[  # a delta, no full copy
            coordinator_pb2.MirroredReport(node_id="a", incarnation="i1", report=report(snap(12, 0)))]))
        assert not c1.catalog.memory.reports and not c1.mirror.synced
        c1.mirror.apply(await feed.__anext__())
        assert c1.mirror.synced
        clock.advance(30.0)  # the leader went silent long before it died: the copy is stale
        await take_over(c0, c1, clock)
        assert not c1.catalog.memory.reports and not c1.catalog.memory.mirrored
        with pytest.raises(errors.ReportsPending):
            c1.catalog.restore_target(JOB)
        await feed.aclose()

    run(go)


def test_the_mirror_is_usable_only_from_a_full_copy_heard_within_the_window() -> None:
    assert mirror_usable(10.0, True, 6.5, 4.0)
    assert not mirror_usable(10.0, True, 5.9, 4.0)
    assert not mirror_usable(10.0, False, 9.9, 4.0)
    assert not mirror_usable(10.0, True, 10.5, 4.0)  # heard "after" now: a clock that went back


def test_the_floor_round_trips_and_holds_only_under_the_rollback_it_was_pinned_under() -> None:
    floor = restore_floors.Floor(14, 0.0)
    assert restore_floors.decode(restore_floors.encode(floor)) == floor
    loaded, problems = restore_floors.load({"floors/llm": restore_floors.encode(floor), "floors/bad": b"{",
                                            "ckpt/x": b"{}"})
    assert loaded == {"llm": floor} and len(problems) == 1 and "floors/bad" in problems[0]
    assert restore_floors.floor_of(loaded, "llm", None) == 14
    assert restore_floors.floor_of(loaded, "llm", 5.0) is None, "a rollback since voids it"
    assert restore_floors.floor_of(loaded, "other", None) is None
    assert restore_floors.floor_wait(1.0, 0.0, 4.0, 12, 14, ["b"]) == (("b",), 3.0)
    assert restore_floors.floor_wait(1.0, 0.0, 4.0, 14, 14, ["b"]) == ((), 0.0)
    assert restore_floors.floor_wait(1.0, 0.0, 4.0, None, 14, []) == ((), 0.0), "every node reported itself"
    assert restore_floors.floor_wait(5.0, 0.0, 4.0, 12, 14, ["b"]) == ((), 0.0), "past the deadline"
    with pytest.raises(ValueError, match="step -1"):
        restore_floors.decode(b'{"step": -1}')


def test_a_full_copy_too_big_for_one_message_is_split_and_counts_only_once_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        c0, c1, _, feed = await leader_and_follower()
        for node in ("a", "b", "s"):
            c0._take_memory(node, "i1", report(snap(12, 0 if node == "a" else 1)) if node != "s" else report())
        monkeypatch.setattr(memory_mirror, "MESSAGE_BYTES", 1)  # one report per message
        first = await feed.__anext__()
        assert first.full and first.continues and len(first.reports) == 1
        c1.mirror.apply(first)
        assert not c1.mirror.synced, "a part of a full copy is not a copy"
        second = await feed.__anext__()
        assert not second.full and second.continues
        c1.mirror.apply(second)
        last = await feed.__anext__()
        assert not last.continues
        c1.mirror.apply(last)
        assert c1.mirror.synced and set(c1.catalog.memory.reports) == {"a", "b", "s"}
        await feed.aclose()

    run(go)


def test_a_feed_ends_its_followers_streams_when_the_leader_steps_down() -> None:
    async def go() -> None:
        c0, _, _, feed = await leader_and_follower()
        assert (await feed.__anext__()).full
        c0.mirror_feed.close()
        with pytest.raises(StopAsyncIteration):
            await feed.__anext__()
        assert not c0.mirror_feed.followers

    run(go)


def test_a_node_the_cluster_forgot_leaves_the_feed_too() -> None:
    """The feed keeps the newest report per node for followers; one of a node whose record was removed
    (collected after its fence) goes with it instead of staying for the leader's whole term."""
    async def go() -> None:
        c0, _c1, clock, feed = await leader_and_follower()
        step_12_on_every_node(c0)
        assert set(c0.mirror_feed.latest) == {"a", "b", "s"}
        view = c0.committer.require_leader()
        view.forget("s")
        c0.catalog.memory.gone(view, clock.now + 1.0)
        assert "s" not in c0.catalog.memory.reports and set(c0.mirror_feed.latest) == {"a", "b"}
        await feed.aclose()

    run(go)
