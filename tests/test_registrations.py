"""Registrations in groups (coordinator/registrations.py): one etcd transaction for every node that
registered while the last one was in flight, each caller answered alone, and a detection tick that waits
behind one group at most, not behind a whole cluster registering at once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from controller_harness import Clock, make, reg, run, step

from ftd.coordinator import errors
from ftd.coordinator.registrations import GroupCommit, group_size
from ftd.coordinator.store import MAX_TXN_OPS, MemoryStore


def test_group_size_fits_a_node_record_and_an_event_each_in_a_transaction() -> None:
    assert group_size(MAX_TXN_OPS) == 60 and 2 * group_size(MAX_TXN_OPS) + 8 <= MAX_TXN_OPS
    assert group_size(10) == 1


def test_requests_waiting_go_together_each_caller_gets_its_own_answer() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        groups: list[list[str]] = []

        async def commit(requests: list[str]) -> Sequence[str | BaseException]:
            groups.append(list(requests))
            if len(groups) == 1:
                await gate.wait()  # the first transaction in flight: the rest queue up
            return [ValueError(f"bad {r}") if r.startswith("bad") else f"ok {r}" for r in requests]

        batcher: GroupCommit[str, str] = GroupCommit(commit, max_group=3, key=lambda r: r.split("#")[0])
        first = asyncio.create_task(batcher.submit("a"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        names = ["b", "c", "b#again", "bad", "d", "e"]
        later = [asyncio.create_task(batcher.submit(n)) for n in names]
        gone = asyncio.create_task(batcher.submit("cancelled"))
        await asyncio.sleep(0)
        gone.cancel()
        gate.set()
        assert await first == "ok a"
        answers = await asyncio.gather(*later, return_exceptions=True)
        assert answers[:3] == ["ok b", "ok c", "ok b#again"]
        assert isinstance(answers[3], ValueError) and str(answers[3]) == "bad bad"  # its caller only
        assert answers[4:] == ["ok d", "ok e"]
        # Three at most a group, the same key never twice in one, a cancelled caller left out.
        assert groups == [["a"], ["b", "c", "bad"], ["b#again", "d", "e"]]
        assert batcher.groups == 3

    run(scenario)


def test_a_failed_transaction_fails_its_whole_group_and_nothing_else() -> None:
    async def scenario() -> None:
        calls = 0

        async def commit(requests: list[str]) -> Sequence[str | BaseException]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise errors.StateUnavailable("etcd unreachable")
            return [f"ok {r}" for r in requests]

        batcher: GroupCommit[str, str] = GroupCommit(commit, max_group=10, key=str)
        a, b = asyncio.create_task(batcher.submit("a")), asyncio.create_task(batcher.submit("b"))
        with pytest.raises(errors.StateUnavailable):
            await a
        with pytest.raises(errors.StateUnavailable):
            await b
        assert await batcher.submit("c") == "ok c"

    run(scenario)


def test_a_registration_storm_takes_few_transactions_and_the_tick_waits_for_one_group_at_most() -> None:
    """300 nodes register at once: 5 transactions (60 each), every node answered and stored; a tick
    asked in the middle runs after the group in flight, not after all 300 (one lock, FIFO: registered
    one at a time, the tick waited for every registration queued before it)."""
    async def scenario() -> None:
        clock, store = Clock(), MemoryStore()
        store.clock = clock
        ctl = make(store, clock)
        await ctl.leadership_step()
        await step(ctl, clock, n=60)
        ids = [f"n{i:03d}" for i in range(300)]
        def writes() -> float:
            return ctl.metrics.registry.get_sample_value("ftd_coordinator_etcd_writes_total", {"kind": "register"}) or 0

        before = writes()
        storm = [asyncio.create_task(ctl.membership.register(reg(n))) for n in ids]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first group is committing
        await ctl.tick()
        registered_at_tick = sum(n in ctl.committer.view.nodes for n in ids) if ctl.committer.view else -1
        answers = await asyncio.gather(*storm)
        assert all(a.message.startswith("registered as") for a in answers)
        assert set(ids) <= set(store.load().nodes)
        assert ctl.membership.registrations.groups == 5 and writes() - before == 5
        assert 0 < registered_at_tick <= 2 * group_size(MAX_TXN_OPS), registered_at_tick
        again = await ctl.membership.register(reg("n000"))  # an agent's retry: nothing written
        assert again.message == "already registered" and writes() - before == 5
        await ctl.stop()

    run(scenario)
