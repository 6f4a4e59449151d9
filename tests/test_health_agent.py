"""Health sampling on real processes (etcd, a coordinator, agents whose NVML is ``tests/fake_nvml.py``): an
XID stays in the node's verdict, across heartbeats, ``CheckHealth`` calls and an agent restart, until an
operator clears it; a hung NVML call is reported in the verdict while the node's heartbeats go on, so the
coordinator never declares it dead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import fake_nvml
import pytest

from ftd.client import CoordinatorClient
from ftd.ftctl.cli import main
from ftd.ftctl.localcluster import ClusterFile, spawn_agent, stop, up, wait_agent
from ftd.v1 import cluster_pb2, coordinator_pb2
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
TESTS = Path(__file__).resolve().parent
INTERVAL_S, DEADLINE_S = 0.3, 1.0
DEAD_AFTER_S = 2.5  # the coordinator's default: this much heartbeat silence and a node is dead
XID_79 = "XID errors 79 (allowed: 13, 31, 43, 45)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    c = up(tmp_path_factory.mktemp("health") / "cluster", nodes=1, spares=0)
    try:
        yield c
    finally:
        stop(c)


def spawn_faked(cluster: ClusterFile, node_id: str, state: Path) -> subprocess.Popen[bytes]:
    """A spare agent whose NVML is the fake driven by ``state``."""
    env = {"FTD_NVML_MODULE": "fake_nvml", "FTD_FAKE_NVML": str(state),
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the agent inherits it (localcluster passes the environment on)
    try:
        proc, _, _ = spawn_agent(cluster, node_id, "spare", extra_args=[
            "--health-interval-s", str(INTERVAL_S), "--health-deadline-s", str(DEADLINE_S)])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wait_agent(cluster, node_id, proc)
    return proc


def node_of(client: CoordinatorClient, node_id: str) -> coordinator_pb2.NodeInfo | None:
    return next((n for n in client.nodes().nodes if n.node_id == node_id), None)


def verdict_of(client: CoordinatorClient, node_id: str) -> cluster_pb2.HealthVerdict | None:
    """The verdict the node's heartbeats last carried, as the coordinator holds it."""
    n = node_of(client, node_id)
    return n.health.verdict if n is not None and n.health.HasField("verdict") else None


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_an_xid_stays_in_the_verdict_until_cleared(cluster: ClusterFile, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "nvml.json"
    fake_nvml.write(state, gpus=2)
    proc = spawn_faked(cluster, "node-1", state)
    client = CoordinatorClient(cluster.coordinator_endpoints)
    work = ["--workdir", cluster.workdir]
    try:
        good = wait_for(lambda: (v := verdict_of(client, "node-1")) is not None and v.healthy and v, 20,
                        "node-1 healthy")
        assert "gpu_xid" in [c.name for c in good.checks], "the fake NVML is the one sampled"

        fake_nvml.write(state, gpus=2, xids=((1, 79),))  # one event, delivered once
        bad = wait_for(lambda: (v := verdict_of(client, "node-1")) is not None and not v.healthy and v, 20,
                       "node-1 unhealthy after XID 79")
        assert bad.reason == XID_79

        def still_faulty_later() -> bool:
            v = verdict_of(client, "node-1")
            assert v is not None and v.reason == XID_79, v
            return v.checked_unix_s > bad.checked_unix_s + 6 * INTERVAL_S

        wait_for(still_faulty_later, 20, "six more samples, every heartbeat carrying the XID")
        for _ in range(3):
            rc, out = run(capsys, "health", "node-1", "--json", *work)
            assert rc == 1 and json.loads(out)[0]["reason"] == XID_79

        # An agent restart keeps the fault (NVML would not report the XID again: the fake does not either).
        fake_nvml.write(state, gpus=2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        restarted = time.time()
        proc = spawn_faked(cluster, "node-1", state)
        after = wait_for(lambda: (v := verdict_of(client, "node-1")) is not None and v.checked_unix_s > restarted
                         and v, 30, "a verdict of the restarted agent")
        assert after.reason == XID_79

        rc, out = run(capsys, "health", "node-1", "--clear-gpu-faults", "--json", *work)
        row = json.loads(out)[0]
        assert rc == 0 and row["healthy"], row
        assert [c.split(" (")[0] for c in row["cleared"]] == ["gpu1 XID 79"]
        wait_for(lambda: (v := verdict_of(client, "node-1")) is not None and v.healthy, 20, "node-1 healthy again")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        client.close()


def test_a_hung_gpu_probe_does_not_delay_heartbeats(cluster: ClusterFile, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "nvml.json"
    fake_nvml.write(state, gpus=2)
    proc = spawn_faked(cluster, "node-2", state)
    client = CoordinatorClient(cluster.coordinator_endpoints)
    try:
        wait_for(lambda: (v := verdict_of(client, "node-2")) is not None and v.healthy, 20, "node-2 healthy")
        since = max((e.seq for e in client.events(1).events), default=0)

        fake_nvml.write(state, gpus=2, hang=True)  # every NVML device query blocks from now on

        def hung_longer_than_death() -> float | None:
            n = node_of(client, "node-2")
            assert n is not None and n.state == cluster_pb2.NODE_STATE_ALIVE, n
            assert 0 <= n.last_heartbeat_age_s < DEAD_AFTER_S, n.last_heartbeat_age_s
            v = n.health.verdict
            hung = next((c.value for c in v.checks if c.name == "sampling" and not c.ok), None)
            if hung is None:
                return None
            assert not v.healthy and v.reason.startswith("gpu probe hung "), v.reason
            return hung if hung > 2 * DEAD_AFTER_S else None

        wait_for(hung_longer_than_death, 30, "a hang twice as long as the silence that kills a node")
        assert not [e for e in client.events(100).events if e.seq > since and e.node_id == "node-2"], \
            "node-2 was never declared dead, suspected or fenced"

        started = time.monotonic()
        rc, out = run(capsys, "health", "node-2", "--json", "--workdir", cluster.workdir)
        assert time.monotonic() - started < DEADLINE_S + 5, "CheckHealth waits at most the deadline"
        assert rc == 1 and json.loads(out)[0]["reason"].startswith("gpu probe hung ")

        fake_nvml.write(state, gpus=2)
        wait_for(lambda: (v := verdict_of(client, "node-2")) is not None and v.healthy, 20, "healthy once NVML answers")
    finally:
        fake_nvml.write(state, gpus=2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        client.close()
