"""coordinator/rollback_rules.py as pure decisions: the target goes before the anomaly, later steps
become suspect, one rollback per incident (never for an old round's report), the gathered reports'
earliest step wins, a restored state that fails at once is suspect too, and a budget stops a loop."""

from __future__ import annotations

import pytest

from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, FileEntry, ShardRecord
from ftd.coordinator import rendezvous as job_rules
from ftd.coordinator.rollback_rules import (
    SUSPECT,
    RollbackConfig,
    Seen,
    due,
    job_of,
    rollback_due,
    suspect_reason,
)

JOB = "train"
ON = RollbackConfig(action="rollback", max_rollbacks=2, gather_s=2.0)


def record(step: int, invalid: str = "", location: str = "node-0") -> CheckpointRecord:
    shards = {r: ShardRecord(r, 10, "c", (FileEntry("state.pt", 10, "0a0b0c0d"),),
                             frozenset({CopyRef("ssd", location)})) for r in range(2)}
    return CheckpointRecord(JOB, step, 1, 2, "torch", 0.0, shards, invalid_reason=invalid)


def seen(step: int, rank: int = 1, round_: int | None = 0, node: str = "node-1", at: float = 0.0,
         kind: str = "nan", restored: int | None = None) -> Seen:
    return Seen(node, step, rank, kind, round_, f"rank {rank} step {step}: loss is nan", at, restored)


JOB_STATE = job_rules.JobState(JOB, round=0, epoch=1, members=("node-0", "node-1"))


def test_the_target_is_the_newest_restorable_step_before_the_anomaly_and_later_steps_are_suspect() -> None:
    records = [record(s) for s in (10, 20, 30, 40)]
    plan, why = rollback_due([seen(35)], JOB_STATE, records, ON)
    assert why == "rollback" and plan is not None and not plan.close
    assert plan.target == 30 and plan.suspects == (40,) and plan.first_bad == 35
    assert "rolled back before step 35 (restorable now: step 30" in plan.reason and "rollback 1 of 2" in plan.reason
    assert suspect_reason(plan).startswith(SUSPECT) and "step 35" in suspect_reason(plan)


def test_a_checkpoint_of_the_anomalous_step_itself_is_suspect() -> None:
    plan, _ = rollback_due([seen(30)], JOB_STATE, [record(s) for s in (10, 20, 30)], ON)
    assert plan is not None and plan.target == 20 and plan.suspects == (30,)


def test_the_earliest_gathered_report_wins() -> None:
    # The NaN on rank 1 at 35 reaches rank 0 through the all-reduce: node-0 reports 36, and first.
    reports = [seen(36, rank=0, node="node-0", at=0.0), seen(35, rank=1, node="node-1", at=0.4)]
    plan, _ = rollback_due(reports, JOB_STATE, [record(s) for s in (30, 34, 35, 36)], ON)
    assert plan is not None and plan.target == 34 and plan.anomaly.node_id == "node-1"
    assert plan.suspects == (35, 36)


def test_gathering_waits_gather_s_after_the_first_report() -> None:
    reports = [seen(36, at=10.0), seen(35, at=11.5)]
    assert not due(reports, 11.9, ON)
    assert due(reports, 12.0, ON)
    assert not due([], 100.0, ON)


def test_an_old_rounds_report_and_an_answered_one_change_nothing() -> None:
    records = [record(s) for s in (10, 20, 30)]
    after = job_rules.rolled_back(0.0, JOB_STATE, seen(25).key, "rolled back")
    assert after.round == 1 and after.rollbacks == 1 and after.restarts == 0
    plan, why = rollback_due([seen(25, round_=0)], after, records, ON)
    assert plan is None and "round(s) 0, which job train has left" in why
    # An agent that does not say its round: the key of the answered report still matches.
    no_round = job_rules.rolled_back(0.0, JOB_STATE, seen(25, round_=None).key, "rolled back")
    plan, why = rollback_due([seen(25, round_=None)], no_round, records, ON)
    assert plan is None and why == "this anomaly was already rolled back"


def test_the_same_fault_again_in_the_new_round_is_a_new_incident() -> None:
    after = job_rules.rolled_back(0.0, JOB_STATE, seen(25).key, "rolled back")
    plan, _ = rollback_due([seen(25, round_=1)], after, [record(s) for s in (10, 20)], ON)
    assert plan is not None and plan.target == 20  # 25 is bad again, not 20: the rerun from 20 was clean to 24


def test_a_restored_state_that_fails_at_once_is_suspect_too() -> None:
    after = job_rules.rolled_back(0.0, JOB_STATE, seen(25).key, "rolled back")
    plan, _ = rollback_due([seen(22, round_=1, restored=20)], after, [record(s) for s in (10, 20)], ON)
    assert plan is not None and plan.first_bad == 22 and plan.target == 20, "a later step: the restore was fine"
    plan, _ = rollback_due([seen(21, round_=1, restored=20)], after, [record(s) for s in (10, 20)], ON)
    assert plan is not None and plan.first_bad == 20 and plan.target == 10 and plan.suspects == (20,)


def test_the_budget_closes_the_job_instead_of_a_loop() -> None:
    state = JOB_STATE
    for n in range(2):
        state = job_rules.rolled_back(0.0, state, seen(25, round_=n).key, "rolled back")
    plan, why = rollback_due([seen(25, round_=2)], state, [record(s) for s in (10, 20)], ON)
    assert why == "close" and plan is not None and plan.close and plan.suspects == ()
    assert "rollback budget of job train exhausted: 2 rollbacks" in plan.reason


def test_no_checkpoint_before_the_anomaly_alerts_only() -> None:
    plan, why = rollback_due([seen(5)], JOB_STATE, [record(s) for s in (10, 20)], ON)
    assert plan is None and "no restorable checkpoint before step 5" in why


def test_invalid_and_unreachable_steps_are_no_target() -> None:
    records = [record(10), record(20, invalid="corrupt"), record(30, location="node-9")]
    plan, _ = rollback_due([seen(35)], JOB_STATE, records, ON, unreachable={"node-9"})
    assert plan is not None and plan.target == 10
    assert plan.suspects == ()  # the corrupt step is not re-marked


def test_alert_only_and_a_closed_job_do_nothing() -> None:
    records = [record(10)]
    plan, why = rollback_due([seen(15)], JOB_STATE, records, RollbackConfig())
    assert plan is None and why == "anomaly_action is alert: alerted only"
    plan, why = rollback_due([seen(15)], job_rules.close(JOB_STATE, "done"), records, ON)
    assert plan is None and "closed" in why


def test_the_job_of_a_node_is_the_open_one_whose_round_has_it() -> None:
    other = job_rules.JobState("other", members=("node-1",), closed=True)
    assert job_of("node-1", [other, JOB_STATE]) == JOB_STATE
    assert job_of("node-7", [other, JOB_STATE]) is None


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="anomaly action"):
        RollbackConfig(action="reboot")
    with pytest.raises(ValueError, match="max_rollbacks"):
        RollbackConfig(max_rollbacks=-1)
