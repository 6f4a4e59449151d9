"""A node lost and no spare left, on real processes: etcd, a coordinator, 2 agents running
``examples/fsdp2_train.py`` with 2 ranks each (FSDP2 ``fully_shard`` on gloo, 2.1 M parameters, DCP
through the Checkpointer, a memory snapshot every step), ``ftctl drill`` killing node-1.

* ``on_no_spare = "shrink"``: the job goes on as 1 node x 2 ranks, restoring the newest step the
  4 ranks saved, resharded by DCP (old ranks 2 and 3 read from their replicas in node-0's memory);
  nothing is recorded corrupt, nothing invalidated, no step at or before the restored one removed;
  the drill reports the step the new world restored.
* ``on_no_spare = "wait"``: no round forms on the smaller world; ``ftctl status`` says why; a spare
  that arrives later fills the rank and the job resumes as 4 ranks from the step the catalog named
  while it waited (in memory when the replicas kept up with the steps, else the durable step 0: a
  rank keeps its two newest snapshots whether or not its buddy has them yet).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from job_records import records, restore_target_step

from ftd.ftctl import drill, localcluster
from ftd.ftctl.json_shapes import status_dict
from ftd.ftctl.render import status as render_status
from ftd.waiting import Timeout, wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp2_train.py"
JOB = "fsdp2"


class Run:
    def __init__(self, tmp: Path, on_no_spare: str) -> None:
        self.out = tmp / "run"
        cmd = localcluster.train_command(f"{EXAMPLE} --params 2M --steps 100000 --memory-every 1 "
                                         f"--persist-every 1000 --step-time 0.25 --out {self.out}")
        self.train = localcluster.TrainOptions(cmd=cmd, job=JOB, nproc_per_node=2, min_nodes=1,
                                               on_no_spare=on_no_spare)
        self.cluster = localcluster.up(tmp / "cluster", 2, 0, train=self.train, timeout_s=120.0)
        self.client = self.cluster.client()

    def checkpoints(self) -> list[Any]:
        return list(self.client.checkpoints(JOB))

    def in_memory(self) -> int:
        """The newest step every rank has in the memory of two nodes (its own and its buddy's)."""
        return max((c.step for c in self.checkpoints() if c.valid and c.on_tier["mem"]), default=-1)

    def training(self) -> None:
        wait_for(lambda: max((r["step"] for r in records(self.out) if r["event"] == "step"), default=-1) >= 12
                 and self.in_memory() >= 8, 300, "training past step 12 with a step held in memory", interval_s=0.3)

    def close(self) -> None:
        self.client.close()
        localcluster.stop(self.cluster)


@pytest.fixture
def make_run(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def make(on_no_spare: str) -> Run:
        runs.append(Run(tmp_path / on_no_spare, on_no_spare))
        return runs[-1]

    yield make
    for run in runs:
        run.close()


def assert_nothing_corrupt(run: Run) -> None:
    for c in run.checkpoints():
        assert not c.status.startswith(("invalid", "unrestorable")), (c.step, c.status)
        assert all(not s.bad for s in c.shards), (c.step, [dict(s.bad) for s in c.shards])


@pytest.mark.timeout(600)
def test_no_spare_and_shrink_resumes_on_two_ranks_from_the_newest_step_resharded(make_run: Any) -> None:
    run = make_run("shrink")
    run.training()
    assert run.client.status().job_on_no_spare == "shrink"
    result = drill.run(run.client, "node-1", mode="node", target_recover_s=180.0, timeout_s=240.0)
    assert result.passed, (result.verdict, result.timeline)
    assert result.replacement is None and "the world shrank" in result.verdict

    got = records(run.out)
    starts = [r for r in got if r["event"] == "start" and r["world"] == 2]
    assert {(s["node"], s["rank"]) for s in starts} == {("node-0", 0), ("node-0", 1)}, starts
    resumed = {s["restored_step"] for s in starts}
    assert len(resumed) == 1, starts
    step = resumed.pop()
    # The newest step every old rank could be read from (the catalog's target at the new epoch: from
    # memory while the replicas keep up with the steps, else the durable step 0), or a newer one.
    assert result.resumed_step == step and result.restore_target_step is not None
    assert step >= max(result.restore_target_step, 0), (step, result.as_dict())
    assert all(s["restored_from"].startswith("resharded from world size 4 to 2") for s in starts), starts
    assert all(s["position"] == step + 1 for s in starts), "each rank's data loader goes on from old rank r's"
    old_pids = {r["pid"] for r in got if r["event"] == "start" and r["world"] == 4}
    before = max(r["step"] for r in got if r["event"] == "step" and r["pid"] in old_pids)
    print(f"\nno spare, shrink: the 4 ranks had done step {before}; 2 ranks resumed from step {step} "
          f"({result.resumed_from}) in {result.recovered_s} s")
    assert "resharded from world size 4" in result.resumed_from

    new_pids = {s["pid"] for s in starts}
    wait_for(lambda: {r["pid"] for r in records(run.out) if r["event"] == "step" and r["step"] > step + 3}
             >= new_pids, 120, "both ranks of the shrunk world train on")
    assert_nothing_corrupt(run)
    kept = {c.step: c for c in run.checkpoints()}
    assert 0 in kept and kept[0].world_size == 4 and kept[0].valid, "the durable step 0 of the old world stays"
    removed = [e.message for e in run.client.events(500).events if e.kind == "checkpoints_removed"]
    for message in removed:
        if "abandoned timeline" in message:
            assert f"restored step {step};" in message, message  # only steps newer than the restored one


@pytest.mark.timeout(600)
def test_no_spare_and_wait_waits_saying_why_until_a_spare_comes(make_run: Any) -> None:
    run = make_run("wait")
    run.training()
    before = run.client.status()
    pids = {a.name: a.pid for a in run.cluster.agents}
    result = drill.run(run.client, "node-1", mode="node", target_recover_s=5.0, timeout_s=15.0)
    assert not result.passed and result.recovered_s is None, result.verdict  # it waits: no training here

    def waiting() -> Any:
        s = run.client.status()
        return s if len(s.world) == 1 and "on_no_spare=wait" in s.job_message else None

    status = wait_for(waiting, 30, "the job to wait for a spare, saying why")
    assert status.job_round == before.job_round, "no round formed on the smaller world"
    assert status.job_message.startswith("waiting: the world has 1 of its 2 node(s)")
    shown = render_status(status_dict(status))
    assert "on_no_spare=wait" in shown and "waiting: the world has 1 of its 2 node(s)" in shown
    assert any(e.kind == "job" and "on_no_spare=wait" in e.message for e in run.client.events(200).events)
    assert not [r for r in records(run.out) if r["event"] == "start" and r["world"] == 2]
    assert_nothing_corrupt(run)

    # A spare arrives: it takes the lost rank, the job resumes as 4 ranks from the step the catalog names
    # now (nothing trains while the job waits: the target stays).
    target = restore_target_step(run.client, JOB)
    assert target >= 0, "the durable step 0 at least"
    proc, _, _ = localcluster.spawn_agent(run.cluster, "node-2", "spare", extra_args=run.train.agent_args(2))
    localcluster.wait_agent(run.cluster, "node-2", proc, timeout_s=60.0)
    assert pids["node-0"] in {a.pid for a in run.cluster.agents}
    def resumed() -> list[dict[str, Any]] | None:  # every rank's start line written, not only the spare's
        starts = [r for r in records(run.out) if r["event"] == "start" and r["world"] == 4 and r["restored_step"] >= 0]
        spare = {(r["node"], r["rank"]) for r in starts if r["node"] == "node-2"}
        return starts if spare == {("node-2", 2), ("node-2", 3)} and len(starts) >= 4 else None

    try:
        starts = wait_for(resumed, 240, "the job to resume with the spare, every rank restored")
    except Timeout:  # what each rank did and what the leader says, for a failure on a box whose files are gone
        seen = [(r["node"], r["rank"], r["world"], r["restored_step"], r["restored_from"][:80])
                for r in records(run.out) if r["event"] == "start"]
        raise AssertionError(f"no resume with the spare within 240 s: starts {seen}; target {target}; job: "
                             f"{run.client.status().job_message!r}") from None
    assert {s["restored_step"] for s in starts} == {target}, (target, starts)
    print(f"\nno spare, wait: resumed as 4 ranks from step {target} ({starts[0]['restored_from']})")
    assert len({s["restored_step"] for s in starts}) == 1 and len(starts) == 4, starts
    assert not run.client.status().job_message.startswith("waiting"), run.client.status().job_message
    assert_nothing_corrupt(run)
