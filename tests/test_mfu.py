"""MFU (agent/mfu.py): the pure computation, the meter fed by progress reports, the agent's gauges, and
the ``flops`` field of ``Progress`` that carries the input."""

from __future__ import annotations

import math
import threading

import pytest

from ftd.agent.metrics import SAVE_SIZE_WINDOW, AgentMetrics
from ftd.agent.mfu import MfuMeter, StepMark, mfu, step_seconds
from ftd.v1 import cluster_pb2

H100_BF16 = 989e12  # dense BF16 peak of one H100 SXM, FLOP/s


# ---- the pure function -----------------------------------------------------------------------------


def test_mfu_is_flops_over_time_times_peak() -> None:
    # 6 x 7e9 parameters x 4096 tokens per rank and step, 0.5 s per step, on an H100: ~35 %.
    flops = 6 * 7e9 * 4096
    assert mfu(flops, 0.5, H100_BF16) == pytest.approx(flops / (0.5 * H100_BF16))
    assert mfu(flops, 0.5, H100_BF16) == pytest.approx(0.3479, abs=1e-4)
    assert mfu(1e12, 1.0, 1e12) == 1.0
    assert mfu(2e12, 1.0, 1e12) == 2.0  # a wrong peak or wrong flops shows, it is not clipped


@pytest.mark.parametrize(("flops", "step_s", "peak"), [
    (0.0, 1.0, 1e12), (-1.0, 1.0, 1e12), (1e12, 0.0, 1e12), (1e12, -0.5, 1e12), (1e12, 1.0, 0.0),
    (math.nan, 1.0, 1e12), (1e12, math.inf, 1e12), (1e12, 1.0, math.nan), (math.inf, 1.0, 1e12),
])
def test_mfu_is_none_without_positive_finite_inputs(flops: float, step_s: float, peak: float) -> None:
    assert mfu(flops, step_s, peak) is None


def test_step_seconds_is_the_mean_step_time_between_advancing_marks() -> None:
    assert step_seconds(StepMark(10, 100.0), StepMark(11, 100.5)) == 0.5
    assert step_seconds(StepMark(10, 100.0), StepMark(14, 102.0)) == 0.5  # one report every 4 steps
    assert step_seconds(None, StepMark(1, 1.0)) is None
    assert step_seconds(StepMark(10, 100.0), StepMark(10, 101.0)) is None  # the same step again
    assert step_seconds(StepMark(10, 100.0), StepMark(5, 101.0)) is None  # restarted from an older step
    assert step_seconds(StepMark(10, 100.0), StepMark(11, 100.0)) is None  # the clock did not move
    assert step_seconds(StepMark(10, 100.0), StepMark(11, 99.0)) is None


# ---- the meter -------------------------------------------------------------------------------------


def test_meter_measures_from_the_first_report_of_each_step() -> None:
    meter = MfuMeter(peak_flops=1e12)
    assert meter.observe(1, 10.0, 5e11) is None  # nothing to measure against yet
    # Eight local ranks report step 2 over 0.3 s: only the first report's time counts.
    assert meter.observe(2, 11.0, 5e11) == pytest.approx(0.5)
    for i in range(1, 8):
        assert meter.observe(2, 11.0 + i * 0.04, 5e11) is None
    assert meter.observe(3, 12.0, 5e11) == pytest.approx(0.5)


def test_meter_handles_sparse_reports_restarts_and_missing_inputs() -> None:
    meter = MfuMeter(peak_flops=1e12)
    meter.observe(100, 0.0, 1e12)
    assert meter.observe(110, 20.0, 1e12) == pytest.approx(0.5)  # 10 steps in 20 s: 2 s per step
    # Restarted from the checkpoint at step 90: no value, measuring starts again from there.
    assert meter.observe(90, 80.0, 1e12) is None
    assert meter.observe(91, 81.0, 1e12) == pytest.approx(1.0)
    assert meter.observe(92, 82.0, None) is None  # no flops in this report
    assert meter.observe(93, 83.0, 1e12) == pytest.approx(1.0)  # ...the mark still moved with it
    assert MfuMeter(peak_flops=0.0).observe(2, 2.0, 1e12) is None  # no peak configured
    unknown = MfuMeter(peak_flops=0.0)
    unknown.observe(1, 1.0, 1e12)
    assert unknown.observe(2, 2.0, 1e12) is None


def test_meter_is_safe_under_concurrent_reports() -> None:
    meter = MfuMeter(peak_flops=1e12)
    values: list[float] = []
    lock = threading.Lock()

    def rank() -> None:
        for step in range(1, 201):
            value = meter.observe(step, float(step), 1e12)
            if value is not None:
                with lock:
                    values.append(value)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Whatever the interleaving, one step per second at the peak's FLOPs is MFU 1 on every value.
    assert values and all(v == pytest.approx(1.0) for v in values)


# ---- the agent's gauges ----------------------------------------------------------------------------


def _value(metrics: AgentMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


def test_agent_gauges_publish_mfu_and_the_configured_floor() -> None:
    metrics = AgentMetrics()
    assert _value(metrics, "ftd_agent_training_mfu_ratio") == 0.0  # 0 = unknown: the alert ignores it
    assert _value(metrics, "ftd_agent_training_mfu_floor_ratio") == 0.0  # no floor: the alert is off
    metrics.configure_mfu(peak_flops_per_gpu=H100_BF16, floor_ratio=0.35)
    assert _value(metrics, "ftd_agent_training_mfu_floor_ratio") == 0.35
    flops = 0.4 * H100_BF16 * 2.0  # 40 % of the peak over a 2 s step
    assert metrics.observe_flops(10, 1000.0, flops) is None
    assert _value(metrics, "ftd_agent_training_mfu_ratio") == 0.0
    assert metrics.observe_flops(11, 1002.0, flops) == pytest.approx(0.4)
    assert _value(metrics, "ftd_agent_training_mfu_ratio") == pytest.approx(0.4)
    metrics.observe_flops(11, 1002.5, flops)  # another rank's report of the same step changes nothing
    assert _value(metrics, "ftd_agent_training_mfu_ratio") == pytest.approx(0.4)


def test_agent_save_size_is_the_largest_of_the_newest_complete_saves() -> None:
    metrics = AgentMetrics()
    assert _value(metrics, "ftd_agent_checkpoint_save_bytes") == 0.0
    for _ in range(8):  # eight local ranks, 100 bytes each
        metrics.observe_save_done(100, 100)
    assert _value(metrics, "ftd_agent_checkpoint_save_bytes") == 800
    metrics.observe_save_done(200, 100)  # the next save is still completing: the gauge does not drop
    assert _value(metrics, "ftd_agent_checkpoint_save_bytes") == 800
    for step in range(300, 300 + SAVE_SIZE_WINDOW):  # later, smaller saves push the old ones out
        metrics.observe_save_done(step, 50)
    assert _value(metrics, "ftd_agent_checkpoint_save_bytes") == 50
    metrics.observe_save_done(90, 70)  # after a rollback steps go back: the newest by arrival count
    assert _value(metrics, "ftd_agent_checkpoint_save_bytes") == 70


# ---- the wire ----------------------------------------------------------------------------------------


def test_progress_carries_optional_flops() -> None:
    progress = cluster_pb2.Progress(step=5)
    assert not progress.HasField("flops")
    progress.flops = 1.5e15
    wire = cluster_pb2.Progress.FromString(progress.SerializeToString())
    assert wire.HasField("flops") and wire.flops == 1.5e15
    assert cluster_pb2.Progress.DESCRIPTOR.fields_by_name["flops"].number == 5
