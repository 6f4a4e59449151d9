"""The training side's step timer and the agent's node timing, with a fake clock: what report_step
sends the straggler detector."""

from __future__ import annotations

from ftd.agent.daemon import slowest
from ftd.training.step_timing import StepTimer
from ftd.v1 import cluster_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_step_reports_its_compute_data_and_wall_time_then_starts_afresh() -> None:
    clock = Clock()
    timer = StepTimer(rank=3, clock=clock)
    assert timer.take() is None, "nothing timed: a job that does not use the timer sends nothing"
    with timer.data():
        clock.now += 0.1
    with timer.compute():
        clock.now += 0.25
    with timer.compute():  # phases add up within a step
        clock.now += 0.05
    clock.now += 0.6  # waiting in collectives, the optimizer, ...
    timer.saved()
    got = timer.take()
    assert got is not None and got.rank == 3 and got.save
    assert (round(got.compute_s, 6), round(got.data_s, 6), round(got.wall_s, 6)) == (0.3, 0.1, 1.0)
    with timer.compute():
        clock.now += 0.2
    again = timer.take()
    assert again is not None and round(again.compute_s, 6) == 0.2 and not again.save
    assert round(again.wall_s, 6) == 0.2


def test_an_exception_in_a_phase_still_counts_its_time() -> None:
    clock = Clock()
    timer = StepTimer(rank=0, clock=clock)
    try:
        with timer.compute():
            clock.now += 0.5
            raise RuntimeError("CUDA error")
    except RuntimeError:
        pass
    got = timer.take()
    assert got is not None and round(got.compute_s, 6) == 0.5


def test_the_node_reports_its_slowest_rank() -> None:
    timings = {r: cluster_pb2.StepTiming(compute_s=c, rank=r) for r, c in ((0, 0.1), (1, 0.4), (2, 0.2))}
    assert slowest(timings).rank == 1
