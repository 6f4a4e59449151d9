"""SIGKILL of the coordinator leader: a standby serves within 5 s and no node is declared dead."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from chaos_tests.faults import KillProcess, injected
from chaos_tests.observe import watch
from ftd.client import CoordinatorClient
from ftd.ftctl.localcluster import stop, up
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def test_leader_sigkill_standby_takes_over_without_false_deaths(tmp_path: Path) -> None:
    cluster = up(tmp_path / "c", nodes=2, spares=1, coordinators=2)
    client = CoordinatorClient(cluster.coordinator_endpoints, timeout_s=1.0)
    try:
        before = client.status()
        leader = next(c for c in cluster.coordinators if c.info["address"] == before.leader_address)
        standby = next(c for c in cluster.coordinators if c is not leader)

        def serving() -> None:
            s = client.status(deadline_s=10)
            assert s.epoch == before.epoch and not s.dead

        with injected(KillProcess(leader.pid), healthy=None):
            killed = time.monotonic()
            new = wait_for(lambda: (s := client.status(deadline_s=0.5)).leader_id == standby.name and s,
                           10, "the standby to serve as leader")
            takeover_s = time.monotonic() - killed
        assert takeover_s <= 5.0, f"standby took {takeover_s:.2f}s to serve"
        assert new.leader_address == standby.info["address"]

        # Agents follow the new leader; through its grace period and beyond, nobody is declared dead.
        seen = watch(cluster, seconds=9.0)
        assert seen.dead_seen == set() and seen.fenced_agents == set()
        assert seen.epochs_seen == {before.epoch}, f"epochs seen: {seen.epochs_seen}"
        serving()
        nodes = client.nodes().nodes
        assert all(n.state == 1 and 0 <= n.last_heartbeat_age_s < 1.5 for n in nodes), nodes

        # Normal service under the new leader: a real death is still detected and repaired.
        victim = next(a for a in cluster.agents if a.name in before.world)
        os.kill(victim.pid, signal.SIGKILL)
        after = wait_for(lambda: (s := client.status()).epoch == before.epoch + 1 and s, 10, "promotion")
        assert victim.name not in after.world and "node-2" in after.world
    finally:
        client.close()
        stop(cluster)
