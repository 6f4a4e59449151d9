"""The leader's etcd space decisions (coordinator/etcd_space.py), as pure functions: which rendezvous runs
are cleaned, when etcd is compacted and defragmented, and when NOSPACE is disarmed. The real etcd side:
tests/test_etcd_privilege.py."""

from __future__ import annotations

import math

from ftd.coordinator.etcd_space import (
    NEWEST,
    TOTAL_BUDGETS,
    Reading,
    SpaceConfig,
    SpaceKeeper,
    SpacePlan,
    SpaceState,
    advance,
    may_disarm,
    plan,
    run_prefix,
    usage_by_run,
)

MIB = 1024**2
CONFIG = SpaceConfig(quota_bytes=100 * MIB, rendezvous_budget_bytes=1 * MIB, compact_every_s=30.0)


def reading(db: int = 1 * MIB, nospace: bool = False, revision: int = 50, **usage: int) -> Reading:
    return Reading(db, revision, nospace, {f"/torch/elastic/store/{run}/": size for run, size in usage.items()})


def test_keys_are_summed_per_run() -> None:
    assert run_prefix("/torch/elastic/store/job/a/b") == "/torch/elastic/store/job/"
    assert run_prefix("/torch/elastic/rendezvous/job") == "/torch/elastic/rendezvous/job"
    assert run_prefix("/ftd/local/world") is None
    assert usage_by_run([("/torch/elastic/store/j/a", 3), ("/torch/elastic/store/j/b", 4),
                         ("/torch/elastic/store/k/a", 1)]) == {"/torch/elastic/store/j/": 7,
                                                               "/torch/elastic/store/k/": 1}


def test_a_run_over_its_budget_is_cleaned_and_the_history_compacted_at_once() -> None:
    done = plan(0.0, reading(flood=2 * MIB, legit=10_000), SpaceState(), CONFIG)
    assert done.clean == ("/torch/elastic/store/flood/",) and done.compact_to == NEWEST
    assert "over its budget of 1048576" in done.reason and not done.defragment


def test_many_runs_under_budget_together_lose_the_largest_until_under_four_budgets() -> None:
    runs = {f"r{i}": MIB - i for i in range(6)}  # each just under the budget, six together
    done = plan(0.0, reading(**runs), SpaceState(), CONFIG)
    assert done.clean == ("/torch/elastic/store/r0/", "/torch/elastic/store/r1/")
    assert sum(runs.values()) - (2 * MIB - 1) <= TOTAL_BUDGETS * MIB
    assert "over 4 budgets" in done.reason


def test_nospace_cleans_compacts_and_defragments_even_with_nothing_over_budget() -> None:
    done = plan(0.0, reading(db=100 * MIB, nospace=True, legit=100), SpaceState(), CONFIG)
    assert done == SpacePlan((), NEWEST, True, done.reason) and "NOSPACE" in done.reason


def test_a_large_file_is_defragmented_once_not_every_pass() -> None:
    state = SpaceState()
    first = plan(0.0, reading(db=60 * MIB), state, CONFIG)
    assert first.defragment and "over 50% of the quota" in first.reason
    state.defragged_size = 55 * MIB  # live data is large: defragmenting again frees nothing
    assert not plan(5.0, reading(db=60 * MIB), state, CONFIG).defragment
    assert plan(5.0, reading(db=66 * MIB), state, CONFIG).defragment  # grew by a tenth of the quota


def test_periodic_compaction_keeps_one_period_of_history() -> None:
    state = SpaceState()
    first = plan(0.0, reading(revision=100), state, CONFIG)
    assert first.compact_to == 0 and not first.acts  # no mark yet: nothing is compacted
    advance(0.0, reading(revision=100), state, first, CONFIG)
    assert state.mark == 100
    assert plan(10.0, reading(revision=150), state, CONFIG).compact_to == 0  # within the period
    later = plan(30.0, reading(revision=200), state, CONFIG)
    assert later.compact_to == 100 and "periodic compaction to revision 100" in later.reason
    advance(30.0, reading(revision=200), state, later, CONFIG)
    assert state.mark == 200 and state.compacted_at == 30.0


def test_never_compacts_periodically_when_switched_off() -> None:
    config = SpaceConfig(100 * MIB, MIB, compact_every_s=math.inf)
    state = SpaceState(compacted_at=0.0, mark=10)
    assert plan(1e9, reading(), state, config).compact_to == 0


def test_nospace_is_disarmed_only_below_the_mark() -> None:
    ok, why = may_disarm(79 * MIB, CONFIG)
    assert ok and "below 80% of the quota" in why
    ok, why = may_disarm(80 * MIB, CONFIG)
    assert not ok and "NOSPACE stays" in why


class FakeSpace:
    """The etcd side of the keeper, recorded."""

    def __init__(self, first: Reading, after_defrag: int) -> None:
        self.reading, self.after_defrag = first, after_defrag
        self.calls: list[tuple[str, object]] = []

    def read(self) -> Reading:
        return self.reading

    def clean(self, prefixes: tuple[str, ...]) -> int:
        self.calls.append(("clean", prefixes))
        return 77

    def newest_revision(self) -> int:
        return 78

    def compact(self, revision: int) -> None:
        self.calls.append(("compact", revision))

    def defragment(self) -> int:
        self.calls.append(("defragment", None))
        return self.after_defrag

    def disarm(self) -> None:
        self.calls.append(("disarm", None))


def test_a_nospace_pass_cleans_then_compacts_to_the_newest_then_defragments_then_disarms() -> None:
    space = FakeSpace(reading(db=100 * MIB, nospace=True, flood=90 * MIB), after_defrag=2 * MIB)
    keeper = SpaceKeeper(space, CONFIG, lambda: True, clock=lambda: 0.0)  # type: ignore[arg-type]
    done = keeper.pass_once()
    assert space.calls == [("clean", ("/torch/elastic/store/flood/",)), ("compact", 78), ("defragment", None),
                           ("disarm", None)]
    assert "NOSPACE disarmed" in done.reason and keeper.state.defragged_size == 2 * MIB


def test_nospace_is_kept_while_the_file_stays_large() -> None:
    space = FakeSpace(reading(db=100 * MIB, nospace=True), after_defrag=95 * MIB)
    keeper = SpaceKeeper(space, CONFIG, lambda: True, clock=lambda: 0.0)  # type: ignore[arg-type]
    assert "NOSPACE kept" in keeper.pass_once().reason
    assert ("disarm", None) not in space.calls
