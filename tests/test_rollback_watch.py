"""The leader's answers to bad steps on the in-memory store: a NaN report holds the commits from its
step on while the other nodes' reports are gathered, then one transaction marks the later checkpoints
suspect and starts a new round of the same members; replica fingerprints where one rank (of two on
node "a") disagrees twice fence node "a" with the later checkpoints marked suspect, and nothing
acts on alert; with skip_batches the restore target names the data window to skip, and the training
side skips it through the loader's skip_batches."""

from __future__ import annotations

import pytest
from controller_harness import WALL, Clock, cluster, run, send

from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, FileEntry, ShardRecord
from ftd.coordinator import rendezvous
from ftd.coordinator.control import Controller
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.ftctl import render
from ftd.ftctl.json_shapes import status_dict
from ftd.v1 import cluster_pb2, coordinator_pb2

JOB = "j"
RANKS = {"a": (0, 1), "b": (2,)}  # three ranks of one data-parallel world on two nodes


def record(step: int) -> CheckpointRecord:
    shards = {r: ShardRecord(r, 10, "c", (FileEntry("state.pt", 10, "0a0b0c0d"),), frozenset({CopyRef("ssd", "b")}))
              for r in range(3)}
    return CheckpointRecord(JOB, step, 1, 3, "torch", WALL, shards)


def beat(ctl: Controller, node_id: str, progress: cluster_pb2.Progress) -> None:
    req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation="i1", seq=1, progress=progress)
    send(ctl, req)


async def started(action: str, skip_batches: bool = False) -> tuple[Controller, Clock]:
    clock, store = Clock(), MemoryStore()
    store.clock = clock
    settings = CoordinatorSettings(replica_id="c0", failover_grace_s=5.0, anomaly_action=action,
                                   anomaly_skip_batches=skip_batches)
    ctl = Controller(store, settings, "127.0.0.1:7400", clock=clock, wall=lambda: WALL + clock.now)
    await cluster(ctl, clock)
    view = ctl.committer.require_leader()
    view.jobs[JOB] = rendezvous.JobState(JOB, round=1, epoch=view.world.epoch, members=("a", "b"))
    for step in (40, 50, 60, 70):
        view.catalog[(JOB, step)] = record(step)
    return ctl, clock


async def later(ctl: Controller, clock: Clock, seconds: float) -> None:
    """Time passes with the leader's lease kept (a keep-alive every half second)."""
    for _ in range(round(seconds / 0.5)):
        clock.advance(0.5)
        await ctl.leadership_step()


def nan_at(step: int, rank: int, round_: int = 1) -> cluster_pb2.Progress:
    return cluster_pb2.Progress(step=step, anomaly=cluster_pb2.StepAnomaly(
        step=step, rank=rank, kind="nan", reason=f"rank {rank} step {step}: loss is nan", round=round_))


def test_a_nan_is_gathered_then_rolled_back_in_one_new_round() -> None:
    async def scenario() -> None:
        ctl, clock = await started("rollback")
        view = ctl.committer.require_leader()
        beat(ctl, "b", nan_at(66, 2))
        assert ctl.catalog.held(JOB, view.world.epoch, 1) == 66, "commits from the bad step on are held"
        assert ctl.catalog.held(JOB, view.world.epoch, 2) is None, "not a later round's"
        await later(ctl, clock, 0.5)
        beat(ctl, "a", nan_at(65, 1))  # the origin reports later, from the other node
        await ctl.tick()
        assert view.jobs[JOB].round == 1, "still gathering"
        await later(ctl, clock, 2.0)
        await ctl.tick()
        job = view.jobs[JOB]
        assert job.round == 2 and job.rollbacks == 1 and job.restarts == 0 and job.members == ("a", "b")
        assert view.catalog[(JOB, 70)].invalid_reason.startswith("suspect: saved at or after step 65")
        assert all(view.catalog[(JOB, s)].valid for s in (40, 50, 60))
        target = ctl.catalog.restore_target(JOB)
        assert target.found and target.checkpoint.step == 60
        assert ctl.catalog.held(JOB, view.world.epoch, 1) is None
        events = [e for e in await ctl.event_log.events(100) if e.kind == "rollback"]
        assert len(events) == 1 and "nan at step 65 on rank 1 (a)" in events[0].message
        status = ctl.status()
        assert status.job_rollbacks == 1 and "rolled back before step 65" in status.rollback_decision
        shown = render.status(status_dict(status))
        assert "1 rollback(s)" in shown and "bad steps: j: nan at step 65" in shown, shown
        # The old round's reports keep coming: nothing more happens; the budget counts rollbacks only.
        beat(ctl, "a", nan_at(65, 1))
        await later(ctl, clock, 3.0)
        await ctl.tick()
        assert view.jobs[JOB].round == 2 and view.jobs[JOB].rollbacks == 1

    run(scenario)


def test_alert_only_holds_and_changes_nothing() -> None:
    async def scenario() -> None:
        ctl, clock = await started("alert")
        view = ctl.committer.require_leader()
        beat(ctl, "a", nan_at(65, 1))
        assert ctl.catalog.held(JOB, view.world.epoch, 1) is None
        await later(ctl, clock, 3.0)
        await ctl.tick()
        assert view.jobs[JOB].round == 1 and view.catalog[(JOB, 70)].valid

    run(scenario)


def marks(node_id: str, step: int, bad_rank: int | None = None) -> cluster_pb2.Progress:
    return cluster_pb2.Progress(step=step, fingerprints=[
        cluster_pb2.Fingerprint(step=step, rank=r, world_size=3, value=999 if r == bad_rank else 7, round=1)
        for r in RANKS[node_id]])


def test_a_replica_that_disagrees_twice_is_fenced_and_the_later_checkpoints_suspect() -> None:
    async def scenario() -> None:
        ctl, clock = await started("rollback")
        view = ctl.committer.require_leader()
        for step in (55, 60):
            for node_id in ("a", "b"):
                beat(ctl, node_id, marks(node_id, step))
        await ctl.tick()
        beat(ctl, "a", marks("a", 65, bad_rank=1))
        beat(ctl, "b", marks("b", 65))
        await ctl.tick()
        assert "a" not in view.forced_dead, "one disagreement waits for the recheck"
        assert [e.kind for e in await ctl.event_log.events(100)].count("fingerprint_mismatch") == 1
        clock.advance(0.3)
        beat(ctl, "a", marks("a", 70, bad_rank=1))
        beat(ctl, "b", marks("b", 70))
        await ctl.tick()
        assert view.forced_dead.get("a", "").startswith("silent data corruption: rank(s) 1 disagree"), \
            view.forced_dead
        assert view.catalog[(JOB, 70)].invalid_reason.startswith("suspect: saved at or after step 61")
        assert view.catalog[(JOB, 60)].valid and view.jobs[JOB].rollbacks == 1
        assert ctl.catalog.held(JOB, view.world.epoch, 1) == 61, "the old world's commits wait for the fence"
        fenced = [e for e in await ctl.event_log.events(100) if e.kind == "replica_fenced"]
        assert [e.node_id for e in fenced] == ["a"]
        for _ in range(5):  # the reconciliation fences "a" and promotes the spare
            clock.advance(0.2)
            await ctl.tick()
        assert "a" not in view.world.ranks and "s" in view.world.ranks
        assert ctl.catalog.held(JOB, view.world.epoch, 1) is None, "the new world commits freely"

    run(scenario)


def test_skip_batches_tells_the_restore_to_skip_the_window_that_led_to_the_anomaly() -> None:
    async def scenario() -> None:
        ctl, clock = await started("rollback", skip_batches=True)
        beat(ctl, "a", nan_at(65, 1))
        await later(ctl, clock, 2.5)
        await ctl.tick()
        target = ctl.catalog.restore_target(JOB)
        assert target.checkpoint.step == 60 and target.skip_until_step == 65
        assert "the data of steps 61..65 is skipped" in target.reason

    run(scenario)


def test_the_rank_state_skips_through_the_loaders_skip_batches() -> None:
    pytest.importorskip("torch")
    from ftd.training.rank_state import RankState

    class Loader:
        def __init__(self) -> None:
            self.position = 61

        def state_dict(self) -> dict[str, int]:
            return {"position": self.position}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.position = state["position"]

        def skip_batches(self, steps: int) -> None:
            self.position += steps

    loader = Loader()
    assert RankState(loader, rng=False).skip(5) == ["skipped the data of 5 step(s)"] and loader.position == 66
    assert RankState(loader, rng=False).skip(0) == [] and loader.position == 66

    class Plain(Loader):
        skip_batches = None  # type: ignore[assignment]

    plain = Plain()
    assert RankState(plain, rng=False).skip(5) == [] and plain.position == 61, "no skip_batches: nothing skipped"
