"""The memory tier on real processes: etcd, a coordinator and agents (mTLS, each node's own HDD: no
shared filesystem, no S3), the training side in this process or under torchrun.

* memory snapshots are replicated to the buddy (another rack) and recorded there; the cadence shows
  in the catalog; a snapshot over the budget is refused and counted, never an OOM; a node without a
  copy pulls one from another node's memory;
* a spare prepares room in its memory tier for what it would pull, and the pull lands in it;
* the issue's must-show: a node kill with no shared HDD and no S3 resumes from the buddy's memory,
  losing at most one step.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftd.checkpoints.catalog import CopyRef, from_info
from ftd.ftctl import drill
from ftd.ftctl.localcluster import ClusterFile, TrainOptions, stop, up
from ftd.storage_backends.memory import MemoryTier
from ftd.training import Checkpointer
from ftd.training.cadence import CadencePolicy
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd]
JOB = "mem-job"


def agent(cluster: ClusterFile, node_id: str) -> Any:
    return next(a for a in cluster.agents if a.name == node_id)


def records(cluster: ClusterFile, job: str) -> dict[int, Any]:
    client = cluster.client()
    try:
        infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=job), idempotent=True)
        return {i.step: i for i in infos.checkpoints}
    finally:
        client.close()


def metric(cluster: ClusterFile, node_id: str, prefix: str) -> float:
    with urllib.request.urlopen(f"http://{agent(cluster, node_id).info['metrics']}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def mem_root(cluster: ClusterFile, node_id: str) -> Path:
    return Path(agent(cluster, node_id).info["workdir"]) / "mem"


def snapshots(root: Path, job: str, rank: int) -> list[int]:
    return MemoryTier(root).snapshots(job, rank)


@pytest.fixture
def racks(tmp_path: Path) -> Iterator[ClusterFile]:
    """node-0 (rack r0), node-1 (r1), spare node-2 (r0); each node's HDD is its own; no S3; memory tiers
    of 4 MB (a 3 MB snapshot cannot have two held)."""
    cluster = up(tmp_path / "cluster", nodes=2, spares=1, racks=2, shared_hdd=False, unmanaged_jobs=True,
                 extra_agent_args=["--mem-capacity-bytes", str(4_000_000), "--tiering-interval-s", "0.5"])
    try:
        yield cluster
    finally:
        stop(cluster)


def state(seed: int, size: int = 20_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(size, generator=g), "step": seed}


def test_snapshots_are_replicated_to_the_buddy_bounded_and_pulled_by_a_node_without_a_copy(
        racks: ClusterFile) -> None:
    cadence = CadencePolicy(memory_every_steps=1, persist_every_steps=1000)
    ck = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent(racks, "node-0").info["socket"],
                      install_signal_handlers=False, cadence=cadence)
    try:
        for step in range(6):  # what the cadence asks for (step_end would widen it on a loaded box)
            ck.save(step, state(step), memory=True, durable=step == 0)
            with ck.timing.compute():
                torch.ones(64).sum()
            timed = ck.timing.take()
            # The straggler watch leaves out a step with save work: only a durable one, or at a
            # snapshot every step it would never judge anybody.
            assert timed is not None and timed.save == (step == 0), (step, timed)
        result = ck.wait()
        assert result is not None and result.ok, (result, list(ck.results))
        # node-0 (r0) replicates to node-1 (r1), the next node in another rack; both record their copy.
        both = {CopyRef("mem", "node-0"), CopyRef("mem", "node-1")}
        # Both announce their copy on their heartbeat stream (soft state in the leader, not etcd).
        wait_for(lambda: 5 in (rows := records(racks, JOB)) and both <= {
            CopyRef(c.tier, c.location) for c in rows[5].shards[0].copies}, 20,
            "step 5 in the memory of node-0 and of its buddy node-1")
        rows = records(racks, JOB)
        assert rows[5].on_tier["mem"] and rows[5].cadence == cadence.describe()
        assert rows[0].on_tier["ssd"], "step 0 is durable (the first step of the cadence)"
        # At most two snapshots per rank held, on the node and on its buddy; the catalog agrees.
        wait_for(lambda: snapshots(mem_root(racks, "node-1"), JOB, 0) == [4, 5], 20, "two replicas on node-1")
        assert snapshots(mem_root(racks, "node-0"), JOB, 0) == [4, 5]
        wait_for(lambda: not any(CopyRef("mem", "node-0") in {CopyRef(c.tier, c.location) for c in r.shards[0].copies}
                                 for s, r in records(racks, JOB).items() if s < 4), 20, "older memory copies dropped")
        assert set(records(racks, JOB)) == {0, 4, 5}, "memory-only steps leave the catalog with their last copy"

        # A snapshot the memory tier cannot hold is refused with the sizes, counted, and training goes on.
        big = {"w": torch.zeros(1_000_000), "step": 6}  # 4 MB: over the 4 MB budget with step 5 held
        assert ck.save(6, big, memory=True, durable=False).result().ok is False
        assert "memory tier full" in ck.last_error and "bytes" in ck.last_error
        wait_for(lambda: metric(racks, "node-0", 'ftd_agent_checkpoint_save_failures_total{reason="memory_full"}')
                 >= 1, 10, "the refusal counted")
        assert ck.save(7, state(7), memory=True, durable=False).result().ok
    finally:
        ck.close()

    # The spare holds no copy of rank 0: it pulls one from another node's memory through its agent.
    wait_for(lambda: 7 in (rows := records(racks, JOB)) and rows[7].on_tier["mem"], 20, "step 7 replicated")
    spare = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent(racks, "node-2").info["socket"],
                         install_signal_handlers=False)
    try:
        step, loaded = spare.load_latest()  # type: ignore[misc]
        assert step == 7 and torch.equal(loaded["w"], state(7)["w"])
        assert spare.restored_from.startswith("mem@node-") and "pulled" in spare.restored_from
    finally:
        spare.close()
    assert metric(racks, "node-0", "ftd_agent_memory_replicated_shards_total") >= 2


def test_a_spare_prepares_room_for_what_it_would_pull_and_the_pull_lands_in_it(tmp_path: Path) -> None:
    """The landing reserve (agent.landing) on real agents: the spare sizes it from the catalog (a
    12 MB shard: one 64 MiB slot), the active nodes prepare none, and the spare's pull lands in it."""
    cluster = up(tmp_path / "cluster", nodes=2, spares=1, racks=2, shared_hdd=False, unmanaged_jobs=True)
    big = {"w": torch.randn(3_000_000, generator=torch.Generator().manual_seed(3)), "step": 3}
    ck = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent(cluster, "node-0").info["socket"],
                      install_signal_handlers=False)
    try:
        assert ck.save(3, big, memory=True, durable=False).result().ok
        wait_for(lambda: 3 in (rows := records(cluster, JOB)) and rows[3].on_tier["mem"], 20,
                 "step 3 in memory on node-0 and its buddy")
        wait_for(lambda: metric(cluster, "node-2", "ftd_agent_landing_reserve_bytes") == 64 << 20, 30,
                 "the spare's 64 MiB slot prepared")
        assert list((mem_root(cluster, "node-2") / ".peer-copies" / ".landing").iterdir()), "a file in its memory tier"
        assert metric(cluster, "node-0", "ftd_agent_landing_reserve_bytes") == 0, "an active node prepares none"
        spare = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent(cluster, "node-2").info["socket"],
                             install_signal_handlers=False)
        try:
            step, loaded = spare.load_latest()  # type: ignore[misc]
            assert step == 3 and torch.equal(loaded["w"], big["w"]) and "pulled" in spare.restored_from
        finally:
            spare.close()
        assert metric(cluster, "node-2", "ftd_agent_landing_slots_used_total") == 1
        assert metric(cluster, "node-2", "ftd_agent_landing_reserve_bytes") == 0, "not refilled right after a pull"
    finally:
        ck.close()
        stop(cluster)


# ---- the must-show: a node kill with no shared HDD and no S3 resumes from the buddy's memory ----------------


def job_records(out: Path) -> list[dict[str, Any]]:
    found = []
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                found.append(json.loads(line))
    return sorted(found, key=lambda r: r["t"])


@pytest.mark.slow
def test_a_node_kill_without_shared_hdd_or_s3_resumes_from_the_buddys_memory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train = TrainOptions(cmd=f"-m ftd.training.demo_job --steps 100000 --memory-every 1 --persist-every 1000 "
                             f"--step-time 0.3 --out {out}", job="demo", hang_timeout_s=120.0)
    # node-0 (rack r0), node-1 (r1), spare node-2 (r0): node-0's buddy is node-1 (the next node in another
    # rack), so after node-0's death its rank is in node-1's memory only: no shared HDD, no S3.
    cluster = up(tmp_path / "cluster", nodes=2, spares=1, racks=2, shared_hdd=False, train=train)
    client = cluster.client()
    try:
        def past(step: int) -> bool:
            return max((r["step"] for r in job_records(out) if r["event"] == "step"), default=-1) >= step

        wait_for(lambda: past(25), 180, "training past step 25")
        victim = "node-0"
        rank = list(client.status().world).index(victim)
        killed_at = time.time()
        result = drill.run(client, victim, "", "node", target_detect_s=3.0, target_recover_s=90.0)
        assert result.passed, result.verdict
        assert result.replacement == "node-2" and result.rank == rank
        last_before = max(r["step"] for r in job_records(out) if r["event"] == "step" and r["t"] < killed_at)
        wait_for(lambda: len([r for r in job_records(out) if r["event"] == "start" and r["t"] >= killed_at]) >= 2,
                 60, "both ranks of the new world started")
        starts = [r for r in job_records(out) if r["event"] == "start" and r["t"] >= killed_at]
        restored = {r["restored_step"] for r in starts}
        assert len(restored) == 1, starts
        resumed = restored.pop()
        assert resumed >= last_before - 1, f"resumed at {resumed}, the last step before the kill was {last_before}"
        by_node = {r["node"]: r for r in starts}
        # The spare took node-0's rank and pulled its shard from node-1's memory (node-0's buddy); node-1 read
        # its own.
        assert by_node["node-2"]["rank"] == rank
        assert by_node["node-2"]["restored_from"] == "mem@node-1 (pulled through the agent)", by_node
        assert by_node["node-1"]["restored_from"] == "mem@node-1", by_node
        target = from_info(client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="demo"),
                                       idempotent=True).checkpoints[-1])
        assert target.cadence.startswith("memory_every_steps=1 persist_every_steps=1000")
        wait_for(lambda: past(resumed + 10), 60, "training goes on in the new world")
    finally:
        client.close()
        stop(cluster)
