"""The agent's step-anomaly detector (agent/step_anomalies.py) on recorded loss and gradient-norm
series: NaN/Inf, a loss spike, a gradient-norm jump, and the false alarms it must not raise (the
noisy start, a restore that goes back in steps, ordinary noise)."""

from __future__ import annotations

import math

import pytest

from ftd.agent.step_anomalies import (
    GRAD_JUMP,
    LOSS_SPIKE,
    NAN,
    AnomalyConfig,
    NodeJudge,
    RankHistory,
    judge_step,
    remember,
)
from ftd.v1 import cluster_pb2

CONFIG = AnomalyConfig(loss_spike_factor=10.0, grad_norm_jump=0.3, window=20, min_history=5)


def replay(series: list[tuple[int, float | None, float | None]]) -> list[tuple[int, str]]:
    history, found = RankHistory(), []
    for step, loss, grad in series:
        anomaly = judge_step(history, step, 0, loss, grad, CONFIG)
        if anomaly is not None:
            found.append((step, anomaly.kind))
        remember(history, step, loss, grad, CONFIG)
    return found


def noisy(n: int, start: int = 0) -> list[tuple[int, float | None, float | None]]:
    """A healthy run: loss falling with noise, gradient norm within +-20 %."""
    return [(s, 2.0 * math.exp(-s / 200) * (1 + 0.1 * math.sin(s)), 1.0 + 0.2 * math.sin(1.7 * s))
            for s in range(start, start + n)]


def test_a_healthy_noisy_run_raises_nothing() -> None:
    assert replay(noisy(300)) == []


def test_nan_and_inf_are_anomalies_at_once_even_without_history() -> None:
    assert replay([(0, math.nan, 1.0)]) == [(0, NAN)]
    assert replay([*noisy(3), (3, 1.0, math.inf)]) == [(3, NAN)]
    history = RankHistory()
    got = judge_step(history, 7, 2, float("nan"), None, CONFIG)
    assert got is not None and got.rank == 2 and "rank 2 step 7: loss is nan" in got.reason


def test_a_loss_spike_above_ten_times_the_median() -> None:
    series = noisy(30)
    series.append((30, 9.0 * series[-1][1], 1.0))  # 9x: not yet
    series.append((31, 12.0 * series[-2][1], 1.0))
    found = replay(series)
    assert found == [(31, LOSS_SPIKE)]
    history = RankHistory()
    for step, loss, grad in noisy(30):
        remember(history, step, loss, grad, CONFIG)
    spike = judge_step(history, 30, 0, 100.0, None, CONFIG)
    assert spike is not None and "limit 10x" in spike.reason and spike.baseline > 0


def test_a_gradient_norm_jump_above_thirty_percent() -> None:
    series = [(s, 1.0, 1.0) for s in range(20)]
    assert replay([*series, (20, 1.0, 1.29)]) == []
    assert replay([*series, (20, 1.0, 1.31)]) == [(20, GRAD_JUMP)]


def test_the_first_steps_and_a_restore_start_the_window_afresh() -> None:
    assert replay([(0, 10.0, 5.0), (1, 1.0, 1.0), (2, 1.0, 1.0), (3, 20.0, 3.0)]) == [], "too little history"
    # A restore goes back to step 10 with a higher loss: not a spike, the window starts again.
    series = [(s, 0.1, 1.0) for s in range(40)] + [(s, 2.0, 2.0) for s in range(10, 20)]
    assert replay(series) == []


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="loss_spike_factor"):
        AnomalyConfig(loss_spike_factor=1.0)
    with pytest.raises(ValueError, match="min_history"):
        AnomalyConfig(window=5, min_history=6)


def test_the_node_keeps_its_newest_anomaly_and_never_sends_a_nan_figure() -> None:
    judge = NodeJudge(CONFIG)
    previous = cluster_pb2.Progress(step=-1)
    for step in range(10):
        report = cluster_pb2.Progress(step=step, loss=1.0, grad_norm=1.0)
        assert judge.judge(previous, report, rank=0) is None
        previous = report
    bad = cluster_pb2.Progress(step=10, loss=float("nan"), grad_norm=1.0)
    found = judge.judge(previous, bad, rank=1)
    assert found is not None and found.kind == NAN and found.rank == 1
    assert not bad.HasField("loss") and bad.grad_norm == 1.0, "the NaN left out: the coordinator refuses it"
    assert bad.anomaly.step == 10 and bad.anomaly.kind == NAN
    later = cluster_pb2.Progress(step=11, loss=1.0)
    assert judge.judge(bad, later, rank=0) is None and later.anomaly.step == 10, "kept until a newer one"
    # The NaN poisoned rank 1: its later steps are NaN too, one incident whose first step stays reported.
    still = cluster_pb2.Progress(step=11, loss=float("nan"))
    assert judge.judge(later, still, rank=1) is None and still.anomaly.step == 10 and not still.HasField("loss")
    clean = cluster_pb2.Progress(step=12, loss=1.0)
    assert judge.judge(still, clean, rank=1) is None
    again = cluster_pb2.Progress(step=13, loss=float("inf"))
    found = judge.judge(clean, again, rank=1)
    assert found is not None and again.anomaly.step == 13, "a clean step ended the incident: a new one"


def test_with_several_ranks_per_node_the_first_ranks_anomaly_stays_carried() -> None:
    """A NaN on rank 3 at step 25 reaches rank 2 (same node) at step 26: the heartbeat keeps carrying
    rank 3's step 25, the one a rollback must go before; a fault much later replaces it."""
    judge = NodeJudge(CONFIG)
    previous = cluster_pb2.Progress(step=-1)
    for step in range(12):
        for rank in (2, 3):
            report = cluster_pb2.Progress(step=step, loss=1.0)
            judge.judge(previous, report, rank=rank, round_=4)
            previous = report
    first = cluster_pb2.Progress(step=25, loss=float("nan"))
    assert judge.judge(previous, first, rank=3, round_=4) is not None and first.anomaly.step == 25
    spread = cluster_pb2.Progress(step=26, loss=float("nan"))
    found = judge.judge(first, spread, rank=2, round_=4)
    assert found is not None and found.rank == 2, "rank 2's own anomaly is still judged (and counted)"
    assert (spread.anomaly.step, spread.anomaly.rank, spread.anomaly.round) == (25, 3, 4)
    much_later = cluster_pb2.Progress(step=200, loss=float("nan"))
    judge.judge(spread, cluster_pb2.Progress(step=199, loss=1.0), rank=2, round_=4)
    judge.judge(spread, much_later, rank=2, round_=4)
    assert much_later.anomaly.step == 200 and much_later.anomaly.rank == 2
