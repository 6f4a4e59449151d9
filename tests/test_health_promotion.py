"""Health checks before promotion, on real processes: a spare whose own checks fail is passed over
(the healthy one takes the rank), ``ftctl nodes`` says why, and ``ftctl health`` lists every check
with its value and threshold."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.client import CoordinatorClient
from ftd.ftctl.cli import main
from ftd.ftctl.localcluster import ClusterFile, spawn_agent, stop, up, wait_agent
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterFile]:
    c = up(tmp_path / "cluster", nodes=2, spares=0)
    try:
        # node-2 registers first (the preferred spare) but cannot meet its SSD free-space threshold.
        for node_id, extra in (("node-2", ["--health-min-free", "ssd=1000PiB"]), ("node-3", [])):
            proc, _, _ = spawn_agent(c, node_id, "spare", extra_args=extra)
            wait_agent(c, node_id, proc)
        yield c
    finally:
        stop(c)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_an_unhealthy_spare_is_passed_over(cluster: ClusterFile, capsys: pytest.CaptureFixture[str]) -> None:
    client = CoordinatorClient(cluster.coordinator_endpoints)
    work = ["--workdir", cluster.workdir]
    try:
        def verdicts() -> dict[str, bool] | None:
            seen = {n.node_id: n.health.verdict.healthy for n in client.nodes().nodes if n.health.HasField("verdict")}
            return seen if len(seen) == 4 else None

        assert wait_for(verdicts, 15, "every node's health verdict") == {
            "node-0": True, "node-1": True, "node-2": False, "node-3": True}
        rc, out = run(capsys, "nodes", *work)
        assert rc == 0 and "unhealthy: ssd free" in out and "< 1000 PiB" in out

        rc, out = run(capsys, "health", "--json", *work)
        rows = {r["node"]: r for r in json.loads(out)}
        assert rc == 1, "an unhealthy node makes ftctl health fail"
        bad = next(c for c in rows["node-2"]["checks"] if not c["ok"])
        assert bad["name"] == "disk:ssd" and bad["threshold"] == 1000 * (1 << 50)
        assert 0 < bad["value"] < bad["threshold"]
        assert rows["node-3"]["healthy"] and all(c["ok"] for c in rows["node-3"]["checks"])
        rc, out = run(capsys, "health", "node-3", *work)
        assert rc == 0 and out.startswith("node-3: healthy")

        victim = next(a.pid for a in cluster.agents if a.name == "node-0")
        os.kill(victim, signal.SIGKILL)
        after = wait_for(lambda: "node-0" not in (s := client.status()).world and len(s.world) == 2 and s, 15,
                         "node-0 replaced")
        assert "node-3" in after.world and "node-2" in after.spares
        promoted = next(e for e in client.events(50).events if e.kind == "spare_promoted")
        assert promoted.node_id == "node-3" and "node-2 passed over: unhealthy: ssd free" in promoted.message
    finally:
        client.close()
