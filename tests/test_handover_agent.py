"""The agent's and the training side's parts of a planned hand-over, without processes: a notice
becomes one Drain request with the notice's deadline, pending drains become the workers' flag."""

from __future__ import annotations

import threading

from ftd.agent.handover_relay import Handover, carry_parked
from ftd.agent.metrics import AgentMetrics
from ftd.agent.preemption_notices import Notice, NoticeKind
from ftd.training.handover_stop import HandoverFlag, agree_any
from ftd.v1 import cluster_pb2, coordinator_pb2
from ftd.waiting import wait_for

NOW = 1_800_000_000.0


class FakeCoordinator:
    def __init__(self, failures: int = 0) -> None:
        self.requests: list[coordinator_pb2.DrainRequest] = []
        self.failures = failures
        self.done = threading.Event()

    def drain(self, request: coordinator_pb2.DrainRequest) -> coordinator_pb2.DrainResponse:
        self.requests.append(request)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("no leader")
        self.done.set()
        return coordinator_pb2.DrainResponse(accepted=True, message="pending")


def test_a_final_notice_becomes_one_drain_with_its_deadline_and_marks_the_node_going() -> None:
    coordinator = FakeCoordinator(failures=1)
    handover = Handover("node-1", coordinator.drain, AgentMetrics(), wall=lambda: NOW)
    assert handover.going_away() == ""
    handover.on_notice(Notice("aws", NoticeKind.TERMINATE, NOW + 120, "spot instance-action terminate"))
    wait_for(coordinator.done.is_set, 10, "the drain accepted after one refusal")
    request = coordinator.requests[-1]
    assert len(coordinator.requests) == 2 and request.node_id == "node-1"
    assert request.deadline_unix_s == NOW + 120 and request.reason.startswith("aws terminate notice")
    assert handover.going_away().startswith("preemption notice:")


def test_a_rebalance_recommendation_is_counted_but_hands_nothing_over() -> None:
    coordinator = FakeCoordinator()
    metrics = AgentMetrics()
    handover = Handover("node-1", coordinator.drain, metrics, wall=lambda: NOW)
    handover.on_notice(Notice("aws", NoticeKind.REBALANCE, None, "rebalance recommendation"))
    assert coordinator.requests == [] and handover.going_away() == ""
    assert metrics.preemption_notices.labels("aws", "rebalance")._value.get() == 1


def test_pending_drains_from_heartbeat_answers() -> None:
    metrics = AgentMetrics()
    handover = Handover("node-0", FakeCoordinator().drain, metrics)
    handover.on_response(coordinator_pb2.HeartbeatResponse(draining=["node-1"], draining_reason="node-1: ftctl drain"))
    assert handover.pending.nodes == ("node-1",) and "ftctl drain" in handover.pending.reason
    assert metrics.handover_pending._value.get() == 1
    handover.on_response(coordinator_pb2.HeartbeatResponse())
    assert handover.pending.nodes == () and metrics.handover_pending._value.get() == 0


def test_without_a_process_group_the_rank_decides_alone() -> None:
    flag = HandoverFlag()
    assert not agree_any(flag.pending)
    flag.update(True, "node-1: aws terminate notice")
    assert agree_any(flag.pending) and flag.reason.startswith("node-1")


def test_a_node_stays_parked_at_its_stop_step_until_the_training_moves_on() -> None:
    def merged(previous: cluster_pb2.Progress, progress: cluster_pb2.Progress) -> int | None:
        carry_parked(previous, progress)
        return progress.parked_step if progress.HasField("parked_step") else None

    parked = cluster_pb2.Progress(step=42, parked_step=42)
    assert merged(cluster_pb2.Progress(step=41), cluster_pb2.Progress(step=42)) is None
    assert merged(parked, cluster_pb2.Progress(step=42)) == 42  # another rank, not parked yet
    assert merged(parked, cluster_pb2.Progress(step=42, parked_step=-1)) == -1  # its final save failed
    assert merged(cluster_pb2.Progress(step=42, parked_step=-1), cluster_pb2.Progress(step=42, parked_step=42)) == -1
    assert merged(parked, cluster_pb2.Progress(step=43)) is None  # the new world trains on
