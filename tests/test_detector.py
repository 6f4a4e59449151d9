"""Failure detection as a pure function: the clock is an argument, nothing sleeps."""

from __future__ import annotations

import pytest

from ftd.coordinator.detector import DetectorSettings, Liveness, State, judge, judge_one

S = DetectorSettings(suspect_after_s=1.2, dead_after_s=2.5, disconnect_dead_after_s=1.5, stall_after_s=1.0)


def test_fresh_heartbeat_is_alive() -> None:
    v = judge_one(100.0, Liveness(last_seen=99.8, connected=True), S)
    assert v.state is State.ALIVE


def test_silence_goes_suspect_then_dead_with_reason() -> None:
    live = Liveness(last_seen=100.0, connected=True)
    assert judge_one(101.0, live, S).state is State.ALIVE
    assert judge_one(101.3, live, S).state is State.SUSPECT
    dead = judge_one(102.6, live, S)
    assert dead.state is State.DEAD
    assert "no heartbeat for 2.60s" in dead.reason and "dead_after_s=2.5" in dead.reason
    assert dead.silent_s == pytest.approx(2.6)


def test_closed_stream_is_dead_sooner() -> None:
    live = Liveness(last_seen=100.0, connected=False, disconnected_at=100.2)
    assert judge_one(100.3, live, S).state is State.SUSPECT
    v = judge_one(101.8, live, S)
    assert v.state is State.DEAD and "stream closed" in v.reason


def test_reconnected_stream_clears_disconnect_evidence() -> None:
    live = Liveness(last_seen=101.0, connected=True, disconnected_at=None)
    assert judge_one(101.9, live, S).state is State.ALIVE


def test_grace_prevents_death_until_it_ends() -> None:
    live = Liveness(last_seen=100.0, grace_until=105.0)
    assert judge_one(104.9, live, S).state is State.SUSPECT
    assert "grace" in judge_one(104.9, live, S).reason
    assert judge_one(105.1, live, S).state is State.DEAD


def test_a_stalled_judge_declares_nobody_dead() -> None:
    table = {"a": Liveness(last_seen=100.0, connected=True), "b": Liveness(last_seen=103.9, connected=True)}
    stalled = judge(104.0, table, S, last_judged=102.0)
    assert stalled.stalled and "did not run for 2.00s" in stalled.stall_reason
    assert stalled.verdicts["a"].state is State.SUSPECT
    normal = judge(104.0, table, S, last_judged=103.9)
    assert not normal.stalled
    assert normal.verdicts["a"].state is State.DEAD and normal.verdicts["b"].state is State.ALIVE


def test_a_stalled_judge_still_declares_the_watched_whose_evidence_waited_for_it() -> None:
    table = {"a": Liveness(last_seen=100.0, connected=True), "b": Liveness(last_seen=100.0, connected=True)}
    stalled = judge(104.0, table, S, last_judged=102.0, watched={"a"})
    assert stalled.stalled and stalled.verdicts["a"].state is State.DEAD
    assert stalled.verdicts["b"].state is State.SUSPECT


def test_sigkill_detection_bound_of_the_defaults() -> None:
    """A SIGKILLed agent closes its socket at once: with heartbeats every 0.5 s and a 0.1 s tick,
    the worst case is bounded well under 3 s; a silent (hung) node under 3 s too."""
    worst_last_seen = 100.0  # last heartbeat just before the kill
    kill_at = 100.499
    for now in (kill_at + S.disconnect_dead_after_s + 0.1 * i for i in range(3)):
        v = judge_one(now, Liveness(last_seen=worst_last_seen, connected=False, disconnected_at=kill_at), S)
        if v.state is State.DEAD:
            assert now - kill_at <= 3.0
            break
    else:
        raise AssertionError("never declared dead")
    hung = Liveness(last_seen=100.0, connected=True)
    assert judge_one(100.0 + S.dead_after_s + 0.1, hung, S).state is State.DEAD


@pytest.mark.parametrize(
    "kw",
    [dict(suspect_after_s=3, dead_after_s=2), dict(disconnect_dead_after_s=0), dict(stall_after_s=0),
     dict(disconnect_dead_after_s=5)],
)
def test_settings_validate(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DetectorSettings(**kw)
