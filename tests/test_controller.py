"""The control loop on the in-memory store with a hand-moved clock: registration, detection,
promotion, failover grace, and never acting on state that could not be committed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

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
from ftd.v1 import cluster_pb2, coordinator_pb2

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
                     kv_deletes: Sequence[str] = ()) -> CommitResult:
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
