"""One contract suite for the coordinator's state store, run against the in-memory fake and against
a real etcd server process (torch elastic's RendezvousBackendTestMixin pattern)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from ftd.coordinator import errors
from ftd.coordinator.control import Controller
from ftd.coordinator.etcd_store import EtcdStore
from ftd.coordinator.model import Event, Fence, NodeRecord, Role, World, encode
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import Guard, MemoryStore, StaleStateError, StateStore
from ftd.etcd_client import make_client
from ftd.ftctl.etcd_server import EtcdCluster, etcd_binary, free_port
from ftd.v1 import cluster_pb2, coordinator_pb2

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


# ---- issue 11: node deletion, event pages, alarms, corrupt records, a full database ----------------


def test_node_records_are_deleted_and_events_are_read_a_page_at_a_time(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
    assert lease is not None
    store.commit(Guard(lease.leader), nodes=[node("n1"), node("n2")],
                 events=[Event(seq=i, at_unix_s=float(i), kind="k", message=f"m{i}") for i in range(1, 8)])
    store.commit(Guard(lease.leader), node_deletes=["n1"])
    assert set(store.load().nodes) == {"n2"}
    assert [e.seq for e in store.list_events(3)] == [7, 6, 5]
    assert [e.seq for e in store.list_events(3, before_seq=5)] == [4, 3, 2]
    assert [e.seq for e in store.list_events(3, before_seq=2)] == [1]
    assert store.alarms() == []
    store.commit(Guard(lease.leader), events=[Event(seq=8, at_unix_s=8.0, kind="k", message="x" * 100_000)])
    assert len(store.list_events(1)[0].message) == 2048, "an event's message is clipped"


def test_a_record_that_does_not_decode_is_skipped_and_named(tmp_path: Path) -> None:
    """One ``nodes/zzz = "not json"`` used to fail every load: the leader answered UNAVAILABLE while
    holding its lease. Now it is skipped and reported; so are records of the wrong shape."""
    cluster = EtcdCluster(tmp_path / "etcd", size=1, fast=True).start()
    store = EtcdStore(cluster.endpoints, cluster="corrupt")
    try:
        lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=NOW)
        assert lease is not None
        store.commit(Guard(lease.leader, 0), nodes=[node("n1")], world=World(epoch=4, ranks=("n1",), target_size=1),
                     events=[Event(seq=1, at_unix_s=1.0, kind="k", message="m", epoch=4)])
        raw = store._data
        raw.put(store.keys.node("zzz"), b"not json")
        raw.put(store.keys.node("yyy"), b'{"node_id": "yyy", "host": 5, "requested_role": "active"}')
        raw.put(store.keys.node("xxx"), encode(node("other")))  # a record under another node's key
        raw.put(store.keys.event(2), b"[1, 2]")
        snap = store.load()
        assert set(snap.nodes) == {"n1"} and snap.world.ranks == ("n1",)
        assert len(snap.problems) == 4 and all(
            any(f"nodes/{k}" in p for p in snap.problems) for k in ("zzz", "yyy", "xxx"))
        assert snap.last_event_seq == 2, "a corrupt last event still moves the sequence on"
        assert [e.seq for e in store.list_events(10)] == [1], "a corrupt event is left out"
        # A corrupt world: no ranks, at an epoch no lower than any recorded one, still replaceable.
        raw.put(store.keys.world, b"\xff\xfe")
        snap = store.load()
        assert snap.world.epoch == 4 and snap.world.ranks == () and any("world" in p for p in snap.problems)
        store.commit(Guard(lease.leader, snap.world_revision), world=World(epoch=5, ranks=("n1",), target_size=1))
        assert store.load().world.epoch == 5
    finally:
        store.close()
        cluster.stop()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "etcd exited"
        try:
            with urllib.request.urlopen(url + "/health", timeout=0.5) as resp:
                if json.loads(resp.read()).get("health") == "true":
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"etcd at {url} did not become healthy")


@contextlib.contextmanager
def small_etcd(workdir: Path, quota_bytes: int) -> Iterator[str]:
    """An etcd of its own with a tiny backend quota (``ftctl``'s EtcdCluster takes no extra flags)."""
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "etcd.log", "wb") as out:
        proc = subprocess.Popen(
            [etcd_binary(), "--name", "q", "--data-dir", str(workdir / "data"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"q={peer}", "--quota-backend-bytes", str(quota_bytes),
             "--heartbeat-interval", "50", "--election-timeout", "250"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_healthy(client, proc)
        yield client.removeprefix("http://")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_full_etcd_is_reported_and_fencing_resumes_once_space_is_freed(tmp_path: Path) -> None:
    """NOSPACE on a real etcd (1 MiB quota): commits fail with a message saying what to do, the alarm
    gauge and the status say so, the leader keeps its lease, and once an operator compacts,
    defragments and disarms, the pending fence and promotion are committed."""
    with small_etcd(tmp_path / "etcd", 1 << 20) as endpoint:
        asyncio.run(full_etcd_scenario(endpoint))


async def full_etcd_scenario(endpoint: str) -> None:
    store = EtcdStore(endpoint, cluster="nospace")
    ctl = Controller(store, CoordinatorSettings(replica_id="c0", failover_grace_s=0.5, etcd_endpoints=endpoint),
                     "127.0.0.1:1")
    live = {"a", "b", "s"}

    async def run_for(seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            for node_id in live:
                stream = ctl.membership.streams.get(node_id)
                req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation="i1", seq=1)
                with contextlib.suppress(errors.CoordinatorError):
                    ctl.membership.open_stream(req) if stream is None else ctl.membership.on_heartbeat(stream, req)
            await ctl.leadership_step()
            await ctl.tick()
            await asyncio.sleep(0.1)

    def gauge(alarm: str) -> float | None:
        return ctl.metrics.registry.get_sample_value("ftd_coordinator_etcd_alarm", {"alarm": alarm})

    try:
        await run_for(5.0, lambda: ctl.is_leader)
        assert ctl.is_leader
        for node_id, role in (("a", cluster_pb2.ROLE_ACTIVE), ("b", cluster_pb2.ROLE_ACTIVE),
                              ("s", cluster_pb2.ROLE_SPARE)):
            await ctl.membership.register(coordinator_pb2.RegisterRequest(
                node_id=node_id, host="127.0.0.1", role=role, incarnation="i1"))
        await run_for(5.0, lambda: store.load().world.ranks == ("a", "b"))
        assert store.load().world.ranks == ("a", "b")

        raw = make_client(endpoint)
        with pytest.raises(grpc.RpcError):  # someone else fills etcd up: NOSPACE
            for i in range(1000):
                raw.put(f"/junk/{i}", b"x" * 65536)
        await ctl.alarms.poll()
        assert gauge("nospace") == 1 and gauge("corrupt") == 0
        assert ctl.status().etcd_alarms[0].startswith("nospace: etcd's database is full")
        with pytest.raises(errors.StateRejected) as full:
            await ctl.membership.register(coordinator_pb2.RegisterRequest(
                node_id="late", host="127.0.0.1", role=cluster_pb2.ROLE_SPARE, incarnation="i1"))
        assert "NOSPACE" in str(full.value) and "alarm disarm" in str(full.value)
        assert errors.grpc_code(full.value) is grpc.StatusCode.RESOURCE_EXHAUSTED

        live.discard("a")  # a dies while etcd is full: nothing can be committed
        ctl.membership.close_stream(ctl.membership.streams["a"])
        await run_for(3.0)
        assert store.load().world.ranks == ("a", "b") and ctl.is_leader, "the lease holds, nothing is committed"

        raw.delete_prefix("/junk/")  # the operator frees space
        raw.compact(raw.get_response("/junk/").header.revision, physical=True)
        raw.defragment()
        for alarm in list(raw.list_alarms()):
            raw.disarm_alarm(alarm.member_id)
        await ctl.alarms.poll()
        assert gauge("nospace") == 0 and not ctl.status().etcd_alarms
        await run_for(10.0, lambda: store.load().world.ranks == ("s", "b"))
        snap = store.load()
        assert snap.world.ranks == ("s", "b") and snap.nodes["a"].fence is not None, "fencing resumed"
        raw.close()
    finally:
        await ctl.stop()
        store.close()


def test_events_after_a_sequence_number_come_oldest_first(store: StateStore) -> None:
    lease = store.campaign("a", "127.0.0.1:1", ttl_s=5, now_unix=1_800_000_000.0)
    assert lease is not None
    store.commit(Guard(lease.leader), events=[Event(seq=i, at_unix_s=float(i), kind="k", message=f"m{i}")
                                              for i in range(1, 8)])
    assert [e.seq for e in store.list_events(3, after_seq=0)] == [1, 2, 3]
    assert [e.seq for e in store.list_events(3, after_seq=5)] == [6, 7]
    assert store.list_events(3, after_seq=7) == []
    assert [e.seq for e in store.list_events(3)] == [7, 6, 5], "without after_seq: the newest, newest first"
