"""What the coordinator's leader stores and bounds, on the in-memory store with a hand-moved clock: the
job keeper on the leader state alone, errors mapped once to gRPC codes, stored records that are corrupt,
etcd's NOSPACE alarm, fenced records collected, per-node write rate limits, paginated lists, and the
checkpoint catalog (epochs, trust, restore targets, bounded series). The control loop itself:
test_controller.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import grpc
import pytest
from controller_harness import WALL, Clock, cluster, make, reg, run, step

from ftd.checkpoints.layout import BadIdentifier, check_step
from ftd.coordinator import errors, rendezvous
from ftd.coordinator.control import Controller
from ftd.coordinator.jobs import JobKeeper, JobPolicy
from ftd.coordinator.model import NodeRecord, Role, World
from ftd.coordinator.store import CommitResult, MemoryStore
from ftd.coordinator.view import ClusterView
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2


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
                         wake=lambda: None, wall=lambda: WALL, policy=JobPolicy(min_nodes=2, max_restarts=4))
        with pytest.raises(errors.JobNotFound, match="job j has not rendezvoused yet") as missing:
            jobs.get("j")
        assert errors.grpc_code(missing.value) is grpc.StatusCode.NOT_FOUND
        # the job's parameters are the policy's (the operator's), whatever the first join asks for
        info = await jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="a", last_round=-1,
                                                                min_nodes=2**32 - 1, max_restarts=0))
        assert info.status == coordinator_pb2.RoundInfo.READY and info.rank == 0 and leader.commits == ["job"]
        assert (view.jobs["j"].min_nodes, view.jobs["j"].max_restarts) == (2, 4) and info.max_restarts == 4
        assert view.jobs["j"].round_unix_s == WALL and pushes == [1]
        assert rounds == [-1], "the first round starts the watches' warm-up too"
        with pytest.raises(errors.RoundConflict, match=r"only rank 0 \(a\)") as conflict:
            await jobs.set_store(coordinator_pb2.SetRoundStoreRequest(job="j", node_id="b", round=0, address="h:1"))
        assert errors.grpc_code(conflict.value) is grpc.StatusCode.FAILED_PRECONDITION
        await jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="b", last_round=-1, min_nodes=2))
        await jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="a", last_round=0))  # a restarted
        assert view.jobs["j"].round == 1 and rounds == [-1, -1]  # no checkpoint to restore from yet

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


def test_a_commit_refused_by_its_guard_is_retryable_unavailable_and_writes_nothing() -> None:
    """A leader deposed behind its back (another replica holds the lease in the store) commits a
    registration: etcd's guard refuses it. The caller gets UNAVAILABLE naming the replica (it was
    INTERNAL, "coordinator bug", under the scale bench's load), nothing is written, and the replica
    re-checks its leadership and reloads."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        assert ctl.committer.lease is not None
        store.resign(ctl.committer.lease)
        assert store.campaign("c1", "127.0.0.1:7401", ttl_s=3, now_unix=WALL + clock.now) is not None
        with pytest.raises(errors.CommitGuardFailed, match="c0") as refused:
            await ctl.membership.register(reg("x"))
        assert errors.grpc_code(refused.value) is grpc.StatusCode.UNAVAILABLE
        assert "x" not in store.load().nodes and ctl.committer.reload_wanted
        await ctl.stop()

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
        for step_, ranks in ((10, (0, 1)), (11, (0,)), (12, (0, 1))):
            for rank in ranks:
                await ctl.catalog.commit_shard(shard("j", step_, rank, 2, epoch=1))
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


def test_a_worker_restart_in_the_same_epoch_abandons_the_failed_rounds_partial_step() -> None:
    """chaos crash-mid-save: round 1 committed step 20 and rank 0 of step 25, then rank 1 died saving
    25. Round 2 (same epoch) restored 20 and saves 25 again with other bytes: the old 25 goes (else
    rank 0's commit is refused as a rewrite while its write replaced the old files, and the catalog
    names bytes no tier holds); a late commit of round 1 is refused."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await cluster(ctl, clock)
        view = ctl.committer.require_leader()
        view.jobs["j"] = rendezvous.JobState("j", round=1, epoch=1, members=("a", "b"))

        def saved(step: int, rank: int, crc: str, round_: int) -> checkpoint_pb2.CommitShardRequest:
            request = shard("j", step, rank, 2, crc=crc)
            request.job_round, request.restored_step = round_, 20 if round_ == 2 else -1
            return request

        for rank in (0, 1):
            await ctl.catalog.commit_shard(saved(20, rank, "20202020", 1))
        await ctl.catalog.commit_shard(saved(25, 0, "25252525", 1))
        view.jobs["j"] = rendezvous.JobState("j", round=2, epoch=1, members=("a", "b"))
        await ctl.catalog.commit_shard(saved(25, 1, "aaaaaaaa", 2))
        steps = {c.step: c for c in ctl.catalog.list("j")}
        assert [s.rank for s in steps[25].shards] == [1] and steps[20].valid
        with pytest.raises(errors.CatalogConflict, match="round 1, but the job is in round 2"):
            await ctl.catalog.commit_shard(saved(25, 0, "25252525", 1))
        await ctl.catalog.commit_shard(saved(25, 0, "bbbbbbbb", 2))
        record = ctl.committer.require_leader().catalog[("j", 25)]
        assert record.valid and record.round == 2 and record.shards[0].checksum != steps[20].shards[0].checksum
        assert ctl.catalog.restore_target("j").checkpoint.step == 25
        # A copy that holds another timeline's bytes is never recorded as the committed shard's.
        copy = checkpoint_pb2.RecordCopyRequest(job="j", step=25, rank=0, tier="hdd", location="shared",
                                                present=True, checksum="0badc0de")
        with pytest.raises(errors.CatalogConflict, match=r"other bytes \(checksum 0badc0de\) than the committed shard"):
            await ctl.catalog.record_copy(copy)
        copy.checksum = record.shards[0].checksum
        recorded = await ctl.catalog.record_copy(copy)
        assert [c.tier for c in recorded.checkpoint.shards[0].copies] == ["hdd", "ssd"]
        # A commit that would abandon step 25 but is itself refused (another world size for step 20, which
        # it restored and keeps) deletes nothing: it is judged before the abandoned timeline goes (found
        # by the fuzzer).
        view.jobs["j"] = rendezvous.JobState("j", round=3, epoch=1, members=("a", "b"))
        wrong = shard("j", 20, 0, 1, crc="cccccccc")
        wrong.job_round, wrong.restored_step = 3, 20
        with pytest.raises(errors.CatalogConflict, match="world_size 2"):
            await ctl.catalog.commit_shard(wrong)
        assert sorted(c.step for c in ctl.catalog.list("j")) == [20, 25]

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
    from ftd.coordinator import catalog, validation

    monkeypatch.setattr(validation, "MAX_JOBS", 2)
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


def test_the_current_job_is_cached_until_a_job_or_the_world_changes() -> None:
    """current_job is asked on every heartbeat answer: computed once per change of the jobs or the world."""
    view = ClusterView()
    view.set_world(World(epoch=1, ranks=("a", "b")), 1)
    view.jobs["old"] = rendezvous.JobState("old", closed=True, round=3)
    assert view.current_job() is view.jobs["old"]  # no open job: the last closed
    view.jobs["x"] = rendezvous.JobState("x", joined=("a",), created_unix_s=2.0)
    view.jobs["y"] = rendezvous.JobState("y", joined=("c",), created_unix_s=1.0)
    assert view.current_job() is view.jobs["x"]  # the most members of the world joined it
    view.jobs["y"] = rendezvous.JobState("y", joined=("a", "b"), created_unix_s=1.0)  # a new (frozen) state
    assert view.current_job() is view.jobs["y"]
    view.set_world(World(epoch=2, ranks=("c",)), 2)  # the world changed: y's members are not in it
    assert view.current_job() is view.jobs["y"]  # y: 0 of c, x: 0 of c -> the oldest (y)
    view.jobs.pop("y")
    assert view.current_job() is view.jobs["x"]
    view.jobs["x"] = replace(view.jobs["x"], closed=True)
    assert view.current_job() is view.jobs["old"]
