"""The control loop on the in-memory store with a hand-moved clock: registration, detection,
promotion, failover grace, and never acting on state that could not be committed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import pytest

from ftd.checkpoints.layout import BadIdentifier, check_step
from ftd.coordinator import errors
from ftd.coordinator.control import Controller
from ftd.coordinator.jobs import JobKeeper
from ftd.coordinator.model import NodeRecord, Role, World
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import CommitResult, MemoryStore
from ftd.coordinator.view import ClusterView
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2

T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


WALL = 1_700_000_000.0  # the wall clock's reading when the monotonic test clock reads 0


def make(store: MemoryStore, clock: Clock, rid: str = "c0") -> Controller:
    settings = CoordinatorSettings(replica_id=rid, failover_grace_s=5.0)
    return Controller(store, settings, f"127.0.0.1:{7400 + int(rid[1:])}", clock=clock,
                      wall=lambda: WALL + clock.now)


def reg(node_id: str, role: int = cluster_pb2.ROLE_ACTIVE, host: str = "10.0.0.1",
        inc: str = "i1", rack: str = "") -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(node_id=node_id, host=host, role=role,  # type: ignore[arg-type]
                                           labels={"rack": rack} if rack else {}, agent_address="127.0.0.1:9",
                                           pid=1, incarnation=inc)


def hb(ctl: Controller, node_id: str, inc: str = "i1") -> None:
    stream = ctl.membership.streams.get(node_id)
    req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation=inc, seq=1)
    if stream is None:
        ctl.membership.open_stream(req)
    else:
        ctl.membership.on_heartbeat(stream, req)


async def step(ctl: Controller, clock: Clock, beats: tuple[str, ...] = (), n: int = 1) -> None:
    """Moves time by ``n`` ticks of 0.1 s: heartbeats from ``beats``, the leader's keep-alive once a
    second, one detection tick each."""
    for _ in range(n):
        clock.advance(0.1)
        for node_id in beats:
            with contextlib.suppress(errors.NotLeader):  # a refused agent backs off and retries
                hb(ctl, node_id)
        if ctl.committer.lease is not None and round(clock.now * 10) % 10 == 0:
            await ctl.leadership_step()
        await ctl.tick()


async def cluster(ctl: Controller, clock: Clock) -> None:
    await ctl.leadership_step()
    assert ctl.is_leader
    await step(ctl, clock, n=60)  # past the new leader's grace
    for node_id in ("a", "b"):
        await ctl.membership.register(reg(node_id))
    await ctl.membership.register(reg("s", cluster_pb2.ROLE_SPARE))
    for node_id in ("a", "b", "s"):
        hb(ctl, node_id)
    await ctl.tick()


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
        assert store.world.ranks == tuple(ids[120:])
        assert all(store.nodes[i].fence is not None for i in ids[:120])
        assert store.world.epoch - first == 3, "120 fences at 40 per transaction: three epochs"
        await ctl.stop()

    run(scenario)


class FakeLeader:
    """A :class:`~ftd.coordinator.leader_state.LeaderState` without etcd: every commit succeeds."""

    def __init__(self) -> None:
        self.view: ClusterView | None = ClusterView()
        self.commits: list[str] = []

    def require_leader(self) -> ClusterView:
        assert self.view is not None
        return self.view

    async def commit(self, kind: str, *, nodes: Sequence[NodeRecord] = (), world: World | None = None,
                     events: Sequence[tuple[str, str, str]] = (), kv_puts: Mapping[str, bytes] | None = None,
                     kv_deletes: Sequence[str] = (), node_deletes: Sequence[str] = ()) -> CommitResult:
        self.commits.append(kind)
        return CommitResult(0)


def test_job_keeper_needs_only_the_leader_state_and_says_what_went_wrong() -> None:
    async def scenario() -> None:
        leader, pushes, rounds = FakeLeader(), list[int](), list[int]()
        view = leader.require_leader()
        for node_id in ("a", "b"):
            view.nodes[node_id] = NodeRecord(node_id, "h", Role.ACTIVE)
        view.set_world(World(epoch=1, ranks=("a", "b"), target_size=2), 1)
        jobs = JobKeeper(leader, round_started=rounds.append, push_all=lambda: pushes.append(1),
                         wake=lambda: None, wall=lambda: WALL)
        with pytest.raises(errors.JobNotFound, match="job j has not rendezvoused yet") as missing:
            jobs.get("j")
        assert errors.grpc_code(missing.value) is grpc.StatusCode.NOT_FOUND
        info = await jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="a", last_round=-1, min_nodes=2))
        assert info.status == coordinator_pb2.RoundInfo.READY and info.rank == 0 and leader.commits == ["job"]
        assert view.jobs["j"].round_unix_s == WALL and pushes == [1]
        with pytest.raises(errors.RoundConflict, match=r"only rank 0 \(a\)") as conflict:
            await jobs.set_store(coordinator_pb2.SetRoundStoreRequest(job="j", node_id="b", round=0, address="h:1"))
        assert errors.grpc_code(conflict.value) is grpc.StatusCode.FAILED_PRECONDITION
        await jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="a", last_round=0))  # a restarted
        assert view.jobs["j"].round == 1 and rounds == [-1]  # no checkpoint to restore from yet

    run(scenario)


def test_errors_map_once_to_grpc_codes_and_keep_validator_messages_whole() -> None:
    assert errors.grpc_code(errors.CheckpointNotFound("j", 5, rank=2)) is grpc.StatusCode.NOT_FOUND
    assert str(errors.CheckpointNotFound("j", 5, rank=2)) == "step 5 of job j has no committed rank 2"
    assert errors.grpc_code(errors.NotLeader("c0", "")) is grpc.StatusCode.UNAVAILABLE
    assert errors.grpc_code(ValueError("a bug")) is grpc.StatusCode.INTERNAL
    with pytest.raises(BadIdentifier) as bad:
        check_step(-1)
    invalid = errors.InvalidArgument.naming(bad.value, within="manifest.")
    assert invalid.field == "manifest.step" and str(invalid) == f"manifest.{bad.value}"
    assert errors.grpc_code(invalid) is grpc.StatusCode.INVALID_ARGUMENT


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


# ---- issue 11: stored-state trust, NOSPACE, bounded inputs ------------------------------------------


def gauge(ctl: Controller, name: str, **labels: str) -> float:
    value = ctl.metrics.registry.get_sample_value(name, labels or None)
    assert value is not None, name
    return value


def test_a_corrupt_record_is_skipped_reported_and_never_stops_the_leader() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        store.corrupt["nodes/zzz"] = "record '/ftd/default/nodes/zzz' is corrupt: not JSON"
        store.kv["ckpt/j/000000000007/meta"] = b"not json"
        ctl = make(store, clock)
        await cluster(ctl, clock)
        assert ctl.is_leader
        problems = list(ctl.status().problems)
        assert any("nodes/zzz" in p for p in problems) and any("ckpt/j/000000000007/meta" in p for p in problems)
        assert gauge(ctl, "ftd_coordinator_corrupt_records") == 2
        kinds = [e.kind for e in store.events.values()]
        assert kinds.count("corrupt_record") == 2 and "leader_elected" in kinds
        assert store.world.ranks == ("a", "b"), "the leader works on"

    run(scenario)


def test_nospace_alarm_refuses_commits_clearly_and_fencing_resumes_when_space_returns() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        assert gauge(ctl, "ftd_coordinator_etcd_alarm", alarm="nospace") == 0
        store.raised.append("nospace")
        await step(ctl, clock, ("a", "b", "s"), n=60)  # the alarm is polled every 5 s
        assert gauge(ctl, "ftd_coordinator_etcd_alarm", alarm="nospace") == 1
        assert [a.split(":")[0] for a in ctl.status().etcd_alarms] == ["nospace"]
        with pytest.raises(errors.StateRejected) as full:
            await ctl.membership.register(reg("late", inc="x"))
        assert errors.grpc_code(full.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "database is full (NOSPACE alarm)" in str(full.value) and "alarm disarm" in str(full.value)
        ctl.membership.close_stream(ctl.membership.streams["a"])
        await step(ctl, clock, ("b", "s"), n=30)
        assert store.world.ranks == ("a", "b") and store.nodes["a"].fence is None, "nothing can be committed"
        assert ctl.is_leader, "a full etcd does not cost the leadership"
        # The leader goes away while etcd is full: a standby cannot get a lease, and keeps trying.
        await ctl.stop()
        standby = make(store, clock, "c1")
        await standby.leadership_step()
        assert not standby.is_leader and standby.committer.lease is None
        store.raised.clear()  # compaction + defragmentation + alarm disarm
        await standby.leadership_step()
        assert standby.is_leader
        await step(standby, clock, ("b", "s"), n=60)
        assert store.world.ranks == ("s", "b") and store.nodes["a"].fence is not None, "fencing resumed"
        assert gauge(standby, "ftd_coordinator_etcd_alarm", alarm="nospace") == 0
        assert not standby.status().etcd_alarms

    run(scenario)


def test_fenced_node_records_are_collected_after_the_retention() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        ctl.membership.fenced_node_retention_s = 120.0
        await cluster(ctl, clock)
        ctl.membership.close_stream(ctl.membership.streams["a"])
        await step(ctl, clock, ("b", "s"), n=30)
        assert store.nodes["a"].fence is not None
        await step(ctl, clock, ("b", "s"), n=600)  # 60 s: still within the retention
        assert "a" in store.nodes
        await step(ctl, clock, ("b", "s"), n=1000)  # past retention + one GC period
        assert "a" not in store.nodes and "a" not in ctl.committer.require_leader().liveness
        assert "a" not in {n.node_id for n in ctl.nodes().nodes}
        assert any(e.kind == "nodes_collected" and "a" in e.message for e in store.events.values())
        assert gauge(ctl, "ftd_coordinator_nodes_collected_total") == 1
        resp = await ctl.membership.register(reg("a", inc="i9"))  # the node may come back, as a new one
        assert resp.message == "registered as active" and store.nodes["a"].fence is None

    run(scenario)


def test_writes_are_rate_limited_per_node_and_a_refusal_changes_nothing() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        for _ in range(59):  # the burst: 60 per node (one was the registration above)
            await ctl.membership.register(reg("a", inc="i1"))
        before = (dict(store.nodes), store.world, dict(store.kv), store.writes)
        with pytest.raises(errors.RateLimited, match="Register from 'a' is over its write rate limit") as err:
            await ctl.membership.register(reg("a", inc="i2"))
        assert errors.grpc_code(err.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (dict(store.nodes), store.world, dict(store.kv), store.writes) == before
        await ctl.membership.register(reg("b", inc="i1"))  # other nodes are not affected
        assert gauge(ctl, "ftd_coordinator_rate_limited_total", method="Register") == 1
        clock.advance(1.0)  # 10 tokens a second
        await ctl.membership.register(reg("a", inc="i1"))

    run(scenario)


def test_list_rpcs_are_paginated() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        for i in range(7):
            await ctl.membership.register(reg(f"n{i}", cluster_pb2.ROLE_SPARE))
        seen, token, pages = [], "", 0
        while True:
            page = ctl.nodes(coordinator_pb2.ListNodesRequest(page_size=3, page_token=token))
            seen += [n.node_id for n in page.nodes]
            pages += 1
            token = page.next_page_token
            if not token:
                break
        assert seen == sorted(["a", "b", "s", *(f"n{i}" for i in range(7))]) and pages == 4
        assert len(ctl.nodes().nodes) == 10, "the default page holds every node of a small cluster"
        with pytest.raises(errors.InvalidArgument, match="page_token"):
            ctl.nodes(coordinator_pb2.ListNodesRequest(page_token="bad token\n"))
        events, token = [], ""
        while True:
            got = await ctl.event_page(coordinator_pb2.ListEventsRequest(limit=4, page_token=token))
            events += [e.seq for e in got.events]
            token = got.next_page_token
            if not token:
                break
        assert events == sorted(store.events, reverse=True)

    run(scenario)


def holder(rank: int) -> str:
    """The registered node (of cluster()) holding rank ``rank``'s copy: copies on unknown nodes are unreachable."""
    return ("a", "b")[rank % 2]


def shard(job: str, step: int, rank: int, world: int, crc: str = "0a0b0c0d",
          epoch: int = 1) -> checkpoint_pb2.CommitShardRequest:
    return checkpoint_pb2.CommitShardRequest(tier="ssd", location=holder(rank), manifest=checkpoint_pb2.ShardManifest(
        job=job, step=step, epoch=epoch, rank=rank, world_size=world, format="torch",
        files=[checkpoint_pb2.ShardFile(name="state.pt", size=10, crc32c=crc)]))


def test_a_newer_epoch_saving_an_old_step_number_abandons_the_old_timeline() -> None:
    """Epoch 1 saved steps 10 (valid), 11 and 12 (valid) before a failure; the new world restored step
    10 and saves 11 again in epoch 2: the old 11 and 12 are removed (never restored into the new
    timeline, never blocking its saves); step 10 stays; a late shard of epoch 1 is refused."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        for step, ranks in ((10, (0, 1)), (11, (0,)), (12, (0, 1))):
            for rank in ranks:
                await ctl.catalog.commit_shard(shard("j", step, rank, 2, epoch=1))
        await ctl.catalog.commit_shard(shard("j", 11, 1, 2, crc="11111111", epoch=2))
        steps = {c.step: c for c in ctl.catalog.list("j")}
        assert sorted(steps) == [10, 11] and steps[10].valid and steps[10].epoch == 1
        assert steps[11].epoch == 2 and not steps[11].valid and [s.rank for s in steps[11].shards] == [1]
        assert any(e.kind == "checkpoints_removed" and "abandoned timeline" in e.message for e in store.events.values())
        with pytest.raises(errors.CatalogConflict, match="epoch 2; rank 0 reports 1"):
            await ctl.catalog.commit_shard(shard("j", 11, 0, 2, epoch=1))
        await ctl.catalog.commit_shard(shard("j", 11, 0, 2, crc="11111111", epoch=2))
        assert ctl.catalog.restore_target("j").checkpoint.step == 11

    run(scenario)


def test_catalog_trust_restore_target_and_the_last_restorable_step() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        for rank in (0, 1):
            await ctl.catalog.commit_shard(shard("j", 100, rank, 2))
        # Another world size for the same step is refused (FAILED_PRECONDITION) ...
        with pytest.raises(errors.CatalogConflict, match="world_size 2"):
            await ctl.catalog.commit_shard(shard("j", 100, 0, 1, crc="ffffffff"))
        # ... and a newer step of another world size (valid by itself) is skipped by a world-2 restore.
        await ctl.catalog.commit_shard(shard("j", 200, 0, 1))
        target = ctl.catalog.restore_target("j", world_size=2)
        assert target.found and target.checkpoint.step == 100
        assert "skipped step 200 (world size 1)" in target.reason
        assert ctl.catalog.restore_target("j").checkpoint.step == 200  # without a size: the newest
        # The last restorable step cannot be invalidated: the restore target never falls back to scratch.
        await ctl.catalog.invalidate(checkpoint_pb2.InvalidateCheckpointRequest(job="j", step=200, reason="bad"))
        with pytest.raises(errors.CatalogConflict, match="last restorable checkpoint") as last:
            await ctl.catalog.invalidate(checkpoint_pb2.InvalidateCheckpointRequest(job="j", step=100, reason="x"))
        assert errors.grpc_code(last.value) is grpc.StatusCode.FAILED_PRECONDITION
        assert ctl.catalog.restore_target("j", 2).checkpoint.step == 100
        # A step whose every copy was found corrupt is not restorable: then it may be invalidated.
        for rank in (0, 1):
            await ctl.catalog.record_copy(checkpoint_pb2.RecordCopyRequest(
                job="j", step=100, rank=rank, tier="ssd", location=holder(rank), present=True,
                corrupt_reason="crc32c mismatch\n\x1b[31m"))
        info = await ctl.catalog.invalidate(checkpoint_pb2.InvalidateCheckpointRequest(job="j", step=100, reason="x"))
        assert not info.valid
        record = ctl.committer.require_leader().catalog[("j", 100)]
        assert record.shards[0].bad["ssd@a"] == "crc32c mismatch [31m", "one printable line"
        # Listing pages through the catalog.
        for step_ in range(300, 310):
            await ctl.catalog.commit_shard(shard("k", step_, 0, 1))
        listed, token = [], ""
        while True:
            page = ctl.catalog.list_page(checkpoint_pb2.ListCheckpointsRequest(page_size=4, page_token=token))
            listed += [(c.job, c.step) for c in page.checkpoints]
            token = page.next_page_token
            if not token:
                break
        assert listed == sorted(ctl.committer.require_leader().catalog)

    run(scenario)


def test_job_records_and_checkpoint_series_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftd.coordinator import catalog, limits

    monkeypatch.setattr(limits, "MAX_JOBS", 2)
    monkeypatch.setattr(catalog, "MAX_JOB_SERIES", 2)

    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        for job in ("j1", "j2"):
            await ctl.jobs.join(coordinator_pb2.JoinRoundRequest(job=job, node_id="a", last_round=-1))
        with pytest.raises(errors.TooMany, match="close one") as many:
            await ctl.jobs.join(coordinator_pb2.JoinRoundRequest(job="j3", node_id="a", last_round=-1))
        assert errors.grpc_code(many.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
        await ctl.jobs.close(coordinator_pb2.CloseJobRequest(job="j1", reason="done"))
        await ctl.jobs.join(coordinator_pb2.JoinRoundRequest(job="j3", node_id="a", last_round=-1))
        assert set(ctl.committer.require_leader().jobs) == {"j2", "j3"} and "jobs/j1" not in store.kv
        await step(ctl, clock, ("a", "b", "s"), n=10)
        jobs = {s.labels["job"] for m in ctl.metrics.registry.collect() if m.name == "ftd_coordinator_job_round"
                for s in m.samples}
        assert jobs == {"j2", "j3"}, "the series of a removed job go with it"
        for job in ("c1", "c2", "c3"):
            await step(ctl, clock, ("a", "b", "s"), n=10)  # one second apart
            await ctl.catalog.commit_shard(shard(job, 1, 0, 1))
        names = {s.labels["job"] for m in ctl.metrics.registry.collect() if m.name ==
                 "ftd_coordinator_checkpoint_last_valid_step" for s in m.samples}
        assert names == {"c2", "c3"}, "only the jobs with the newest valid steps have series"

    run(scenario)
