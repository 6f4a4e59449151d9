"""One contract suite for the coordinator's state store, run against the in-memory fake and against
a real etcd server process (torch elastic's RendezvousBackendTestMixin pattern)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ftd.coordinator.etcd_store import EtcdStore
from ftd.coordinator.model import Event, Fence, NodeRecord, Role, World
from ftd.coordinator.store import Guard, MemoryStore, StaleStateError, StateStore
from ftd.ftctl.etcd_server import EtcdCluster

NOW = 1_800_000_000.0


@pytest.fixture(params=["memory", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    cluster = EtcdCluster(tmp_path / "etcd", size=1, fast=True).start()
    s = EtcdStore(cluster.endpoints, cluster="contract")
    try:
        yield s
    finally:
        s.close()
        cluster.stop()


def node(node_id: str, role: Role = Role.ACTIVE, **kw: object) -> NodeRecord:
    return NodeRecord(node_id=node_id, host="127.0.0.1", requested_role=role, **kw)  # type: ignore[arg-type]


def test_empty_store_has_no_world_and_no_leader(store: StateStore) -> None:
    snap = store.load()
    assert snap.world == World()
    assert snap.world_revision == 0
    assert snap.nodes == {}
    assert snap.leader is None
    assert snap.last_event_seq == 0


def test_campaign_is_exclusive_until_resign(store: StateStore) -> None:
    a = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert a is not None
    assert store.campaign("b", "127.0.0.1:2", ttl_s=5, now_unix=NOW) is None
    assert store.current_leader() == a.leader
    assert store.keep_alive(a)
    store.resign(a)
    assert store.current_leader() is None
    assert not store.keep_alive(a)
    b = store.campaign("b", "127.0.0.1:2", ttl_s=5, now_unix=NOW)
    assert b is not None and b.leader.replica_id == "b"
    assert b.leader.token != a.leader.token


def test_commit_roundtrips_nodes_world_and_events(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    n1 = node("n1", labels={"rack": "r1"}, pid=42, incarnation="x")
    n2 = node("n2", Role.SPARE).with_fence(Fence(3, "no heartbeat for 2.6s", 1.5))
    world = World(epoch=1, ranks=("n1",), target_size=1, reason="n1 joined", changed_unix_s=10.0)
    ev = Event(seq=1, at_unix_s=10.0, kind="epoch_changed", message="epoch 1", epoch=1)
    res = store.commit(Guard(lease.leader, 0), nodes=[n1, n2], world=world, events=[ev])
    assert res.world_revision > 0
    snap = store.load()
    assert snap.nodes == {"n1": n1, "n2": n2}
    assert snap.world == world
    assert snap.world_revision == res.world_revision
    assert snap.last_event_seq == 1
    assert snap.leader == lease.leader
    assert store.list_events(10) == [ev]


def test_world_commit_is_guarded_by_the_previous_revision(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    first = store.commit(Guard(lease.leader, 0), world=World(epoch=1, ranks=("n1",), target_size=1))
    # A second writer that read revision 0 must lose, and write nothing.
    with pytest.raises(StaleStateError):
        store.commit(Guard(lease.leader, 0), nodes=[node("zz")], world=World(epoch=2, ranks=("x",)))
    snap = store.load()
    assert snap.world.epoch == 1 and "zz" not in snap.nodes
    second = store.commit(Guard(lease.leader, first.world_revision), world=World(epoch=2, ranks=("n2",)))
    assert second.world_revision > first.world_revision
    assert store.load().world.ranks == ("n2",)


def test_a_deposed_leader_cannot_commit(store: StateStore) -> None:
    a = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert a is not None
    store.resign(a)
    b = store.campaign("b", "127.0.0.1:2", ttl_s=5, now_unix=NOW)
    assert b is not None
    with pytest.raises(StaleStateError):
        store.commit(Guard(a.leader, 0), nodes=[node("n1")])
    with pytest.raises(StaleStateError):
        store.commit(Guard(a.leader, 0), world=World(epoch=1, ranks=("n1",)))
    assert store.load().nodes == {}
    store.commit(Guard(b.leader), nodes=[node("n1")])
    assert set(store.load().nodes) == {"n1"}


def test_node_only_commit_does_not_move_the_world_revision(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    rev = store.commit(Guard(lease.leader, 0), world=World(epoch=1, ranks=("n1",))).world_revision
    res = store.commit(Guard(lease.leader), nodes=[node("n9")])
    assert res.world_revision == rev
    assert store.load().world_revision == rev


def test_events_are_pruned_below_a_sequence(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    evs = [Event(seq=i, at_unix_s=float(i), kind="k", message=f"m{i}") for i in range(1, 8)]
    store.commit(Guard(lease.leader), events=evs)
    store.commit(Guard(lease.leader), events=[Event(seq=8, at_unix_s=8.0, kind="k", message="m8")],
                 prune_events_below=5)
    assert [e.seq for e in store.list_events(100)] == [8, 7, 6, 5]
    assert [e.seq for e in store.list_events(2)] == [8, 7]
    assert store.load().last_event_seq == 8


def test_rewriting_a_node_replaces_it(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    n = node("n1")
    store.commit(Guard(lease.leader), nodes=[n])
    back = replace(n, requested_role=Role.SPARE, incarnation="i2")
    store.commit(Guard(lease.leader), nodes=[back])
    assert store.load().nodes["n1"] == back


def test_a_commit_over_the_transaction_limit_is_rejected_and_writes_nothing(store: StateStore) -> None:
    from ftd.coordinator.store import MAX_TXN_OPS, StoreRejected, commit_ops

    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    too_many = [node(f"n{i}") for i in range(MAX_TXN_OPS)]
    assert commit_ops(len(too_many), 0, False) > MAX_TXN_OPS
    with pytest.raises(StoreRejected, match="too many operations"):
        store.commit(Guard(lease.leader), nodes=too_many)
    assert store.load().nodes == {}
    fits = too_many[: MAX_TXN_OPS - commit_ops(0, 1, True)]
    store.commit(Guard(lease.leader, 0), nodes=fits, world=World(epoch=1), events=[
        Event(seq=1, at_unix_s=1.0, kind="k", message="m")])
    assert len(store.load().nodes) == len(fits)


def test_kv_records_roundtrip_delete_and_refuse_escaping_keys(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    store.commit(Guard(lease.leader), kv_puts={"ckpt/j/1/meta": b"m1", "ckpt/j/1/rank-00000": b"r0"})
    assert store.load().kv == {"ckpt/j/1/meta": b"m1", "ckpt/j/1/rank-00000": b"r0"}
    store.commit(Guard(lease.leader), kv_puts={"ckpt/j/2/meta": b"m2"}, kv_deletes=["ckpt/j/1/rank-00000"])
    assert store.load().kv == {"ckpt/j/1/meta": b"m1", "ckpt/j/2/meta": b"m2"}
    for bad in ("../x", "/abs", ""):
        with pytest.raises(ValueError, match="bad kv key"):
            store.commit(Guard(lease.leader), kv_puts={bad: b"x"})
    assert set(store.load().kv) == {"ckpt/j/1/meta", "ckpt/j/2/meta"}
