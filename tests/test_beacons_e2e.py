"""Liveness beacons on real processes (``ftctl up``: etcd, a coordinator, agents, mutual TLS), one
cluster for the module: nodes beacon and their streams go quiet; a node whose UDP path to the leader
breaks is probed, answers on its stream and is not declared dead; a SIGKILLed agent and a SIGSTOPped
(hung) one are still declared dead within today's bounds (docs/architecture.md, "Failure detection")."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from ftd.ftctl.localcluster import ClusterFile, spawn_agent, stop, up, wait_agent
from ftd.v1 import cluster_pb2
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("beacons") / "cluster", nodes=3, spares=0)
    try:
        yield started
    finally:
        stop(started)


def metric(cluster: ClusterFile, name: str, address: str = "") -> float:
    """The sum of a counter's samples (every label) on the coordinator, or on the process at ``address``."""
    address = address or cluster.coordinators[0].info["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def reconnects(cluster: ClusterFile) -> float:
    return sum(metric(cluster, "ftd_agent_reconnects_total", a.info["metrics"]) for a in cluster.agents)


def states(cluster: ClusterFile) -> dict[str, int]:
    client = cluster.client()
    try:
        return {n.node_id: n.state for n in client.nodes().nodes}
    finally:
        client.close()


def agent_pid(cluster: ClusterFile, node_id: str) -> int:
    return next(a.pid for a in cluster.agents if a.name == node_id)


def declared_dead(cluster: ClusterFile, node_id: str) -> bool:
    return states(cluster).get(node_id) in (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)


class UdpRelay:
    """A UDP path from one agent to the leader's beacon port that the test can cut: forwards every
    datagram until :meth:`cut`, then swallows them (counting both)."""

    def __init__(self, target_port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.target = ("127.0.0.1", target_port)
        self.forwarded = self.swallowed = 0
        self.open = True
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120  # bounded whatever happens to the test
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                data, _ = self.sock.recvfrom(2048)
            except TimeoutError:
                continue
            if self.open:
                self.sock.sendto(data, self.target)
                self.forwarded += 1
            else:
                self.swallowed += 1

    def cut(self) -> None:
        self.open = False

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self.sock.close()


def test_nodes_beacon_and_their_streams_go_quiet(cluster: ClusterFile) -> None:
    # 3 nodes x 2 beacons a second: ~3 s of them, past every stream's confirmation (its second answer);
    # from then on only keepalives (every 4 s) and changes go on the streams
    wait_for(lambda: metric(cluster, "ftd_coordinator_beacons_accepted_total") > 18, 10, "beacons accepted")
    beacons0 = metric(cluster, "ftd_coordinator_beacons_accepted_total")
    stream0 = metric(cluster, "ftd_coordinator_heartbeats_received_total")
    reconnects0 = reconnects(cluster)
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started >= 3.0, 5, "a 3 s window", interval_s=0.2)  # a keepalive at most
    window = time.monotonic() - started
    beacons = (metric(cluster, "ftd_coordinator_beacons_accepted_total") - beacons0) / window / 3
    stream = (metric(cluster, "ftd_coordinator_heartbeats_received_total") - stream0) / window / 3
    assert beacons >= 1.5, f"{beacons:.2f} beacons per node per second (one every 0.5 s expected)"
    assert stream <= 0.6, f"{stream:.2f} stream messages per node per second (2 without beacons)"
    assert metric(cluster, "ftd_coordinator_beacons_dropped_total") == 0
    # quiet streams with answers every keepalive: no agent took the quiet for a gone leader (3 s timeout)
    wait_for(lambda: time.monotonic() - started >= 7.5, 6, "past two keepalives", interval_s=0.2)
    assert reconnects(cluster) == reconnects0
    assert all(s == cluster_pb2.NODE_STATE_ALIVE for s in states(cluster).values())


def test_a_node_whose_beacons_stop_arriving_is_probed_and_stays_alive(cluster: ClusterFile) -> None:
    relay = UdpRelay(int(cluster.coordinators[0].info["beacon_port"]))
    try:
        proc, _, _ = spawn_agent(cluster, "node-3", "spare", extra_args=["--beacon-port", str(relay.port)])
        wait_agent(cluster, "node-3", proc)
        wait_for(lambda: relay.forwarded >= 8, 10, "node-3's beacons relayed to the leader")
        probes0 = metric(cluster, "ftd_coordinator_probes_total")
        relay.cut()  # the UDP path breaks; the stream (TCP) still works
        cut = time.monotonic()
        seen: set[int] = set()

        def watched() -> bool:
            seen.add(states(cluster)["node-3"])
            return time.monotonic() - cut >= 4.0  # dead_after_s and more: it would be dead by now

        wait_for(watched, 6, "4 s without node-3's beacons", interval_s=0.1)
        assert relay.swallowed >= 5, "node-3 kept beaconing into the cut path"
        assert metric(cluster, "ftd_coordinator_probes_total") >= probes0 + 1, "node-3 was probed"
        assert cluster_pb2.NODE_STATE_DEAD not in seen and cluster_pb2.NODE_STATE_FENCED not in seen
        assert states(cluster)["node-3"] == cluster_pb2.NODE_STATE_ALIVE
    finally:
        relay.close()


def test_a_sigkilled_agent_is_declared_dead_within_todays_bound(cluster: ClusterFile) -> None:
    os.kill(agent_pid(cluster, "node-0"), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: declared_dead(cluster, "node-0"), 10, "node-0 declared dead", interval_s=0.05)
    took = time.monotonic() - killed
    assert took < 2.5, f"SIGKILL detected after {took:.2f}s (the stream's close: ~1.6 s)"


def test_a_hung_agent_is_declared_dead_within_3s(cluster: ClusterFile) -> None:
    pid = agent_pid(cluster, "node-1")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(lambda: declared_dead(cluster, "node-1"), 10, "node-1 declared dead", interval_s=0.05)
        took = time.monotonic() - stopped
        assert took < 3.5, f"hung node detected after {took:.2f}s (no beacon, no answer to the probe: ~2.6 s)"
        assert "node-2" not in {n for n, s in states(cluster).items()
                                if s in (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)}
    finally:
        os.kill(pid, signal.SIGKILL)
