"""agent/rtt.py: whom a node probes, the TCP-handshake probe against real sockets, the metrics' label sets
following the targets, and a prober thread that stops within a bound. No sleeps: conditions with deadlines."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from ftd.agent.peers import Peer
from ftd.agent.rtt import (
    COORDINATOR,
    MAX_TARGETS,
    RTT_BUCKETS,
    RttMetrics,
    RttProber,
    Target,
    connect_rtt,
    handshake_rtt,
    plan,
    split_address,
    targets,
)
from ftd.v1 import cluster_pb2
from ftd.waiting import wait_for

COORD = "10.0.0.1:9400"


def peer(node_id: str, alive: bool = True, address: str | None = None) -> Peer:
    return Peer(node_id, f"{node_id}.cluster:9500" if address is None else address, alive)


def world(*ids: str) -> list[Peer]:
    return [peer(i) for i in ids]


def names(chosen: list[Target]) -> list[str]:
    return [t.name for t in chosen]


# ---- targets() ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("me", "ids", "buddy", "coordinator", "expected"), [
    # the middle of the world: rank-1, rank+1, the buddy
    ("b", "abcde", "d", COORD, [COORDINATOR, "a", "c", "d"]),
    # rank 0 wraps to the last rank; the last rank wraps to rank 0
    ("a", "abcde", "c", COORD, [COORDINATOR, "e", "b", "c"]),
    ("e", "abcde", "b", COORD, [COORDINATOR, "d", "a", "b"]),
    # the buddy is a rank neighbour: probed once
    ("b", "abcde", "c", COORD, [COORDINATOR, "a", "c"]),
    # a world of two: rank-1 and rank+1 are the same node
    ("a", "ab", "b", COORD, [COORDINATOR, "b"]),
    # alone in the world: no neighbour, the buddy is a spare
    ("a", "a", "s", COORD, [COORDINATOR, "s"]),
    # a spare (not in the world): the coordinator and its buddy only
    ("s", "abcde", "a", COORD, [COORDINATOR, "a"]),
    # no leader known yet: no coordinator target, the peers still
    ("c", "abcde", "e", "", ["b", "d", "e"]),
    # no buddy (no other alive node)
    ("a", "a", None, COORD, [COORDINATOR]),
])
def test_targets_table(me: str, ids: str, buddy: str | None, coordinator: str, expected: list[str]) -> None:
    chosen = targets(me, world(*ids), peer(buddy) if buddy else None, coordinator)
    assert names(chosen) == expected
    assert len(chosen) <= MAX_TARGETS
    if coordinator:
        assert chosen[0] == Target(COORDINATOR, "10.0.0.1", 9400)


def test_targets_skip_dead_peers_and_peers_without_an_address() -> None:
    ranked = [peer("a", alive=False), peer("b"), peer("c", address=""), peer("d")]
    assert names(targets("b", ranked, peer("d"), COORD)) == [COORDINATOR, "d"]  # a dead, c has no address
    assert names(targets("b", ranked, peer("x", address="not-an-address"), COORD)) == [COORDINATOR]


def test_targets_addresses_and_ipv6() -> None:
    chosen = targets("a", [peer("a"), peer("b", address="[fd00::2]:9500")], None, "[fd00::1]:9400")
    assert chosen == [Target(COORDINATOR, "fd00::1", 9400), Target("b", "fd00::2", 9500)]
    assert chosen[1].address == "[fd00::2]:9500"
    assert split_address("node-3:9500") == ("node-3", 9500)
    for bad in ("node-3", "node-3:", ":9500", "node-3:http", "node-3:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)


@given(size=st.integers(1, 12), me=st.integers(0, 14), buddy=st.integers(0, 14), coordinator=st.booleans())
def test_targets_are_few_unique_and_coordinator_first(size: int, me: int, buddy: int, coordinator: bool) -> None:
    ranked = world(*(f"n{i}" for i in range(size)))
    chosen = targets(f"n{me}", ranked, peer(f"n{buddy}"), COORD if coordinator else "")
    assert len(chosen) <= MAX_TARGETS
    assert len(set(names(chosen))) == len(chosen)
    assert f"n{me}" not in names(chosen)
    assert (names(chosen)[:1] == [COORDINATOR]) is coordinator
    assert COORDINATOR not in names(chosen)[1:]


def assignment(rank: int, world: str, listed: dict[str, int], buddy: str = "") -> cluster_pb2.Assignment:
    """What the coordinator sends: the world (up to 256 ranks), the buddy and the addresses it named
    (node id -> rank; a dead or fenced node is not named)."""
    return cluster_pb2.Assignment(
        rank=rank, world_size=len(world), world=list(world),
        peers=cluster_pb2.Peers(buddy=buddy, buddy_reason="why", addresses=[
            cluster_pb2.PeerAddress(node_id=n, agent_address=f"{n}.cluster:9500", rank=r)
            for n, r in sorted(listed.items())]))


def test_plan_takes_the_buddy_and_the_addresses_from_the_assignment() -> None:
    told = assignment(0, "abc", {"a": 0, "b": 1, "c": 2, "d": -1}, buddy="d")
    assert names(plan("a", told, COORD)) == [COORDINATOR, "c", "b", "d"]
    # x (rank 1) has no address in the assignment (dead, or just fenced): not probed; the buddy is a spare
    told = assignment(2, "axe", {"a": 0, "e": 2, "s": -1}, buddy="s")
    assert names(plan("e", told, COORD)) == [COORDINATOR, "a", "s"]
    # no buddy chosen (or no answer from the coordinator yet)
    assert names(plan("a", cluster_pb2.Assignment(rank=0, world_size=1, world=["a"]), COORD)) == [COORDINATOR]


def test_plan_above_the_inline_world_uses_the_ranks_of_the_addresses() -> None:
    """Above 256 ranks the assignment carries no world: the neighbours come from the addresses' ranks."""
    world = [f"n{i}" for i in range(300)]
    told = cluster_pb2.Assignment(rank=0, world_size=300, peers=cluster_pb2.Peers(buddy="n150", addresses=[
        cluster_pb2.PeerAddress(node_id=n, agent_address=f"{n}.cluster:9500", rank=r)
        for n, r in (("n1", 1), ("n150", 150), ("n299", 299))]))
    chosen = plan(world[0], told, "coord-1:9400")
    assert names(chosen) == [COORDINATOR, "n299", "n1", "n150"]
    assert chosen[1] == Target("n299", "n299.cluster", 9500)


# ---- the probe against real sockets ----------------------------------------------------------------------


class Listener:
    """A TCP server on 127.0.0.1 that accepts and drops connections, like the far gRPC server does."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.close()
            self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound on 127.0.0.1 where nothing listens (bound, so no other test takes it meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


def test_a_real_probe_measures_the_handshake(listener: Listener) -> None:
    rtts = [handshake_rtt("127.0.0.1", listener.port, timeout_s=1.0) for _ in range(20)]
    assert all(0 < r < 1.0 for r in rtts), rtts  # each within its timeout
    assert sorted(rtts)[10] < 0.01, rtts  # loopback: tens of us; the median, so one scheduling hiccup is no failure
    wait_for(lambda: listener.accepted == 20, 5, "the server to accept (and find reset) every probe")


def test_a_closed_port_is_a_failure_quickly_not_an_rtt(closed_port: int) -> None:
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        handshake_rtt("127.0.0.1", closed_port, timeout_s=2.0)
    assert time.monotonic() - started < 1.0  # refused at once, not after the timeout
    metrics = RttMetrics(CollectorRegistry())
    prober = RttProber(metrics, interval_s=0.01, probes=3, timeout_s=2.0)
    prober.set_targets([Target("n1", "127.0.0.1", closed_port)])
    stats = prober.probe_round()
    assert stats["n1"].failures == 3 and stats["n1"].rtts == [] and stats["n1"].last_error == "refused"
    assert sample(metrics, "ftd_agent_peer_probe_failures_total", "n1") == 3
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", "n1") == 0


def test_a_timeout_is_a_lost_probe() -> None:
    def blackhole(family: socket.AddressFamily, sockaddr: tuple[object, ...], timeout_s: float) -> float:
        raise TimeoutError("timed out")

    metrics = RttMetrics(CollectorRegistry())
    prober = RttProber(metrics, interval_s=0.01, probes=2, timeout_s=0.1, probe=blackhole)
    prober.set_targets([Target(COORDINATOR, "127.0.0.1", 9)])
    assert prober.probe_round()[COORDINATOR].last_error == "timeout"
    assert sample(metrics, "ftd_agent_peer_probe_failures_total", COORDINATOR) == 2
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", COORDINATOR) == 0


def test_connect_rtt_leaves_no_time_wait(listener: Listener) -> None:
    """SO_LINGER 0: the probe's close() resets the connection, so neither side keeps a TIME_WAIT (the
    prober opens several connections a second for the node's lifetime)."""
    for _ in range(3):
        connect_rtt(socket.AF_INET, ("127.0.0.1", listener.port), 1.0)
    wait_for(lambda: listener.accepted == 3, 5, "the server to accept the probes")
    port = f":{listener.port:04X}"
    with open("/proc/net/tcp") as table:  # sl local rem st ...: state 06 is TIME_WAIT
        rows = [line.split() for line in table.readlines()[1:]]
    time_wait = [r for r in rows if r[3] == "06" and (r[1].endswith(port) or r[2].endswith(port))]
    assert not time_wait, time_wait


# ---- metrics and the prober -----------------------------------------------------------------------------


def sample(metrics: RttMetrics, name: str, peer_label: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"peer": peer_label})


def test_metrics_names_and_buckets() -> None:
    metrics = RttMetrics(CollectorRegistry())
    metrics.observe("n1", 30e-6)
    metrics.observe("n1", 60e-6)
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", "n1") == 2
    assert metrics.registry.get_sample_value("ftd_agent_peer_rtt_seconds_bucket", {"peer": "n1", "le": "5e-05"}) == 1
    assert RTT_BUCKETS[0] == 1e-5 and RTT_BUCKETS[-1] == 1.0 and 50e-6 in RTT_BUCKETS
    assert sample(metrics, "ftd_agent_peer_probe_failures_total", "n1") == 0  # created at zero


def test_label_sets_follow_the_targets(listener: Listener) -> None:
    metrics = RttMetrics(CollectorRegistry())
    prober = RttProber(metrics, interval_s=0.01, probes=2, timeout_s=1.0)
    prober.set_targets([Target(COORDINATOR, "127.0.0.1", listener.port), Target("n2", "127.0.0.1", listener.port)])
    prober.probe_round()
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", "n2") == 2
    assert metrics.peers == {COORDINATOR, "n2"}
    prober.set_targets([Target(COORDINATOR, "127.0.0.1", listener.port)])  # n2 left the world
    prober.probe_round()
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", "n2") is None
    assert sample(metrics, "ftd_agent_peer_probe_failures_total", "n2") is None
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_count", COORDINATOR) == 4
    assert metrics.peers == {COORDINATOR}


def test_set_targets_keeps_at_most_four_unique() -> None:
    prober = RttProber(RttMetrics(CollectorRegistry()))
    prober.set_targets([Target(n, "127.0.0.1", 9) for n in ("a", "b", "a", "c", "d", "e")])
    assert names(prober.targets) == ["a", "b", "c", "d"]
    assert (prober.interval_s, prober.probes) == (5.0, 5)  # the defaults


def test_the_thread_probes_and_stops_within_a_bound(listener: Listener, closed_port: int) -> None:
    metrics = RttMetrics(CollectorRegistry())
    prober = RttProber(metrics, interval_s=0.05, probes=5, timeout_s=0.5)
    prober.set_targets([Target(COORDINATOR, "127.0.0.1", listener.port), Target("n9", "127.0.0.1", closed_port)])
    prober.start()
    try:
        wait_for(lambda: prober.rounds >= 2, 10, "two probe rounds")
        assert len(prober.last_round[COORDINATOR].rtts) == 5
        assert prober.last_round["n9"].failures == 5
        assert (sample(metrics, "ftd_agent_peer_rtt_seconds_count", COORDINATOR) or 0) >= 10
    finally:
        started = time.monotonic()
        assert prober.stop(timeout_s=5)
    assert time.monotonic() - started < 1.0
    assert not prober.running
    assert metrics.peers == set()  # a stopped prober probes nobody: its label sets are gone


def test_stop_does_not_wait_for_the_interval(listener: Listener) -> None:
    """With the default 5 s interval (1 s between sweeps) stop() still returns at once."""
    prober = RttProber(RttMetrics(CollectorRegistry()), interval_s=60.0, probes=5)
    prober.set_targets([Target(COORDINATOR, "127.0.0.1", listener.port)])
    prober.start()
    wait_for(lambda: listener.accepted >= 1, 10, "the first probe")
    started = time.monotonic()
    assert prober.stop(timeout_s=5)
    assert time.monotonic() - started < 1.0
    with pytest.raises(RuntimeError):
        prober.start()


def test_invalid_settings_are_refused() -> None:
    metrics = RttMetrics(CollectorRegistry())
    with pytest.raises(ValueError):
        RttProber(metrics, interval_s=0)
    with pytest.raises(ValueError):
        RttProber(metrics, probes=0)
    with pytest.raises(ValueError):
        RttProber(metrics, timeout_s=0)
    with pytest.raises(ValueError):
        RttProber(metrics, warmup=-1)


def test_warm_up_handshakes_are_not_measured() -> None:
    """Each measured probe follows a discarded one to the same target (a cold CPU path is not the network)."""
    calls: list[tuple[object, ...]] = []

    def fake(family: socket.AddressFamily, sockaddr: tuple[object, ...], timeout_s: float) -> float:
        calls.append(sockaddr)
        return 1.0 if len(calls) % 2 else 20e-6  # odd calls are the warm-ups: slow

    metrics = RttMetrics(CollectorRegistry())
    prober = RttProber(metrics, interval_s=0.01, probes=3, probe=fake)
    prober.set_targets([Target("n1", "127.0.0.1", 9)])
    assert prober.probe_round()["n1"].rtts == [20e-6] * 3
    assert len(calls) == 6 and set(calls) == {("127.0.0.1", 9)}
    assert sample(metrics, "ftd_agent_peer_rtt_seconds_sum", "n1") == pytest.approx(60e-6)
    without = RttProber(RttMetrics(CollectorRegistry()), interval_s=0.01, probes=2, warmup=0, probe=fake)
    without.set_targets([Target("n1", "127.0.0.1", 9)])
    calls.clear()
    assert len(without.probe_round()["n1"].rtts) == 2 and len(calls) == 2
