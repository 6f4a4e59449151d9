"""The save cadence as a pure policy: memory every step unless the stall forbids, durable by steps
or time."""

from __future__ import annotations

import pytest

from ftd.training.cadence import CadencePolicy, decide, memory_interval


def test_memory_every_step_durable_every_thousand() -> None:
    p = CadencePolicy()
    first = decide(p, 0, 0.0, -1, 0.0)
    assert first.memory and first.persist
    mid = decide(p, 999, 10.0, 0, 0.0)
    assert mid.memory and not mid.persist and "every 1 step" in mid.reason
    due = decide(p, 1000, 10.0, 0, 0.0)
    assert due.persist and "1000 steps" in due.reason


def test_time_based_persistence() -> None:
    p = CadencePolicy(persist_every_steps=0, persist_every_s=600)
    assert not decide(p, 5, 599.0, 0, 0.0).persist
    assert decide(p, 6, 600.0, 0, 0.0).persist


def test_a_slow_snapshot_widens_the_memory_interval() -> None:
    p = CadencePolicy(max_stall_fraction=0.1)
    assert memory_interval(p, stall_s=0.001, step_s=0.1) == 1
    # 50 ms stall, 10 ms allowed per step: 5 steps needed, rounded up to a power of two so that ranks
    # widening differently (2, 4, 8...) still snapshot common steps.
    assert memory_interval(p, stall_s=0.05, step_s=0.1) == 8
    assert memory_interval(p, stall_s=0.015, step_s=0.1) == 2
    d = decide(p, 7, 0.0, 0, 0.0, stall_s=0.05, step_s=0.1)
    assert not d.memory and "next memory snapshot in 1" in d.reason
    assert "widened from 1" in decide(p, 16, 0.0, 0, 0.0, stall_s=0.05, step_s=0.1).reason
    # Two ranks that widened to 2 and 8 both snapshot every multiple of 8.
    fast, slow = memory_interval(p, 0.015, 0.1), memory_interval(p, 0.05, 0.1)
    both = [s for s in range(1, 33) if s % fast == 0 and s % slow == 0]
    assert both == [8, 16, 24, 32]


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="persist_every"):
        CadencePolicy(persist_every_steps=0)
    with pytest.raises(ValueError, match=">= 0"):
        CadencePolicy(memory_every_steps=-1)
