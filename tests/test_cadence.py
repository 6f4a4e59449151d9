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
    assert memory_interval(p, stall_s=0.05, step_s=0.1) == 5  # 50 ms stall, 10 ms allowed per step
    d = decide(p, 7, 0.0, 0, 0.0, stall_s=0.05, step_s=0.1)
    assert not d.memory and "next memory snapshot in 3" in d.reason
    assert "widened from 1" in decide(p, 10, 0.0, 0, 0.0, stall_s=0.05, step_s=0.1).reason


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="persist_every"):
        CadencePolicy(persist_every_steps=0)
    with pytest.raises(ValueError, match=">= 0"):
        CadencePolicy(memory_every_steps=-1)
