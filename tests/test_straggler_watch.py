"""The leader's training-health watches on the in-memory store. The straggler watch, driven by
heartbeats that carry step timings: a node computing 4x slower is scored, an event says so, the
replace policy drains it (the planned hand-over), it is shown in ListNodes, and it is not promoted
until a later health check passes. The anomaly log: one event per anomaly an agent reports."""

from __future__ import annotations

from controller_harness import WALL, Clock, cluster, run, send

from ftd.coordinator import rendezvous
from ftd.coordinator.control import Controller
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.v1 import cluster_pb2, coordinator_pb2

COMPUTE = {"a": 0.1, "b": 0.4}


def beat(ctl: Controller, node_id: str, step: int | None = None, healthy_at: float | None = None) -> None:
    req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation="i1", seq=1)
    if step is not None:
        req.progress.CopyFrom(cluster_pb2.Progress(step=step, timing=cluster_pb2.StepTiming(
            compute_s=COMPUTE[node_id], wall_s=0.5)))
    if healthy_at is not None:
        req.health.verdict.CopyFrom(cluster_pb2.HealthVerdict(healthy=True, checked_unix_s=healthy_at))
    send(ctl, req)


def test_a_slow_node_is_scored_reported_and_handed_over_once() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        settings = CoordinatorSettings(replica_id="c0", failover_grace_s=5.0, straggler_action="replace",
                                       straggler_window_s=10.0, straggler_min_evidence_s=3.0, straggler_warmup_s=0.0,
                                       handover_max_wait_s=600.0)
        ctl = Controller(store, settings, "127.0.0.1:7400", clock=clock, wall=lambda: WALL + clock.now)
        await cluster(ctl, clock)
        view = ctl.committer.require_leader()
        assert list(view.world.ranks) == ["a", "b"]
        view.jobs["j"] = rendezvous.JobState("j", round=1, epoch=view.world.epoch, members=("a", "b"))
        ctl.stragglers.round_started()
        step = 0
        for tick in range(200):  # 20 s of 0.1 s ticks, a step every 0.5 s
            clock.advance(0.1)
            if tick % 5 == 0:
                step += 1
            for node_id in ("a", "b"):
                beat(ctl, node_id, step)
            beat(ctl, "s", healthy_at=WALL + clock.now)
            if round(clock.now * 10) % 10 == 0:
                await ctl.leadership_step()
            await ctl.tick()
            if "b" in view.drains:
                break
        assert "b" in view.drains, ctl.stragglers.decision
        drain = view.drains["b"]
        assert drain.reason.startswith("straggler: score 4.00") and "median compute 400 ms" in drain.reason
        score = ctl.metrics.registry.get_sample_value("ftd_coordinator_straggler_score", {"node": "b"})
        assert score == 4.0
        assert ctl.metrics.registry.get_sample_value("ftd_coordinator_straggler_score", {"node": "a"}) == 0.25
        kinds = [(e.kind, e.node_id) for e in store.events.values()]
        assert ("straggler_detected", "b") in kinds and ("straggler_detected", "a") not in kinds
        assert ("drain_requested", "b") in kinds
        shown = {n.node_id: n for n in ctl.nodes().nodes}
        assert shown["b"].straggler_score == 4.0 and shown["b"].slow.startswith("straggler: score 4.00")
        assert shown["a"].straggler_score == 0.25 and not shown["a"].slow
        # Marked slow: not fit for promotion until a health verdict measured after the replacement passes.
        replaced_at = ctl.stragglers.slow["b"][0]
        view.drains.pop("b")  # as when the hand-over is committed (b rejoins as a spare)
        unfit = ctl.membership._unfit_spares(view)
        assert unfit["b"].startswith("slow (straggler") and "s" not in unfit
        beat(ctl, "b", healthy_at=replaced_at - 1)
        assert "b" in ctl.membership._unfit_spares(view), "a verdict from before the replacement does not clear it"
        beat(ctl, "b", healthy_at=replaced_at + 1)
        assert "b" not in ctl.membership._unfit_spares(view) and "b" not in ctl.stragglers.slow
        # One replacement per min_replace_interval_s: a second straggler now is only reported.
        await ctl.stragglers.tick(spares=lambda: 1)
        clock.advance(3.0)
        await ctl.stragglers.tick(spares=lambda: 1)
        assert "next allowed in" in ctl.stragglers.decision and not view.drains

    run(scenario)


def test_a_step_anomaly_is_one_event_and_one_count_however_often_it_is_repeated() -> None:
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = Controller(store, CoordinatorSettings(replica_id="c0", failover_grace_s=5.0), "127.0.0.1:7400",
                         clock=clock, wall=lambda: WALL + clock.now)
        await cluster(ctl, clock)

        def report(step: int, kind: str) -> None:
            req = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i1", seq=1)
            req.progress.CopyFrom(cluster_pb2.Progress(step=step + 3, anomaly=cluster_pb2.StepAnomaly(
                step=step, rank=1, kind=kind, value=float("nan"), reason=f"rank 1 step {step}: loss is nan")))
            ctl.membership.on_heartbeat(ctl.membership.streams["a"], req)

        for _ in range(5):  # the agent repeats its newest anomaly with every heartbeat
            report(40, "nan")
        report(90, "loss_spike")
        await ctl.tick()
        events = [e for e in store.events.values() if e.kind == "step_anomaly"]
        assert [e.message for e in events] == ["a: rank 1 step 40: loss is nan", "a: rank 1 step 90: loss is nan"]
        count = ctl.metrics.registry.get_sample_value
        assert count("ftd_coordinator_step_anomalies_total", {"kind": "nan"}) == 1
        assert count("ftd_coordinator_step_anomalies_total", {"kind": "loss_spike"}) == 1

    run(scenario)
