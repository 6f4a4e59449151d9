"""A rollback on the real training shape: the FSDP2 example (``fully_shard`` per block, DCP memory
snapshots, 2 nodes x 2 ranks on gloo) with ``anomaly_action=rollback``. Rank 3's loss is NaN at step
N once; the reduce-scatter spreads it into every rank's shard. The leader rolls the job back to a
checkpoint before N (a new round of the same nodes, all four ranks restoring their DCP shards), and
every rank's loss and parameter checksum after the rollback equal an uninterrupted run's: the rollback
restored a clean state, exactly."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
from job_records import fsdp2_reference, records

from ftd.ftctl import localcluster
from ftd.v1 import coordinator_pb2
from ftd.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp2_train.py"
STEPS, NAN_AT = 50, 25
JOB_ARGS = ["--params", "300K", "--steps", str(STEPS), "--memory-every", "1", "--persist-every", "5"]


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_nan_in_an_fsdp2_job_is_rolled_back_and_the_rerun_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "run"
    cmd = localcluster.train_command(" ".join([str(EXAMPLE), *JOB_ARGS, "--step-time", "0.1", "--nan-at",
                                               str(NAN_AT), "--nan-rank", "3", "--out", str(out)]), cwd=ROOT)
    train = localcluster.TrainOptions(cmd=cmd, job="fsdp2", nproc_per_node=2)
    cluster = localcluster.up(tmp_path / "cluster", 2, 0, train=train, timeout_s=120.0,
                              extra_coordinator_args=["--anomaly-action", "rollback"])
    client = cluster.client()
    try:
        wait_for(lambda: sum(1 for r in records(out) if r["event"] == "done") >= 4, 400,
                 "all four ranks done after the rollback", interval_s=0.5)
        events = [e for e in client.events(500).events if e.kind.startswith("rollback")]
        info = client.call("GetRound", coordinator_pb2.GetRoundRequest(job="fsdp2"), idempotent=True)
    finally:
        client.close()
        with contextlib.suppress(localcluster.ClusterError):
            localcluster.stop(cluster)

    got = records(out)
    assert len(events) == 1 and events[0].kind == "rollback", [e.message for e in events]
    assert f"nan at step {NAN_AT} on rank 3" in events[0].message, events[0].message
    fired = [r for r in got if r["event"] == "nan_injected"]
    assert [r["step"] for r in fired] == [NAN_AT]
    starts = [r for r in got if r["event"] == "start" and r["t"] > fired[0]["t"]]
    assert sorted(r["rank"] for r in starts) == [0, 1, 2, 3], starts
    restored = {r["restored_step"] for r in starts}
    assert len(restored) == 1 and 0 <= min(restored) < NAN_AT, restored
    resumed = restored.pop()
    assert all(r["restored_from"] for r in starts)
    assert info.restarts == 0, "a rollback is not a restart"
    new_pids = {r["pid"] for r in starts}
    after = {(r["rank"], r["step"]): (r["loss"], r["params_crc"]) for r in got
             if r["event"] == "step" and r["pid"] in new_pids}
    assert set(after) == {(rank, step) for rank in range(4) for step in range(resumed + 1, STEPS)}
    assert all(math.isfinite(loss) for loss, _ in after.values())
    reference = fsdp2_reference(tmp_path, JOB_ARGS)
    mismatched = sorted(k for k, v in after.items() if reference[k] != v)
    assert not mismatched, f"{len(mismatched)} (rank, step) differ from the uninterrupted run, first {mismatched[:5]}"
    print(f"\nrolled back from the NaN at step {NAN_AT} to step {resumed}: {events[0].message}")
