"""Following the event log from a sequence number (``ListEvents`` with ``after_seq``, what ``ftctl drill``
watches instead of polling the node list): the event log pages a watcher and is answered without etcd when
nothing is newer; the client's ``events_after`` over gRPC. The stores' ``list_events(after_seq=...)`` is
part of the store contract (test_store_contract.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ftd.client import CoordinatorClient
from ftd.coordinator import errors
from ftd.coordinator.event_log import EventLog
from ftd.coordinator.metrics import CoordinatorMetrics
from ftd.coordinator.model import Event
from ftd.coordinator.store import Guard, MemoryStore, StateStore
from ftd.coordinator.store_calls import StoreCalls
from ftd.ftctl.localcluster import stop, up
from ftd.v1 import coordinator_pb2

NOW = 1_800_000_000.0


def fill(store: StateStore, n: int) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    store.commit(Guard(lease.leader), events=[Event(seq=i, at_unix_s=float(i), kind="k", message=f"m{i}")
                                              for i in range(1, n + 1)])


class Unreadable(MemoryStore):
    def list_events(self, limit: int, before_seq: int = 0, after_seq: int | None = None) -> list[Event]:
        raise AssertionError("read etcd although nothing is newer")


def page(log: EventLog, last_seq: int | None, **fields: object) -> coordinator_pb2.ListEventsResponse:
    return asyncio.run(log.page(coordinator_pb2.ListEventsRequest(**fields), last_seq))  # type: ignore[arg-type]


def test_the_event_log_pages_a_watcher_and_spares_etcd_when_nothing_is_newer() -> None:
    store = MemoryStore()
    fill(store, 7)
    log = EventLog(store, StoreCalls(CoordinatorMetrics()))
    first = page(log, 7, after_seq=2, limit=2)
    assert [e.seq for e in first.events] == [3, 4] and first.next_page_token == "4"
    rest = page(log, 7, after_seq=4, limit=10)
    assert [e.seq for e in rest.events] == [5, 6, 7] and rest.next_page_token == ""
    idle = EventLog(Unreadable(), StoreCalls(CoordinatorMetrics()))
    assert list(page(idle, 7, after_seq=7).events) == []
    with pytest.raises(errors.InvalidArgument) as err:
        page(log, 7, after_seq=2, page_token="5")
    assert err.value.field == "page_token"


@pytest.mark.etcd
@pytest.mark.slow
def test_a_client_follows_the_log_over_grpc(tmp_path: Path) -> None:
    cluster = up(tmp_path / "cluster", nodes=1, spares=0)
    client = CoordinatorClient(cluster.coordinator_endpoints)
    try:
        seen = client.events_after(0)
        assert seen and [e.seq for e in seen] == sorted(e.seq for e in seen)
        assert {"leader_elected", "node_registered"} <= {e.kind for e in seen}
        assert client.events_after(seen[-1].seq) == [], "nothing newer: an empty answer"
        newest = client.events(1).events[0]
        assert seen[-1].seq == newest.seq
        assert [e.seq for e in client.events_after(0, limit=1)] == [e.seq for e in seen], "followed page by page"
    finally:
        client.close()
        stop(cluster)
