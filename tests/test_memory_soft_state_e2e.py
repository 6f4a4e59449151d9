"""Memory snapshots as soft state, on real processes: etcd, TWO coordinator replicas and two agents
(mTLS, each node's own HDD), the training side in this process saving through its agents as training
does. Memory snapshots reach the leader on the heartbeat streams and cost etcd nothing; the standby
follows the leader's memory ledger (FollowMemory), so after a SIGKILL of the leader it serves the
complete restore target (memory copies included) within 5 s of taking over even while every agent
is stopped (SIGSTOP) and cannot re-announce, and never names an older step than before."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from ftd.client import CoordinatorClient
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.rpc import rpc_code
from ftd.training import Checkpointer
from ftd.training.cadence import CadencePolicy
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd]
JOB = "soft-mem"
STEPS = 12  # memory snapshots per rank after the durable step 0: formerly 2 x 2 etcd transactions each


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    c = up(tmp_path_factory.mktemp("soft") / "cluster", nodes=2, spares=0, racks=2, coordinators=2,
           shared_hdd=False, unmanaged_jobs=True, extra_agent_args=["--tiering-interval-s", "0.5"])
    try:
        yield c
    finally:
        stop(c)


def metric(coordinator: Any, name: str, skip: str = "") -> float:
    """The sum of a replica's series of ``name`` (every label but those whose line holds ``skip``)."""
    with urllib.request.urlopen(f"http://{coordinator.info['metrics']}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and not (skip and skip in line))


def etcd_writes(coordinator: Any) -> float:
    """The replica's ``ftd_coordinator_etcd_writes_total``, every kind but the restore floors that this
    test's own restore-target questions pin (one per step newly answered: restore_floors.py)."""
    return metric(coordinator, "ftd_coordinator_etcd_writes_total", skip='kind="restore_floor"')


def target(client: CoordinatorClient, deadline_s: float = 2.0) -> checkpoint_pb2.RestoreTarget:
    return client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=JOB, world_size=2),  # type: ignore[no-any-return]
                       idempotent=True, deadline_s=deadline_s)


def complete(t: checkpoint_pb2.RestoreTarget, step: int) -> bool:
    """Step ``step``, every rank in the memory of its node and its buddy."""
    return t.found and t.checkpoint.step == step and t.checkpoint.on_tier["mem"]


def test_memory_snapshots_cost_etcd_nothing_and_a_failover_never_names_an_older_step(cluster: ClusterFile) -> None:
    client = CoordinatorClient(cluster.coordinator_endpoints, timeout_s=1.0)
    cadence = CadencePolicy(memory_every_steps=1, persist_every_steps=1000)
    ranks = [Checkpointer(JOB, rank=r, world_size=2, install_signal_handlers=False, cadence=cadence,
                          agent_socket=next(a for a in cluster.agents if a.name == f"node-{r}").info["socket"])
             for r in (0, 1)]
    stopped = False
    try:
        before = client.status()
        leader = next(c for c in cluster.coordinators if c.info["address"] == before.leader_address)
        standby = next(c for c in cluster.coordinators if c is not leader)
        for ck in ranks:  # step 0 durable, as a cadence's first step is
            assert ck.save(0, {"w": torch.full((1000,), -1.0)}, memory=True, durable=True).result().ok
        wait_for(lambda: (t := target(client)).found and t.checkpoint.step == 0, 20, "the durable step 0")
        writes = etcd_writes(leader)
        for step in range(1, STEPS + 1):
            for r, ck in enumerate(ranks):
                assert ck.save(step, {"w": torch.full((1000,), float(step * 10 + r))}, memory=True,
                               durable=False).result().ok
        wait_for(lambda: complete(target(client), STEPS), 20, f"step {STEPS} in memory on both nodes")
        spent = etcd_writes(leader) - writes
        # formerly 4 transactions per step (each rank's CommitShard, its buddy's RecordCopy): 48 here
        assert spent <= 2, f"{spent} etcd writes for {2 * STEPS} memory snapshots and their replicas"
        listed = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=JOB), idempotent=True)
        mem = [i.step for i in listed.checkpoints if i.on_tier["mem"]]
        assert mem[-1] == STEPS and 0 in [i.step for i in listed.checkpoints]
        assert metric(leader, "ftd_coordinator_etcd_writes_total", skip="checkpoint") >= 1, "no floor pinned"
        # The standby follows the leader's ledger an interval behind at most: every report taken before now.
        now = time.time()
        wait_for(lambda: metric(standby, "ftd_coordinator_memory_mirror_as_of_unix_seconds") >= now, 10,
                 "the standby following the leader's memory ledger up to now")
        assert metric(standby, "ftd_coordinator_memory_mirror_reports_total") >= 2

        # No agent can re-announce now: what the new leader knows of their memory it followed.
        for agent in cluster.agents:
            os.kill(agent.pid, signal.SIGSTOP)
        stopped = True
        os.kill(leader.pid, signal.SIGKILL)
        answers: list[int] = []
        refused = 0

        def new_leader_complete() -> float | None:
            nonlocal refused
            try:
                t = target(client, deadline_s=0.3)
            except (ConnectionError, grpc.RpcError) as exc:
                if isinstance(exc, grpc.RpcError):
                    assert rpc_code(exc) is grpc.StatusCode.UNAVAILABLE, exc
                refused += 1
                raise  # wait_for retries, and names the last refusal if it times out
            answers.append(t.checkpoint.step if t.found else -1)
            return time.time() if complete(t, STEPS) else None

        done = wait_for(new_leader_complete, 30, "the new leader's complete restore target", interval_s=0.05)
        status = client.status()
        nodes = {n.node_id: n for n in client.nodes().nodes}
        for agent in cluster.agents:
            os.kill(agent.pid, signal.SIGCONT)
        stopped = False
        assert status.leader_address == standby.info["address"]
        took = done - status.leader_since_unix_s
        print(f"complete restore target {took:.2f}s after the standby took over; {refused} refused or unreachable, "
              f"answers {answers}; {spent} etcd writes for {2 * STEPS} memory snapshots")
        assert all(step >= STEPS for step in answers), f"an answer older than before the failover: {answers}"
        assert took <= 5.0, f"the standby served the complete target {took:.2f}s after taking over"
        assert len(nodes) == 2 and all(n.last_heartbeat_age_s < 0 for n in nodes.values()), \
            f"an agent reached the new leader while stopped: {nodes}"
    finally:
        if stopped:
            for agent in cluster.agents:
                os.kill(agent.pid, signal.SIGCONT)
        for ck in ranks:
            ck.close()
        client.close()
