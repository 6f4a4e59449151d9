"""A mass silence (coordinator/detector.py ``mass_hold``): many nodes silent together are held suspect, not
declared dead, for ``mass_silence_hold_s``; a few silent nodes die as always; a real mass failure is declared
once the hold ends. The pure rule, then the leader's tick on the in-memory store with a hand-moved clock."""

from __future__ import annotations

import pytest
from controller_harness import Clock, hb, make, reg, run, step

from ftd.coordinator.control import Controller
from ftd.coordinator.detector import Hold, MassSilence, State, mass_hold
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.settings import SettingsError

RULE = MassSilence(fraction=0.1, min_nodes=8, hold_s=10.0)


def test_a_mass_is_more_than_the_fraction_and_the_floor() -> None:
    assert mass_hold(0.0, 8, 0, 20, None, RULE) is None, "8 is not more than max(8, 2)"
    held = mass_hold(0.0, 9, 0, 20, None, RULE)
    assert held is not None and (held.since, held.until) == (0.0, 10.0) and "9 node(s) silent" in held.reason
    assert mass_hold(0.0, 150, 0, 2000, None, RULE) is None, "150 of 2,000 is under 10 %"
    assert mass_hold(0.0, 150, 60, 2000, None, RULE) is not None, "with 60 declared dead lately it is a mass"
    assert mass_hold(0.0, 0, 500, 2000, None, RULE) is None, "nothing left to hold"
    assert mass_hold(0.0, 500, 0, 2000, None, MassSilence(hold_s=0.0)) is None, "hold_s 0: off"


def test_a_hold_lasts_hold_s_then_none_may_start_for_as_long() -> None:
    held = mass_hold(0.0, 20, 0, 20, None, RULE)
    assert held is not None
    assert mass_hold(9.9, 20, 0, 20, held, RULE) is held
    assert mass_hold(10.0, 20, 0, 20, held, RULE) is None, "over: the still silent are declared"
    assert mass_hold(19.9, 20, 0, 20, held, RULE) is None, "no second hold right after"
    again = mass_hold(20.0, 20, 0, 20, held, RULE)
    assert isinstance(again, Hold) and again.since == 20.0


@pytest.mark.parametrize(("field", "value"), [("mass_silence_fraction", 0.0), ("mass_silence_fraction", 1.5),
                                              ("mass_silence_min_nodes", 0), ("mass_silence_hold_s", -1.0)])
def test_bad_mass_silence_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(SettingsError, match="mass_silence"):
        CoordinatorSettings(**{field: value})  # type: ignore[arg-type]


NODES = tuple(f"n{i:02d}" for i in range(20))


async def _twenty() -> tuple[Clock, Controller]:
    clock = Clock()
    ctl = make(MemoryStore(), clock)
    await ctl.leadership_step()
    await step(ctl, clock, n=60)  # past the new leader's grace
    for node_id in NODES:
        await ctl.membership.register(reg(node_id))
        hb(ctl, node_id)
    await step(ctl, clock, NODES, n=10)
    return clock, ctl


def _fenced(ctl: Controller) -> set[str]:
    view = ctl.committer.view
    assert view is not None
    return {n for n, node in view.nodes.items() if node.fenced}


def test_a_few_silent_nodes_die_as_always() -> None:
    async def scenario() -> None:
        clock, ctl = await _twenty()
        await step(ctl, clock, NODES[3:], n=30)  # 3 s: three nodes silent past dead_after_s (2.5 s)
        assert _fenced(ctl) == set(NODES[:3])
        assert ctl.metrics.mass_silence_holds._value.get() == 0

    run(scenario)


def test_a_mass_silence_is_held_and_those_back_in_time_live() -> None:
    async def scenario() -> None:
        clock, ctl = await _twenty()
        await step(ctl, clock, NODES[10:], n=30)  # ten of twenty silent for 3 s: a mass
        view = ctl.committer.view
        assert view is not None
        assert _fenced(ctl) == set()
        assert view.verdicts["n00"].state is State.SUSPECT and "mass silence" in view.verdicts["n00"].reason
        assert ctl.metrics.mass_silence_holds._value.get() == 1
        await step(ctl, clock, NODES, n=20)  # the leader catches up: every node heard again
        assert _fenced(ctl) == set() and view.verdicts["n00"].state is State.ALIVE

    run(scenario)


def test_a_real_mass_failure_is_declared_once_the_hold_ends() -> None:
    async def scenario() -> None:
        clock, ctl = await _twenty()
        await step(ctl, clock, NODES[10:], n=30)
        assert _fenced(ctl) == set()
        await step(ctl, clock, NODES[10:], n=90)  # 12 s of silence: the 10 s hold began at 2.5 s
        assert _fenced(ctl) == set()
        await step(ctl, clock, NODES[10:], n=10)
        assert _fenced(ctl) == set(NODES[:10])
        assert ctl.metrics.mass_silence_holds._value.get() == 1

    run(scenario)


def test_those_heard_during_a_hold_and_silent_again_are_held_again_those_silent_throughout_are_declared() -> None:
    held = mass_hold(0.0, 20, 0, 20, None, RULE)
    assert held is not None and held.declare_over == float("inf")
    assert mass_hold(10.0, 20, 0, 20, held, RULE, returned=2) is None, "2 back: not a mass, the hold is over"
    again = mass_hold(10.0, 20, 0, 20, held, RULE, returned=15)
    assert again is not None and (again.since, again.until, again.declare_over) == (10.0, 20.0, 10.0)
    assert "15 node(s) heard during the last mass silence's hold are silent again" in again.reason
    assert mass_hold(15.0, 20, 0, 20, again, RULE, returned=15) is again
    assert mass_hold(29.9, 20, 0, 20, held, RULE, returned=15) is not None, "within the cooldown after the hold"


def test_a_leader_still_overloaded_after_a_hold_declares_only_the_nodes_silent_through_it() -> None:
    """Fifteen of twenty nodes silent together (a mass, held); ten of them come back during the hold and
    fall silent again as it ends (the leader still overloaded): they are held again; the five silent
    throughout are declared dead as the hold ends, the ten only if silent through the next hold too."""
    async def scenario() -> None:
        clock, ctl = await _twenty()
        await step(ctl, clock, NODES[15:], n=30)  # n00..n14 silent for 3 s: held for 10 s from 2.5 s
        assert _fenced(ctl) == set() and ctl.metrics.mass_silence_holds._value.get() == 1
        await step(ctl, clock, NODES[5:], n=40)  # n05..n14 heard again during the hold
        await step(ctl, clock, NODES[15:], n=60)  # then silent again, past the hold's end (12.5 s)
        assert _fenced(ctl) == set(NODES[:5]), "silent through the hold: declared"
        assert ctl.metrics.mass_silence_holds._value.get() == 2, "the others are held again"
        view = ctl.committer.view
        assert view is not None and view.verdicts["n05"].state is State.SUSPECT
        assert "mass silence" in view.verdicts["n05"].reason
        await step(ctl, clock, NODES[15:], n=100)  # silent through the second hold too
        assert _fenced(ctl) == set(NODES[:15])

    run(scenario)
