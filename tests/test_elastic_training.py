"""Elastic training end to end with real processes: etcd, a coordinator, agents that run torchrun with
the ftd rendezvous, gloo DDP on a small model (ftd.training.demo_job). Every scenario breaks something
for real and checks the training's own records (one JSON line per step and rank)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftd.agent.torchrun_supervisor import descendants
from ftd.client import CoordinatorClient
from ftd.ftctl import drill, goodput
from ftd.ftctl.localcluster import TrainOptions, spawn_agent, stop, up, wait_agent
from ftd.training import demo_job
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


class Run:
    def __init__(self, tmp: Path, nodes: int, spares: int, min_nodes: int = 0, hang_timeout_s: float = 120.0) -> None:
        self.out = tmp / "run"
        train = TrainOptions(cmd=f"-m ftd.training.demo_job --steps 100000 --ckpt-every 10 --step-time 0.05 "
                                 f"--out {self.out}", job="demo", min_nodes=min_nodes, hang_timeout_s=hang_timeout_s)
        self.cluster = up(tmp / "cluster", nodes, spares, train=train)
        self.client = CoordinatorClient(self.cluster.coordinator_endpoints)

    def records(self) -> list[dict[str, Any]]:
        out = []
        for f in self.out.glob("*.jsonl"):
            for line in f.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line being written
                    out.append(json.loads(line))
        return sorted(out, key=lambda r: r["t"])

    def max_step(self) -> int:
        return max((r["step"] for r in self.records() if r["event"] == "step"), default=-1)

    def valid_step(self) -> int:
        target = self.client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job="demo"),
                                  idempotent=True)
        return target.checkpoint.step if target.found else -1

    def training(self, beyond: int = 25) -> None:
        wait_for(lambda: self.max_step() >= beyond and self.valid_step() >= 10, 120, f"training past step {beyond}")

    def close(self) -> None:
        self.client.close()
        stop(self.cluster)


@pytest.fixture
def run_factory(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def make(**kw: Any) -> Run:
        runs.append(Run(tmp_path / f"r{len(runs)}", **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def standbys_ready(metrics: str) -> int | None:
    """The agent's ``ftd_agent_standby_workers_ready`` (None: not exported)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        found = re.search(r"^ftd_agent_standby_workers_ready (\S+)$", resp.read().decode(), re.M)
    return None if found is None else int(float(found.group(1)))


def check_resumed(run: Run, result: drill.DrillResult, fault_t: float) -> None:
    """Training resumed at exactly the latest valid checkpoint step, every rank holds the same
    parameters, the loss keeps decreasing, and no worker of the old world is still running."""
    records = run.records()
    starts = [r for r in records if r["event"] == "start" and r["t"] > fault_t]
    assert starts, "no worker started after the fault"
    assert {r["restored_step"] for r in starts} == {result.resumed_step}, starts
    assert result.resumed_step is not None and result.resumed_step >= 10
    new_pids = {r["pid"] for r in starts}
    after = [r for r in records if r["event"] == "step" and r["pid"] in new_pids]
    wait_for(lambda: len({r["step"] for r in run.records() if r["event"] == "step" and r["pid"] in new_pids}) >= 15,
             60, "15 steps in the new world")
    records = run.records()
    after = [r for r in records if r["event"] == "step" and r["pid"] in new_pids]
    assert min(r["step"] for r in after) == result.resumed_step + 1
    by_step: dict[int, set[str]] = defaultdict(set)
    ranks_by_step: dict[int, set[int]] = defaultdict(set)
    for r in after:
        by_step[r["step"]].add(r["params_crc"])
        ranks_by_step[r["step"]].add(r["rank"])
    full = [s for s, ranks in ranks_by_step.items() if len(ranks) == starts[0]["world"]]
    assert full and all(len(by_step[s]) == 1 for s in full), "ranks disagree on the parameters"
    first = [r["loss"] for r in records if r["event"] == "step" and r["step"] < 15]
    last = [r["loss"] for r in after[-10:]]
    assert sum(last) / len(last) < sum(first) / len(first), "the loss did not keep decreasing"
    old_pids = {r["pid"] for r in records if r["event"] == "start" and r["t"] < fault_t}
    assert not [p for p in old_pids if alive(p)], "a worker of the old world is still running"
    assert not demo_job.replay_mismatches(records), "a step run again after the recovery differs from its first run"


def check_goodput_agrees(run: Run, result: drill.DrillResult, kind: str) -> None:
    """``ftctl goodput`` after the drill: one incident of ``kind`` whose detection, recovery and steps
    redone agree with the drill's own measurement (the leader times from the node's last heartbeat, the
    drill from its kill: a heartbeat interval apart; the drill reads steps through the agents)."""
    wait_for(lambda: goodput.fetch(run.client)["incidents"] and not goodput.fetch(run.client)["incidents"][-1]["open"],
             30, "the goodput incident closed")
    report = goodput.fetch(run.client)
    [incident] = report["incidents"]
    assert incident["kind"] == kind and (kind == "worker_failed" or incident["node_id"] == result.node), incident
    assert result.detected_s is not None and result.recovered_s is not None and result.lost_steps is not None
    if kind != "worker_failed":  # the leader learns of a worker failure at the round, with no detection of its own
        assert abs(incident["detection_s"] - result.detected_s) < 1.5, (incident, result)
    assert abs(incident["detection_s"] + incident["recovery_s"] - result.recovered_s) < 2.5, (incident, result)
    assert incident["restored_step"] == result.resumed_step
    assert abs(incident["steps_redone"] - result.lost_steps) <= 20, (incident, result)  # 1 s of 0.05 s steps
    assert 0 < report["goodput_ratio"] < 1 and report["lost_s"]["restart"] > 0


def test_kill_node_spare_takes_the_rank_and_training_resumes(run_factory: Any) -> None:
    run = run_factory(nodes=2, spares=1)
    run.training()
    spare = next(a for a in run.cluster.agents if a.name == "node-2").info["metrics"]
    wait_for(lambda: standbys_ready(spare) == 1, 120, "the spare warm (ftd_agent_standby_workers_ready 1)")
    victim = run.client.status().world[1]
    result = drill.run(run.client, victim, run.cluster.drill_token, "node", target_detect_s=3.0,
                       target_recover_s=60.0)
    fault_t = min(r["t"] for r in run.records() if r["event"] == "step" and r["step"] == result.last_step_before) \
        if result.last_step_before is not None else 0
    assert result.passed, result.verdict
    assert result.replacement == "node-2" and result.rank == 1
    assert list(run.client.status().world)[1] == "node-2"
    check_resumed(run, result, fault_t)
    check_goodput_agrees(run, result, "node_dead")


def test_hung_node_is_fenced_and_replaced(run_factory: Any) -> None:
    run = run_factory(nodes=2, spares=1, hang_timeout_s=4.0)
    run.training()
    victim = run.client.status().world[0]
    result = drill.run(run.client, victim, run.cluster.drill_token, "hang", target_detect_s=15.0,
                       target_recover_s=60.0)
    assert result.passed, result.verdict
    assert result.replacement == "node-2"
    why = [e.message for e in run.client.events(200).events if e.kind == "node_dead" and e.node_id == victim]
    assert why and "hung" in why[0] and "state T" in why[0], why
    check_resumed(run, result, 0.0 if result.last_step_before is None else
                  min(r["t"] for r in run.records() if r["event"] == "step" and r["step"] == result.last_step_before))


def test_killed_worker_restarts_the_job_in_a_new_round(run_factory: Any) -> None:
    run = run_factory(nodes=2, spares=1)
    run.training()
    before = run.client.status()
    victim = before.world[1]
    result = drill.run(run.client, victim, run.cluster.drill_token, "worker", target_detect_s=5.0,
                       target_recover_s=60.0)
    assert result.passed, result.verdict
    after = run.client.status()
    assert after.epoch == before.epoch and list(after.world) == list(before.world), "a worker crash is no death"
    assert after.job_round > before.job_round and after.job_restarts == before.job_restarts + 1
    fault_t = min(r["t"] for r in run.records() if r["event"] == "step" and r["step"] == result.last_step_before)
    check_resumed(run, result, fault_t)
    check_goodput_agrees(run, result, "worker_failed")


def test_two_nodes_lost_one_spare_world_shrinks_then_waits_and_says_why(run_factory: Any) -> None:
    run = run_factory(nodes=3, spares=1, min_nodes=2)
    run.training()
    before = run.client.status()
    world = list(before.world)
    pids = {a.name: a.pid for a in run.cluster.agents}
    for victim in world[:2]:
        kill_tree(pids[victim])  # two whole nodes at once: agents, torchrun, workers
    status = wait_for(lambda: (s := run.client.status()).epoch > before.epoch and len(s.world) == 2 and s, 30,
                      "one spare promoted, the world shrunk to 2")
    assert "node-3" in status.world and status.degraded
    shrunk_at = max(r["t"] for r in run.records())
    wait_for(lambda: any(r["event"] == "step" and r["world"] == 2 and r["t"] > shrunk_at for r in run.records()),
             60, "training goes on in a world of 2 (MIN allows it)")
    # One more loss, no spare left: below MIN the job waits, and the status says why.
    kill_tree(pids[status.world[0]])
    def waits() -> Any:
        s = run.client.status()
        return s if len(s.world) == 1 and "needs at least 2" in s.job_message else None

    assert "waiting" in wait_for(waits, 30, "the job to wait, saying why").job_message
    # A new node arrives as a spare: the world is restored and training resumes.
    proc, _, _ = spawn_agent(run.cluster, "node-9", "spare",
                             extra_args=TrainOptions(cmd=f"-m ftd.training.demo_job --steps 100000 --ckpt-every 10 "
                                                         f"--step-time 0.05 --out {run.out}", job="demo",
                                                     min_nodes=2).agent_args(3))
    wait_agent(run.cluster, "node-9", proc)
    resumed_at = max(r["t"] for r in run.records())
    wait_for(lambda: any(r["event"] == "step" and r["t"] > resumed_at and r["node"] == "node-9"
                         for r in run.records()), 90, "training resumes with the new node")


def test_a_zombie_cannot_rejoin_or_disturb_the_world(run_factory: Any) -> None:
    run = run_factory(nodes=2, spares=1)
    run.training()
    status = run.client.status()
    zombie = status.world[1]
    agent_pid = next(a.pid for a in run.cluster.agents if a.name == zombie)
    zombie_workers = {r["pid"] for r in run.records() if r["event"] == "start" and r["node"] == zombie}
    tree = [agent_pid, *descendants(agent_pid)]  # the whole node freezes: agent, torchrun, workers
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: run.client.status().epoch > status.epoch, 30, "the frozen node replaced")
        resumed = run.max_step()
        wait_for(lambda: run.max_step() > resumed + 5 and any(
            r["event"] == "step" and r["node"] == "node-2" for r in run.records()), 90, "training resumed")
    finally:
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
    epoch = run.client.status().epoch
    thawed_at = max(r["t"] for r in run.records())
    # The zombie's agent learns it was fenced, kills its old workers and comes back as a spare.
    wait_for(lambda: zombie in run.client.status().spares, 30, "the zombie back as a spare")
    wait_for(lambda: not [p for p in zombie_workers if alive(p)], 30, "the zombie's old workers gone")
    progress_before = run.max_step()
    wait_for(lambda: run.max_step() > progress_before + 5, 60, "training goes on undisturbed")
    assert run.client.status().epoch == epoch, "the zombie changed the world"
    late = [r for r in run.records() if r["t"] > thawed_at and r["pid"] in zombie_workers and r["event"] == "step"]
    assert late == [], "an old-epoch worker of the zombie trained in the new world"
