"""The control loop on the in-memory store with a hand-moved clock: registration, detection,
promotion, failover grace, and never acting on state that could not be committed; drains, health and
buddies in the assignment. What the leader stores and bounds (the catalog, jobs, corrupt records, NOSPACE,
rate limits, pagination, error codes): test_controller_state.py. The driver: controller_harness.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from controller_harness import WALL, Clock, cluster, hb, make, reg, run, step

from ftd.coordinator import errors
from ftd.coordinator.control import Controller
from ftd.coordinator.store import MemoryStore
from ftd.coordinator.view import ClusterView
from ftd.v1 import cluster_pb2, coordinator_pb2


def test_register_heartbeat_kill_promote() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        assert store.world.ranks == ("a", "b") and store.world.epoch == 1
        writes = store.writes
        await step(ctl, clock, ("a", "b", "s"), n=20)  # 2 s of heartbeats: no etcd write at all
        assert store.writes == writes
        ctl.membership.close_stream(ctl.membership.streams["a"])  # a is SIGKILLed: its socket closes
        await step(ctl, clock, ("b", "s"), n=16)
        assert store.world.epoch == 2 and store.world.ranks == ("s", "b")
        assert store.nodes["a"].fence is not None and store.nodes["a"].fence.epoch == 2
        # Records carry the injected wall clock: the fence and the world of the same commit, the spare's
        # registration 6 s after the test clock's start.
        assert store.nodes["a"].fence.at_unix_s == store.world.changed_unix_s
        assert WALL + 1006 < store.world.changed_unix_s <= WALL + clock.now
        assert store.nodes["s"].registered_unix_s == pytest.approx(WALL + 1006.0)
        status = ctl.status()
        assert list(status.dead) == ["a"] and list(status.world) == ["s", "b"]
        infos = {n.node_id: n for n in ctl.nodes().nodes}
        assert infos["a"].state == cluster_pb2.NODE_STATE_FENCED

        # The fenced node's agent comes back: it rejoins only as a spare.
        resp = await ctl.membership.register(reg("a", inc="i2"))
        assert resp.assignment.role == cluster_pb2.ROLE_SPARE and resp.assignment.rank == -1
        assert "rejoins as a spare" in resp.message
        assert store.world.ranks == ("s", "b")
        await ctl.stop()

    run(scenario)


def test_nothing_is_acted_on_while_the_store_is_unreachable() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        store.available = False
        ctl.membership.close_stream(ctl.membership.streams["a"])
        await step(ctl, clock, ("b", "s"), n=30)  # 3 s: a is dead, but nothing can be committed
        view = ctl.committer.view
        assert view is not None
        assert view.world.epoch == 1 and view.world.ranks == ("a", "b"), "acted without a commit"
        assert view.nodes["a"].fence is None
        await step(ctl, clock, ("b", "s"), n=20)  # past the lease TTL: the leader suspends itself
        assert ctl.committer.suspended and not ctl.is_leader and not ctl.membership.streams
        with pytest.raises(errors.NotLeader, match="cannot confirm its leadership"):
            await ctl.membership.register(reg("c"))
        assert store.world.epoch == 1 and store.nodes["a"].fence is None
        store.available = True
        await step(ctl, clock, n=10)  # keep-alive succeeds: leadership resumes, state reloaded
        assert ctl.is_leader and ctl.status().etcd_reachable
        await step(ctl, clock, ("b", "s"), n=20)  # agents reconnect; a's grace still runs
        assert store.world.epoch == 1
        await step(ctl, clock, ("b", "s"), n=40)  # grace over: a, silent all along, is replaced
        assert store.world.ranks == ("s", "b") and store.world.epoch == 2
        await ctl.stop()

    run(scenario)


def test_new_leader_gives_grace_and_old_leader_cannot_commit() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        old = make(store, clock, "c0")
        await cluster(old, clock)
        lease = old.committer.lease
        assert lease is not None
        clock.advance(4.0)  # the old leader stops refreshing: its lease (ttl 3 s) expires
        new = make(store, clock, "c1")
        await new.leadership_step()
        assert new.is_leader
        # Nobody heartbeats to the new leader yet: grace protects every node.
        await step(new, clock, n=45)
        assert store.world.epoch == 1 and all(n.fence is None for n in store.nodes.values())
        # Agents reconnect within the grace period.
        await step(new, clock, ("a", "b", "s"), n=20)
        assert store.world.epoch == 1 and all(n.fence is None for n in store.nodes.values())
        # The deposed leader still believes it leads; its commits are refused by the guard.
        old.committer.view.liveness["b"].last_seen -= 100  # type: ignore[union-attr]
        await old.tick()
        assert store.world.epoch == 1
        await old.leadership_step()
        assert not old.is_leader
        with pytest.raises(errors.NotLeader) as err:
            old.committer.require_leader()
        assert err.value.leader_address == ""  # a stepped-down leader points nowhere until it polls
        await old.leadership_step()
        assert old.leader_address() == new.address
        await new.stop()
        await old.stop()

    run(scenario)


def test_a_leader_that_cannot_confirm_its_lease_stops_leading_before_the_lease_can_expire() -> None:
    """The lease (ttl 3 s) stays ours for 3 s after a confirmed keep-alive; the leader stops leading
    2.5 s after it, whether the keep-alive fails fast or hangs, so that no standby (which can only
    campaign after the expiry) ever leads at the same time."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        await ctl.leadership_step()  # confirmed now
        store.available = False
        clock.advance(2.0)
        await ctl.leadership_step()
        assert ctl.is_leader, "2 s unconfirmed: still inside the trusted part of the lease"
        clock.advance(0.6)
        await ctl.leadership_step()
        assert not ctl.is_leader and ctl.committer.lease is not None  # 2.6 s: stopped, lease still held
        with pytest.raises(errors.NotLeader, match="cannot confirm"):
            ctl.committer.require_leader()
        store.available = True
        await ctl.leadership_step()
        assert ctl.is_leader  # confirmed again before anyone else could take it: leads again
        # A keep-alive that hangs is not waited out past the trusted part of the lease.
        hung = threading.Event()
        real = store.keep_alive

        def hang(lease: Any) -> bool:
            hung.wait(5.0)
            return real(lease)

        store.keep_alive = hang  # type: ignore[method-assign]
        clock.advance(2.6)
        started = time.monotonic()
        await ctl.leadership_step()
        assert not ctl.is_leader and time.monotonic() - started < 2.0
        hung.set()
        await ctl.stop()

    run(scenario)


def test_registration_conflicts() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        with pytest.raises(errors.NodeIdTaken, match=r"held by a live node on host '10\.0\.0\.1'"):
            await ctl.membership.register(reg("a", host="10.0.0.99", inc="x"))
        again = await ctl.membership.register(reg("a"))
        assert again.message == "already registered"
        restarted = await ctl.membership.register(reg("b", inc="i9"))  # same host, new incarnation: keeps its rank
        assert restarted.assignment.rank == 1 and "keeps rank 1" in restarted.message
        with pytest.raises(errors.StaleIncarnation, match="re-register"):
            ctl.membership.open_stream(coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="old"))
        with pytest.raises(errors.InvalidArgument) as err:
            stale = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="old")
            ctl.membership.on_heartbeat(ctl.membership.streams["a"], stale)
        assert err.value.field == "incarnation"
        with pytest.raises(errors.NodeNotFound, match="'ghost'"):
            ctl.membership.open_stream(coordinator_pb2.HeartbeatRequest(node_id="ghost", incarnation="x"))
        await ctl.stop()

    run(scenario)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("node_id", {"node_id": ""}),
        ("node_id", {"node_id": "../../etc"}),
        ("host", {"host": ""}),
        ("role", {"role": 0}),
        ("labels", {"labels": {"bad key": "x"}}),
        ("agent_address", {"agent_address": "nowhere"}),
        ("pid", {"pid": -3}),
        ("incarnation", {"incarnation": ""}),
    ],
)
def test_malformed_registration_names_the_field(field: str, change: dict[str, object]) -> None:
    from ftd.coordinator.admission import validate_register

    req = reg("a")
    for key, value in change.items():
        if key == "labels":
            req.labels.update(value)  # type: ignore[arg-type]
        else:
            setattr(req, key, value)
    with pytest.raises(errors.InvalidArgument) as err:
        validate_register(req)
    assert err.value.field == field


def test_grace_ends_for_a_node_once_it_heartbeats_to_the_new_leader() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        old = make(store, clock, "c0")
        await cluster(old, clock)
        await old.stop()  # resigns: the standby campaigns at once
        new = make(store, clock, "c1")
        await new.leadership_step()
        assert new.is_leader
        await step(new, clock, ("a", "b", "s"), n=3)  # everyone reconnects within the grace period
        new.membership.close_stream(new.membership.streams["b"])  # then b dies, still inside the 5 s grace
        await step(new, clock, ("a", "s"), n=20)
        assert store.world.epoch == 2 and store.world.ranks == ("a", "s"), "b must not hide behind the grace"
        await new.stop()

    run(scenario)


def test_mass_failure_commits_in_several_epochs_within_etcd_txn_limits() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await ctl.leadership_step()
        ids = [f"n{i:03d}" for i in range(150)]
        for i in ids:
            await ctl.membership.register(reg(i))
        await step(ctl, clock, tuple(ids), n=60)
        assert len(store.world.ranks) == 150
        first = store.world.epoch
        for i in ids[:120]:  # a whole row of racks loses power
            ctl.membership.close_stream(ctl.membership.streams[i])
        await step(ctl, clock, tuple(ids[120:]), n=25)
        assert store.world.ranks == tuple(ids), "120 of 150 silent at once: a mass silence, held first"
        await step(ctl, clock, tuple(ids[120:]), n=110)  # past the 10 s hold: the still silent are declared
        assert store.world.ranks == tuple(ids[120:])
        assert all(store.nodes[i].fence is not None for i in ids[:120])
        assert store.world.epoch - first == 3, "120 fences at 40 per transaction: three epochs"
        await ctl.stop()

    run(scenario)


def hb_health(ctl: Controller, node_id: str, healthy: bool, reason: str = "", checked: float = 0.0) -> None:
    verdict = cluster_pb2.HealthVerdict(healthy=healthy, reason=reason, checked_unix_s=checked)
    req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation="i1", seq=2,
                                           health=cluster_pb2.Health(verdict=verdict))
    ctl.membership.on_heartbeat(ctl.membership.streams[node_id], req)


def test_drain_hands_the_rank_over_as_planned() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        epoch = store.world.epoch
        resp = await ctl.drains.drain(coordinator_pb2.DrainRequest(node_id="b", reason="aws spot terminate notice",
                                                                   deadline_unix_s=WALL + clock.now + 120))
        assert resp.accepted and "pending" in resp.message
        # Without a training job there is no final checkpoint to wait for: the next tick hands over.
        await step(ctl, clock, ("a", "b", "s"))
        assert store.world.epoch == epoch + 1 and store.world.ranks == ("a", "s")
        assert store.world.handed_over == ("b",) and "b handed over, s promoted to rank 1" in store.world.reason
        fence = store.nodes["b"].fence
        assert fence is not None and "planned hand-over (aws spot terminate notice)" in fence.reason
        kinds = [e.kind for e in store.events.values()]
        assert "node_handed_over" in kinds and "node_dead" not in kinds
        assert not ctl.committer.require_leader().drains and not any(k.startswith("drains/") for k in store.kv)
        assert ctl.metrics.handovers._value.get() == 1
        with pytest.raises(errors.NodeFenced, match="node b is already fenced"):
            await ctl.drains.drain(coordinator_pb2.DrainRequest(node_id="b"))
        with pytest.raises(errors.NodeNotFound):
            await ctl.drains.drain(coordinator_pb2.DrainRequest(node_id="ghost"))
        with pytest.raises(errors.InvalidArgument, match="node_id"):
            await ctl.drains.drain(coordinator_pb2.DrainRequest(node_id="../x"))

    run(scenario)


def test_a_pending_drain_is_pushed_and_survives_a_new_leader() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        view = ctl.committer.require_leader()
        # Pretend a job runs so the hand-over waits for its final checkpoint.
        from ftd.coordinator import rendezvous

        view.jobs["j"] = rendezvous.JobState("j", members=("a", "b"), epoch=store.world.epoch)
        await ctl.drains.drain(coordinator_pb2.DrainRequest(node_id="b", reason="ftctl drain"))
        await step(ctl, clock, ("a", "b", "s"), n=3)
        assert store.world.ranks == ("a", "b"), "waits for the final checkpoint"
        response = ctl.membership.heartbeat_response(ctl.membership.streams["a"])
        assert list(response.draining) == ["b"] and "ftctl drain" in response.draining_reason
        assert list(ctl.status().draining) == ["b"]
        info = {n.node_id: n for n in ctl.nodes().nodes}["b"]
        assert info.state_reason.startswith("draining: ftctl drain")
        # A new leader loads the pending drain from the store.
        other = make(store, clock, "c1")
        loaded = ClusterView.from_snapshot(store.load(), clock.now, 5.0)
        assert loaded.drains["b"].reason == "ftctl drain" and other.replica_id == "c1"

    run(scenario)


def test_an_unhealthy_spare_is_passed_over() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        await ctl.membership.register(reg("t", cluster_pb2.ROLE_SPARE))
        hb(ctl, "t")
        now = WALL + clock.now
        hb_health(ctl, "s", False, "ssd free 1.0 GiB < 10 GiB", now)  # registered first: preferred if healthy
        hb_health(ctl, "t", True, "", now)
        ctl.membership.close_stream(ctl.membership.streams["a"])
        await step(ctl, clock, ("b", "s", "t"), n=16)
        assert store.world.ranks == ("t", "b")
        promoted = next(e for e in store.events.values() if e.kind == "spare_promoted")
        assert "s passed over: unhealthy: ssd free 1.0 GiB < 10 GiB" in promoted.message

    run(scenario)


def test_the_assignment_names_the_buddy_and_pushes_a_new_one_when_it_dies() -> None:
    """Buddies are the leader's choice (coordinator/buddies.py), by its ``domain_label``; an answer
    carries them only when they changed, and the death of a buddy pushes the new choice even though
    the world does not change (the buddy was a spare)."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await ctl.leadership_step()
        await step(ctl, clock, n=60)
        for node_id, role, rack in (("a", cluster_pb2.ROLE_ACTIVE, "r1"), ("b", cluster_pb2.ROLE_ACTIVE, "r1"),
                                    ("s", cluster_pb2.ROLE_SPARE, "r2"), ("t", cluster_pb2.ROLE_SPARE, "r2")):
            await ctl.membership.register(reg(node_id, role, rack=rack))
            hb(ctl, node_id)
        await step(ctl, clock, ("a", "b", "s", "t"))
        assert store.world.ranks == ("a", "b")
        streams = ctl.membership.streams
        told = ctl.membership.heartbeat_response(streams["a"]).assignment.peers
        assert told.buddy == "s" and told.buddy_reason == "s is the next node in another rack (r2, not r1)"
        assert told.complete and [(p.node_id, p.rank) for p in told.addresses] == [
            ("a", 0), ("b", 1), ("s", -1), ("t", -1)]
        assert not ctl.membership.heartbeat_response(streams["a"]).assignment.HasField("peers"), "unchanged"

        epoch = store.world.epoch
        queued = streams["a"].queue
        while not queued.empty():
            queued.get_nowait()
        ctl.membership.close_stream(streams["s"])  # the buddy is SIGKILLed: its socket closes
        await step(ctl, clock, ("a", "b", "t"), n=16)
        assert store.nodes["s"].fence is not None and store.world.epoch == epoch, "a dead spare: the same world"
        assert not queued.empty(), "the new buddy is pushed"
        told = ctl.membership.heartbeat_response(streams["a"]).assignment.peers
        assert told.buddy == "t" and [p.node_id for p in told.addresses] == ["a", "b", "t"]

    run(scenario)


def test_a_death_or_a_joiner_is_planned_on_the_tick_that_sees_it_though_quiet_ticks_skip_the_plan() -> None:
    """The placement runs again only when its inputs changed (placement.replan_due): a verdict turning
    DEAD and a registration are among them, so neither waits for the re-plan period."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        await step(ctl, clock, ("a", "b", "s"), n=3)  # less than REPLAN_EVERY_S since the plan found nothing
        assert ctl.membership._planned is not None, "quiet ticks remember that the plan found nothing"
        await ctl.membership.register(reg("c"))
        hb(ctl, "c")
        await step(ctl, clock, ("a", "b", "s", "c"))
        assert store.world.ranks == ("a", "b", "c"), "joined on the next tick"
        await step(ctl, clock, ("a", "b", "s", "c"), n=2)
        epoch = store.world.epoch
        ctl.membership.state.require_leader().liveness["b"].last_seen = clock.now - 10.0  # silent long enough
        await step(ctl, clock, ("a", "s", "c"))
        assert store.world.epoch == epoch + 1 and store.world.ranks == ("a", "s", "c"), "fenced on the same tick"
        await ctl.stop()

    run(scenario)
