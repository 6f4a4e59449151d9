"""The goodput accounting (coordinator/goodput.py) replayed over recorded timelines: what the leader
learns, in order, with its clock. Each timeline is built from a few training spans (a step every
0.2 s, reported by two nodes once a second) and the failures, rounds and restores between them."""

from __future__ import annotations

import pytest

from coordinator import goodput as gp
from coordinator.goodput import FAILURE, RESTORED, ROUND, STEP, Record

STEP_S = 0.2


def train(t0: float, t1: float, first: int, nodes: int = 2) -> tuple[list[Record], int]:
    """Steps from ``first`` at STEP_S each over [t0, t1), each node reporting its newest once a second;
    returns the records and the last step made."""
    out: list[Record] = []
    t, step = t0, first
    while t + 1.0 <= t1 + 1e-9:
        t += 1.0
        step = first + round((t - t0) / STEP_S)
        out += [Record(t + 0.01 * n, STEP, step, reported_at=t) for n in range(nodes)]
    return out, step


def replay(records: list[Record]) -> gp.Ledger:
    ledger = gp.Ledger("demo")
    for r in records:
        ledger.apply(r)
    return ledger


def test_failure_free_training_is_all_productive() -> None:
    records, last = train(1000.0, 1100.0, 0)
    ledger = replay(records)
    report = ledger.report(1100.0)
    assert ledger.step_time == pytest.approx(STEP_S)
    assert report["steps_kept"] == last - 5  # counted from the first report (step 5 at t=1001)
    assert report["goodput_ratio"] == pytest.approx(1.0, abs=0.01)
    assert report["incidents"] == [] and report["failures"] == 0


def test_a_node_death_costs_detection_restart_and_the_redone_steps() -> None:
    before, last = train(1000.0, 1100.0, 0)  # step 500 at t=1100; the newest checkpoint: step 490
    death = [Record(1102.0, FAILURE, cause="node_dead", node_id="node-1", since=1100.0),
             Record(1104.0, ROUND, 490, cause="node_lost"),
             Record(1108.0, RESTORED, 490, reported_at=1107.5)]
    stale = [Record(1104.5, STEP, last, reported_at=1100.0)]  # a survivor's old report, read late
    after, _ = train(1110.0, 1200.0, 490)
    ledger = replay(before + death + stale + after)
    report = ledger.report(1200.0)
    [incident] = report["incidents"]
    assert incident["kind"] == "node_dead" and incident["node_id"] == "node-1" and not incident["open"]
    assert incident["detection_s"] == pytest.approx(2.0)
    assert incident["recovery_s"] == pytest.approx(9.0)  # declared at 1102, first new step read at 1111
    assert incident["steps_redone"] == 10 and incident["restored_step"] == 490
    assert incident["redone_s"] == pytest.approx(10 * STEP_S)
    # Everything adds up: productive + detection + restart + redone + other = wall time.
    lost = report["lost_s"]
    assert report["productive_s"] + sum(lost.values()) == pytest.approx(report["wall_s"], rel=0.01)
    assert lost["other"] < 1.5  # only the reporting granularity
    assert report["goodput_ratio"] == pytest.approx((199 - 13) / 199, abs=0.01)
    assert ledger.lost_total(1200.0) == pytest.approx({"detection": 2.0, "restart": 9.0, "redone_steps": 2.0})


def test_a_failure_during_the_recovery_joins_the_open_incident() -> None:
    before, _ = train(1000.0, 1100.0, 0)
    overlapping = [Record(1102.0, FAILURE, cause="node_dead", node_id="node-1", since=1100.0),
                   Record(1104.0, ROUND, 490, cause="node_lost"),
                   # the spare that took the rank dies before the first step of the new world
                   Record(1107.0, FAILURE, cause="node_dead", node_id="node-2", since=1105.0),
                   Record(1109.0, ROUND, 480, cause="node_lost"),  # its memory copy went with it
                   Record(1114.0, RESTORED, 480, reported_at=1113.0)]
    after, _ = train(1115.0, 1200.0, 480)
    report = replay(before + overlapping + after).report(1200.0)
    [incident] = report["incidents"]
    assert incident["also"] == ["node_dead node-2"] and report["failures"] == 2
    assert incident["detection_s"] == pytest.approx(2.0)
    assert incident["recovery_s"] == pytest.approx(14.0)  # 1102 -> 1116, one outage, not two
    assert incident["steps_redone"] == 20  # from step 500 back to 480
    assert report["productive_s"] + sum(report["lost_s"].values()) == pytest.approx(report["wall_s"], rel=0.01)


def test_a_preemption_handed_over_at_its_parked_step_loses_no_step() -> None:
    before, _ = train(1000.0, 1100.0, 0)
    notice = [Record(1100.5, FAILURE, cause="handed_over", node_id="node-1"),
              Record(1101.0, STEP, 507, reported_at=1101.0),  # training goes on to the parked step
              Record(1101.5, STEP, 507, reported_at=1101.4),
              Record(1102.0, ROUND, 507, cause="handed_over"),
              Record(1104.0, RESTORED, 507, reported_at=1103.8)]
    after, _ = train(1105.0, 1150.0, 507)
    report = replay(before + notice + after).report(1150.0)
    [incident] = report["incidents"]
    assert incident["kind"] == "handed_over" and incident["steps_redone"] == 0 and incident["redone_s"] == 0
    assert incident["step_before"] == 507 and incident["restored_step"] == 507
    assert incident["detection_s"] == pytest.approx(0.5)  # from the last step read (1100.0) to the notice
    assert incident["recovery_s"] == pytest.approx(5.5)  # the notice to the first step read after the round


def test_a_coordinator_failover_in_the_middle_of_an_incident_loses_nothing() -> None:
    before, _ = train(1000.0, 1100.0, 0)
    fail = [Record(1102.0, FAILURE, cause="node_dead", node_id="node-1", since=1100.0)]
    rest = [Record(1104.0, ROUND, 490, cause="node_lost"), Record(1108.0, RESTORED, 490, reported_at=1107.5)]
    after, _ = train(1110.0, 1200.0, 490)
    one_leader = replay(before + fail + rest + after).report(1200.0)

    old = replay(before + fail)
    new = gp.decode(gp.encode(old))  # persisted with the incident, read by the next leader
    for r in rest + after[6:]:  # the new leader was not there for the new world's first 3 reports
        new.apply(r)
    failed_over = new.report(1200.0)
    assert failed_over["incidents"][0]["kind"] == "node_dead"
    for field in ("steps_kept", "productive_s", "goodput_ratio", "steps_redone"):
        assert failed_over[field] == pytest.approx(one_leader[field]), field
    mine, theirs = failed_over["incidents"][0], one_leader["incidents"][0]
    assert mine["detection_s"] == pytest.approx(theirs["detection_s"])
    assert mine["recovery_s"] == pytest.approx(theirs["recovery_s"] + 3.0)  # the step it saw first came later


def test_a_round_no_failure_explains_is_a_worker_failure_timed_from_the_last_step() -> None:
    before, _ = train(1000.0, 1100.0, 0)
    ledger = replay([*before, Record(1103.0, ROUND, 500, cause="worker_failed")])
    [incident] = ledger.report(1103.0)["incidents"]
    assert incident["kind"] == "worker_failed" and incident["open"]
    assert incident["detection_s"] == pytest.approx(3.0)  # since the last step read (1100.0)
    assert incident["steps_redone"] == 0


def test_a_window_counts_only_its_own_steps_and_incidents() -> None:
    before, _ = train(1000.0, 2000.0, 0)
    death = [Record(2002.0, FAILURE, cause="node_dead", node_id="node-1", since=2000.0),
             Record(2004.0, ROUND, 4990, cause="node_lost")]
    after, _ = train(2010.0, 3000.0, 4990)
    ledger = replay(before + death + after)
    recent = ledger.report(3000.0, since=2500.0)
    assert recent["incidents"] == []
    assert recent["goodput_ratio"] == pytest.approx(1.0, abs=0.07)  # 30 s samples: the window's edge
    whole = ledger.report(3000.0)
    assert len(whole["incidents"]) == 1 and whole["goodput_ratio"] < recent["goodput_ratio"]


def test_a_corrupt_ledger_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a goodput ledger"):
        gp.decode(b'{"steps": 3}')
    with pytest.raises(ValueError):
        gp.decode(b"not json")
    with pytest.raises(ValueError, match="unknown goodput record kind"):
        gp.Ledger("demo").apply(Record(1.0, "bogus"))
