"""A new leader's reconnect storm (coordinator/detector.py ``reconnect_grace_until``): the nodes it has not
heard from yet keep their failover grace while others keep arriving, at most ``RECONNECT_MAX`` graces after
the election; a node that never comes back is still declared. The pure rule, then a takeover on the
in-memory store with a hand-moved clock."""

from __future__ import annotations

from types import SimpleNamespace

from controller_harness import WALL, Clock, hb, make, reg, run, step

from ftd.coordinator.control import Controller
from ftd.coordinator.detector import RECONNECT_MAX, Liveness, Reconnects, reconnect_grace_until
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore


def test_the_grace_follows_the_last_arrival_within_a_bound() -> None:
    assert reconnect_grace_until(100.0, None, 8.0, 2.5) == 108.0, "nobody back yet: the failover grace"
    assert reconnect_grace_until(100.0, 105.0, 8.0, 2.5) == 108.0, "an arrival inside it changes nothing"
    assert reconnect_grace_until(100.0, 107.0, 8.0, 2.5) == 109.5, "one near its end: 2.5 s after it"
    assert reconnect_grace_until(100.0, 130.0, 8.0, 2.5) == 100.0 + RECONNECT_MAX * 8.0, "bounded"


def test_only_the_nodes_still_in_grace_are_extended() -> None:
    storm = Reconnects(since=100.0, grace_s=8.0)
    table = {"heard": Liveness(last_seen=107.0), "unheard": Liveness(last_seen=100.0, grace_until=108.0),
             "ended": Liveness(last_seen=90.0, grace_until=99.0)}
    assert storm.extend(107.0, table, 2.5) == 0, "no arrival: the failover grace as it is"
    storm.last = 107.0
    assert storm.extend(107.0, table, 2.5) == 1
    assert [table[n].grace_until for n in ("heard", "unheard", "ended")] == [0.0, 109.5, 99.0]
    assert storm.extend(107.1, table, 2.5) == 0, "nothing new"


def _takeover_scenario(arrivals: dict[str, float], never: str, ticks: int,
                       gaps: dict[str, tuple[float, float]] | None = None) -> tuple[set[str], float | None, float]:
    """12 nodes on leader c0; c1 takes over (nobody heard yet); node ``n`` re-opens its stream
    ``arrivals[n]`` s after the election and heartbeats from then on, except in ``gaps[n]`` (s after
    the election); ``never`` does not come back. What c1 fenced, when it fenced ``never`` (s after the
    election) and the election's time."""
    gaps = gaps or {}
    async def scenario() -> tuple[set[str], float | None, float]:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        old = make(store, clock, "c0")
        await old.leadership_step()
        await step(old, clock, n=60)
        nodes = (*arrivals, never)
        for node_id in nodes:
            await old.membership.register(reg(node_id))
            hb(old, node_id)
        await step(old, clock, nodes, n=20)
        clock.advance(4.0)  # c0 stops refreshing its lease (ttl 3 s)
        settings = CoordinatorSettings(replica_id="c1", failover_grace_s=5.0, mass_silence_hold_s=0.0)
        new = Controller(store, settings, "127.0.0.1:7401", clock=clock, wall=lambda: WALL + clock.now)
        await new.leadership_step()
        assert new.is_leader
        elected, fenced_at = clock.now, None
        for _ in range(ticks):
            t = clock.now - elected
            silent = {n for n, (lo, hi) in gaps.items() if lo <= t < hi}
            back = tuple(n for n, at in arrivals.items() if t >= at and n not in silent)
            await step(new, clock, back)
            if fenced_at is None and store.nodes[never].fence is not None:
                fenced_at = clock.now - elected
        fenced = {n for n, node in store.nodes.items() if node.fence is not None}
        await new.stop()
        await old.stop()
        return fenced, fenced_at, elected

    return run(scenario)


def test_nodes_arriving_after_the_failover_grace_live_and_one_that_never_does_is_declared() -> None:
    # Six back at once, then one every 2 s until 12 s: past the 5 s grace, inside 2.5 s of the one before.
    arrivals = {f"n{i:02d}": 1.0 for i in range(6)} | {f"n{i:02d}": 4.0 + 2 * (i - 6) for i in range(6, 11)}
    fenced, fenced_at, _ = _takeover_scenario(arrivals, "n11", ticks=200)
    assert fenced == {"n11"}, "the late arrivals live; the node that never came back is declared"
    assert fenced_at is not None and 12.0 + 2.5 <= fenced_at <= 12.0 + 2.5 + 1.0, fenced_at


def test_a_storm_that_never_ends_holds_no_node_past_the_bound() -> None:
    arrivals = {f"n{i:02d}": 1.0 + 1.7 * i for i in range(11)}  # one every 1.7 s until 18 s
    fenced, fenced_at, _ = _takeover_scenario(arrivals, "n11", ticks=250)
    bound = RECONNECT_MAX * 5.0
    assert fenced == {"n09", "n10", "n11"}, "back by the bound (14.6 s): alive; not back by it: declared"
    assert fenced_at is not None and bound <= fenced_at <= bound + 1.0, fenced_at


def test_a_node_heard_in_the_storm_and_then_silent_keeps_its_grace() -> None:
    # n00 re-opens its stream 1 s after the election, then its heartbeats stop for 3 s (> dead_after_s
    # 2.5 s) while the 5 s grace runs: held, not fenced; n01 goes silent for good after its first ones and
    # is declared once the grace ends (5 s + dead_after_s after its last heartbeat at most).
    arrivals = {f"n{i:02d}": 1.0 for i in range(11)}
    fenced, fenced_at, _ = _takeover_scenario(arrivals, "n11", ticks=150,
                                              gaps={"n00": (1.5, 4.5), "n01": (1.5, 1e9)})
    assert fenced == {"n01", "n11"}, "the node silent in the storm and back lives; the silent for good do not"
    assert fenced_at is not None and 5.0 <= fenced_at <= 5.0 + 1.0, fenced_at


def test_while_a_mass_has_yet_to_come_back_a_gap_in_the_arrivals_does_not_end_the_storm() -> None:
    assert reconnect_grace_until(100.0, 101.0, 8.0, 2.5, now=111.0, many_missing=True) == 113.5
    assert reconnect_grace_until(100.0, 101.0, 8.0, 2.5, now=111.0) == 108.0, "without: the grace as it was"
    assert reconnect_grace_until(100.0, 101.0, 8.0, 2.5, now=130.0, many_missing=True) == 124.0, "bounded"
    # n00..n02 come back 1 s after the election, then their heartbeats stop while nobody else arrives for
    # 8 s (a stalled leader, a slow simulator); nine nodes are still to come: the storm is not over.
    arrivals = {f"n{i:02d}": 1.0 for i in range(3)} | {f"n{i:02d}": 9.0 for i in range(3, 11)}
    fenced, fenced_at, _ = _takeover_scenario(arrivals, "n11", ticks=200,
                                              gaps={f"n{i:02d}": (2.0, 9.0) for i in range(3)})
    assert fenced == {"n11"}, "those heard and silent while a mass was still to come live"
    assert fenced_at is not None and 9.0 + 2.5 <= fenced_at <= 9.0 + 2.5 + 1.0, fenced_at


def test_a_mass_is_missing_only_among_the_registered_unfenced_nodes_still_in_grace() -> None:
    from ftd.coordinator.detector import MassSilence
    rule = MassSilence(fraction=0.1, min_nodes=8, hold_s=10.0)
    storm = Reconnects(since=100.0, grace_s=8.0, last=101.0, heard={"a"})
    table = {n: Liveness(last_seen=100.0, grace_until=108.0) for n in "abcdefghijk"}  # 10 unheard
    nodes = {n: SimpleNamespace(fenced=None) for n in table}
    assert storm.missing(102.0, table, nodes, rule)
    fenced = nodes | {"b": SimpleNamespace(fenced="dead"), "c": SimpleNamespace(fenced="dead")}
    assert not storm.missing(102.0, table, fenced, rule), "8 registered and not fenced: not more than 8"
    assert not storm.missing(102.0, table, {n: v for n, v in nodes.items() if n not in "bc"}, rule), "unregistered"
    assert not storm.missing(125.0, table, nodes, rule), "past the bound"
    assert not Reconnects(since=100.0, grace_s=8.0).missing(102.0, table, nodes, rule), "nobody back yet"
