"""The chaos matrix's invariants as pure functions: each one fails on the history it must reject."""

from __future__ import annotations

from chaos_tests import invariants as inv


def ev(seq: int, kind: str, epoch: int = 0, node: str = "") -> dict[str, object]:
    return {"seq": seq, "at_unix_s": 0.0, "kind": kind, "node_id": node, "epoch": epoch, "message": ""}


def test_epochs() -> None:
    assert inv.epochs_increase([ev(1, "epoch_changed", 1), ev(3, "epoch_changed", 2), ev(2, "node_dead", 1)]).ok
    twice = inv.epochs_increase([ev(1, "epoch_changed", 2), ev(2, "epoch_changed", 2)])
    assert not twice.ok and "committed twice" in twice.detail
    assert not inv.epochs_increase([ev(1, "epoch_changed", 3), ev(2, "epoch_changed", 2)]).ok


def test_checkpoints_lost_only_by_retention() -> None:
    assert inv.no_valid_checkpoint_lost([10, 20, 30], [20, 30, 40, 50]).ok  # 10 retired by retention
    lost = inv.no_valid_checkpoint_lost([10, 20, 30], [10, 20])
    assert not lost.ok and "[30]" in lost.detail


def test_resume_and_false_deaths_and_finish() -> None:
    records = [{"event": "start", "t": 5.0, "restored_step": -1}, {"event": "step", "t": 6.0, "step": 0},
               {"event": "start", "t": 20.0, "restored_step": 30}]
    assert inv.resumed_at_or_after(records, 10.0, 30).ok
    assert not inv.resumed_at_or_after(records, 10.0, 40).ok
    events = [ev(5, "node_dead", node="node-0"), ev(9, "node_dead", node="node-1")]
    assert inv.only_faulted_declared_dead(events, 4, {"node-0", "node-1"}).ok
    wrong = inv.only_faulted_declared_dead(events, 4, {"node-0"})
    assert not wrong.ok and "node-1" in wrong.detail
    assert not inv.job_finished(records, 100).ok
    assert inv.job_finished([*records, {"event": "done", "step": 99}], 99).ok
    ok, flags, why = inv.summary([inv.job_finished(records, 100), inv.epochs_increase([])])
    assert not ok and flags == {"job_finished": False, "one_world_per_epoch": True} and "job_finished" in why
