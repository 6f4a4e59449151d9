"""The planned hand-over decision (coordinator.handover): a pure function of now, the drain and the
newest restorable step."""

from __future__ import annotations

import pytest

from ftd.coordinator.handover_rules import Drain, HandoverPolicy, decode, encode, handover_due

T0 = 1_800_000_000.0


def drain(deadline: float = 0.0, baseline: int = 40) -> Drain:
    return Drain("node-1", "aws spot terminate notice", T0, deadline, baseline)


def test_waits_for_a_newer_checkpoint_then_hands_over() -> None:
    due, why = handover_due(T0 + 1, drain(deadline=T0 + 120), restore_step=40, has_job=True)
    assert not due and "waiting for the final checkpoint of node-1" in why and "119.0s" in why
    due, why = handover_due(T0 + 2, drain(deadline=T0 + 120), restore_step=57, has_job=True)
    assert due and "step 57 is valid" in why


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
