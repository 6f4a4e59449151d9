"""The leader's lease renewed from a thread while the event loop is busy (coordinator/lease_keeper.py):
renewals only while the loop ticks, a lost lease reported, and a real leader that keeps its lease while
its event loop is blocked for longer than the lease may go unconfirmed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

from ftd.coordinator.control import Controller
from ftd.coordinator.etcd_store import EtcdStore
from ftd.coordinator.lease_keeper import LeaseKeeper, renew_due
from ftd.coordinator.model import LeaderInfo
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import Lease
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.waiting import wait_for

LEASE = Lease(7, 3, LeaderInfo("c0", "127.0.0.1:1", 0.0, "t1"))


def test_renewals_only_while_the_loop_ticks() -> None:
    assert renew_due(10.0, 9.0, 6.0)
    assert not renew_due(10.0, 3.9, 6.0), "a loop silent for longer than max_lag_s: wedged, the lease lapses"
    assert renew_due(10.0, 10.001, 6.0), "a tick between the thread's clock reading and its check"


def test_the_thread_confirms_renewals_and_reports_a_lost_lease() -> None:
    answers = [True, True, False]
    calls: list[int] = []

    def keep_alive(lease: Lease) -> bool:
        calls.append(lease.id)
        return answers[min(len(calls), len(answers)) - 1]

    keeper = LeaseKeeper(keep_alive, 0.3, time.monotonic, time.monotonic, 1.0)
    keeper.start(LEASE)
    try:
        wait_for(lambda: keeper.confirmed > 0, 5, "a confirmed renewal")
        wait_for(lambda: keeper.lost, 5, "the lost lease seen")
        assert calls == [7, 7, 7], "no renewal after the lease is gone"
    finally:
        keeper.stop()


def test_a_keeper_stopped_renews_no_more() -> None:
    calls = threading.Event()
    keeper = LeaseKeeper(lambda lease: calls.set() or True, 0.3, time.monotonic, time.monotonic, 1.0)
    keeper.start(LEASE)
    wait_for(calls.is_set, 5, "a first renewal")
    thread = keeper._thread
    keeper.stop()
    assert thread is not None
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.etcd
def test_a_leader_whose_event_loop_is_blocked_past_the_unconfirmed_bound_keeps_its_lease(tmp_path: Path) -> None:
    """A real etcd and a real controller loop: a new leader's loop busy for 4 s (a reconnect storm's
    backlog; longer than the 2.5 s it may lead unconfirmed, longer than the 3 s TTL) used to suspend it
    and lose the lease; the keeper renews it meanwhile, and the leader goes on."""
    cluster = EtcdCluster(tmp_path / "etcd", size=1, fast=True).start()
    store = EtcdStore(cluster.endpoints, cluster="keeper")
    try:
        async def scenario() -> None:
            ctl = Controller(store, CoordinatorSettings(replica_id="c0", etcd_endpoints=cluster.endpoints),
                             "127.0.0.1:7400")
            runner = asyncio.create_task(ctl.run())
            try:
                deadline = time.monotonic() + 20
                while not ctl.is_leader and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert ctl.is_leader
                term = store.current_leader()
                time.sleep(4.0)  # the fault itself: the event loop blocked (no tick, no lease step) for 4 s
                unblocked = time.monotonic()
                deadline = unblocked + 10
                while ctl._last_confirmed < unblocked and time.monotonic() < deadline:  # the loop's own lease step
                    await asyncio.sleep(0.05)
                assert ctl._last_confirmed >= unblocked, "no lease step of the loop after it was free again"
                assert ctl.is_leader and not ctl.committer.suspended, "the leader suspended itself"
                assert store.current_leader() == term, "the lease lapsed and the term changed"
                assert ctl.keeper.confirmed > 0
            finally:
                await ctl.stop()
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
        asyncio.run(scenario())
    finally:
        store.close()
        cluster.stop()
