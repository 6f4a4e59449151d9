"""The straggler detector (coordinator.stragglers) on recorded windows with a fake clock: a slow
node is flagged only after k of n judgements, and the false alarms the anchors warn about (a uniform
slowdown, one slow step, a checkpoint step, the warm-up) flag nobody."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ftd.coordinator.stragglers import (
    REPLACE,
    Judgement,
    StepSample,
    StepWindow,
    StragglerConfig,
    judge_stragglers,
    replacement_due,
)

NODES = ("node-0", "node-1", "node-2")
CONFIG = StragglerConfig(window_s=30.0, min_samples=5, min_evidence_s=4.0, warmup_s=5.0)


def record(window: StepWindow, seconds: float, compute: Callable[[str, int, float], float], start: float = 0.0,
           step_s: float = 1.0, save_every: int = 0) -> float:
    """Steps every ``step_s`` for ``seconds`` on every node; returns the time of the last one."""
    t, step = start, int(start / step_s)
    while t < start + seconds:
        for node in NODES:
            window.add(node, StepSample(t, step, compute(node, step, t), save=bool(save_every) and
                                        step % save_every == 0), CONFIG)
        t += step_s
        step += 1
    return t - step_s


def judge_every(window: StepWindow, until: float, since: float, every: float = 2.0,
                config: StragglerConfig = CONFIG) -> list[list[Judgement]]:
    out, t = [], since
    while t <= until:
        judged, window.flags = judge_stragglers(window, config, t, NODES)
        out.append(judged)
        t += every
    return out


def by_node(judged: list[Judgement]) -> dict[str, Judgement]:
    return {j.node_id: j for j in judged}


def test_a_slow_node_is_a_straggler_only_after_k_of_n_judgements() -> None:
    window = StepWindow()
    window.round_started(0.0)
    def compute(node: str, step: int, t: float) -> float:
        return 0.30 if node == "node-1" and t >= 12 else 0.10

    record(window, 12.0, compute)
    # Before node-1 slowed down its median is everybody's: nobody is slow.
    first = by_node(judge_stragglers(window, CONFIG, 11.0, NODES)[0])
    assert all(not j.straggler and j.score == pytest.approx(1.0) for j in first.values()), first
    end = record(window, 28.0, compute, start=12.0)
    rounds = judge_every(window, end, since=30.0)
    flagged = [by_node(r)["node-1"].straggler for r in rounds]
    assert flagged[:CONFIG.k - 1] == [False] * (CONFIG.k - 1) and flagged[CONFIG.k - 1] and all(flagged[CONFIG.k:])
    last = by_node(rounds[-1])
    assert last["node-1"].score == pytest.approx(3.0) and "straggler: score 3.00" in last["node-1"].reason
    assert "median compute 300 ms against the others' 100 ms" in last["node-1"].reason
    assert not last["node-0"].straggler and last["node-0"].score == pytest.approx(1 / 2, rel=0.5)


def test_a_uniform_slowdown_flags_nobody() -> None:
    window = StepWindow()
    window.round_started(0.0)
    end = record(window, 60.0, lambda node, step, t: 0.10 if t < 20 else 0.40)
    for judged in judge_every(window, end, since=10.0):
        assert not any(j.straggler for j in judged)
        assert all(j.score == pytest.approx(1.0) for j in judged if j.score)


def test_one_slow_step_and_checkpoint_steps_flag_nobody() -> None:
    window = StepWindow()
    window.round_started(0.0)

    def compute(node: str, step: int, t: float) -> float:
        if node == "node-2" and step == 20:
            return 5.0  # one slow batch
        if node == "node-0" and step % 4 == 0:
            return 2.0  # its steps with a save (marked)
        return 0.1

    end = record(window, 40.0, compute, save_every=4)
    for judged in judge_every(window, end, since=10.0):
        assert not any(j.straggler for j in judged), judged


def test_the_warm_up_and_too_little_evidence_are_not_judged() -> None:
    window = StepWindow()
    window.round_started(100.0)
    end = record(window, 8.0, lambda node, step, t: 1.0 if node == "node-1" else 0.1, start=100.0)
    judged = by_node(judge_stragglers(window, CONFIG, end, NODES)[0])
    assert all(j.score == 0.0 and not j.straggler for j in judged.values())
    assert "not judged: 3 of the 5 steps needed" in judged["node-1"].reason, "only the steps after the warm-up count"
    # A new round starts the evidence afresh.
    window.round_started(200.0)
    assert window.samples == {} and window.flags == {}
    lone = StepWindow()
    lone.round_started(0.0)
    for t in range(10, 30):
        lone.add("node-0", StepSample(float(t), t, 0.1), CONFIG)
    only = judge_stragglers(lone, CONFIG, 29.0, ("node-0",))[0]
    assert only[0].reason == "not judged: fewer than 2 nodes with evidence"


def test_a_repeated_report_of_one_step_is_one_sample_and_old_samples_leave_the_window() -> None:
    window = StepWindow()
    for t in (1.0, 1.5, 2.0):
        window.add("node-0", StepSample(t, 7, 0.1), CONFIG)
    assert len(window.samples["node-0"]) == 1
    window.add("node-0", StepSample(40.0, 8, 0.1), CONFIG)
    assert [s.step for s in window.samples["node-0"]] == [8]
    window.forget(["node-1"])
    assert window.samples == {}


def straggler(score: float) -> list[Judgement]:
    return [Judgement("node-1", score, True, f"straggler: score {score:.2f}"), Judgement("node-0", 1.0, False, "")]


def test_replacement_is_rate_limited_and_never_spends_the_last_spare_on_a_marginal_score() -> None:
    replace = StragglerConfig(action=REPLACE, min_replace_interval_s=600.0, strong_score=2.0)
    due, why = replacement_due(1000.0, straggler(2.5), replace, spares=1, last_replaced_at=None, draining=False)
    assert due is not None and due.node_id == "node-1" and "score 2.50" in due.why
    due, why = replacement_due(1000.0, straggler(2.5), replace, spares=1, last_replaced_at=700.0, draining=False)
    assert due is None and "next allowed in 300s" in why
    due, why = replacement_due(1000.0, straggler(1.6), replace, spares=1, last_replaced_at=None, draining=False)
    assert due is None and "marginal score 1.60" in why
    assert replacement_due(1000.0, straggler(1.6), replace, spares=2, last_replaced_at=None, draining=False)[0]
    due, why = replacement_due(1000.0, straggler(3.0), replace, spares=0, last_replaced_at=None, draining=False)
    assert due is None and "no healthy spare" in why
    due, why = replacement_due(1000.0, straggler(3.0), replace, spares=2, last_replaced_at=None, draining=True)
    assert due is None and "another hand-over is pending" in why
    due, why = replacement_due(1000.0, straggler(3.0), StragglerConfig(), spares=2, last_replaced_at=None,
                               draining=False)
    assert due is None and "straggler_action is alert" in why
    assert replacement_due(1000.0, straggler(3.0)[1:], replace, 2, None, False) == (None, "no straggler")


def test_jitter_at_a_millisecond_is_no_straggler() -> None:
    window = StepWindow()
    window.round_started(0.0)
    end = record(window, 40.0, lambda node, step, t: 0.003 if node == "node-1" else 0.001)
    for judged in judge_every(window, end, since=20.0):
        one = by_node(judged)["node-1"]
        assert one.score == pytest.approx(3.0) and not one.straggler


def test_config_validation() -> None:
    for bad, match in (({"threshold": 1.0}, "threshold"), ({"k": 4, "n": 3}, "k <= n"),
                       ({"action": "evict"}, "action"), ({"strong_score": 1.2}, "strong_score")):
        with pytest.raises(ValueError, match=match):
            StragglerConfig(**bad)  # type: ignore[arg-type]
