"""The planned hand-over decision (coordinator.handover): a pure function of now, the drain and the
newest restorable step and the step the ranks parked at."""

from __future__ import annotations

import pytest

from ftd.coordinator.handover_rules import Drain, HandoverPolicy, decode, encode, handover_due, parked_step_of

T0 = 1_800_000_000.0


def drain(deadline: float = 0.0, baseline: int = 40) -> Drain:
    return Drain("node-1", "aws spot terminate notice", T0, deadline, baseline)


def test_waits_for_the_parked_step_not_any_newer_one() -> None:
    """The demo's lost step: a memory snapshot of step 41 committed while the ranks head for their stop
    step 42 must not commit the hand-over (the new world would redo step 42)."""
    due, why = handover_due(T0 + 1, drain(deadline=T0 + 120), restore_step=40, has_job=True)
    assert not due and "waiting for the final checkpoint of node-1" in why and "119.0s" in why
    assert "no rank parked yet" in why
    due, why = handover_due(T0 + 2, drain(deadline=T0 + 120), restore_step=41, has_job=True)
    assert not due, why
    due, why = handover_due(T0 + 3, drain(deadline=T0 + 120), 41, True, parked_step=42)
    assert not due and "ranks parked at step 42" in why
    due, why = handover_due(T0 + 4, drain(deadline=T0 + 120), 42, True, parked_step=42)
    assert due and "step 42 is valid" in why


def test_a_failed_final_save_hands_over_at_once_from_the_newest_step() -> None:
    due, why = handover_due(T0 + 1, drain(deadline=T0 + 120), 41, True, parked_step=-1)
    assert due and "final checkpoint failed" in why and "step 41" in why


def test_the_worlds_parked_step() -> None:
    assert parked_step_of([]) is None
    assert parked_step_of([42, 42]) == 42
    assert parked_step_of([42, -1]) == -1


def test_deadline_forces_the_hand_over_before_the_node_goes() -> None:
    policy = HandoverPolicy(margin_s=5.0)
    assert not handover_due(T0 + 114.9, drain(deadline=T0 + 120), 40, True, policy)[0]
    due, why = handover_due(T0 + 115, drain(deadline=T0 + 120), 40, True, policy)
    assert due and "without a final checkpoint" in why and "step 40" in why


def test_without_deadline_waits_at_most_max_wait() -> None:
    policy = HandoverPolicy(max_wait_s=30.0)
    assert not handover_due(T0 + 29, drain(), 40, True, policy)[0]
    due, why = handover_due(T0 + 30, drain(), 40, True, policy)
    assert due and "no final checkpoint after 30s" in why


def test_no_job_hands_over_at_once() -> None:
    due, why = handover_due(T0, drain(deadline=T0 + 30), -1, has_job=False)
    assert due and "no training job" in why


def test_round_trip_and_policy_validation() -> None:
    d = drain(deadline=T0 + 30)
    assert decode(encode(d)) == d
    with pytest.raises(ValueError, match="margin"):
        HandoverPolicy(margin_s=-1)
