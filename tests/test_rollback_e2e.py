"""anomaly_action=rollback on a real local cluster (etcd, coordinator, agents, DDP torch workers): a
NaN loss on one rank at step N rolls the job back to a checkpoint saved before N, in a new round of
the same nodes, once; the checkpoints from N on are marked suspect and never restored; the rerun is
clean and the job finishes with the restart budget untouched."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from job_records import records

from ftd.ftctl import localcluster
from ftd.v1 import coordinator_pb2
from ftd.waiting import wait_for

NAN_AT = 30
STEPS = 90


@pytest.mark.timeout(400)
def test_a_nan_step_is_rolled_back_to_a_checkpoint_before_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "training"
    train = localcluster.TrainOptions(
        cmd=f"-m ftd.training.demo_job --steps {STEPS} --memory-every 1 --persist-every 5 --step-time 0.05 "
            f"--out {out} --nan-at {NAN_AT} --nan-rank 1", job="nan", min_nodes=2)
    cluster = localcluster.up(tmp_path / "cluster", 2, 0, train=train,
                              extra_coordinator_args=["--anomaly-action", "rollback"])
    client = cluster.client()
    try:
        def rolled_back() -> list[coordinator_pb2.Event] | None:
            got = [e for e in client.events(500).events if e.kind == "rollback"]
            return got or None

        events = wait_for(rolled_back, 240, "a rollback event", interval_s=0.5)
        assert len(events) == 1, [e.message for e in events]
        assert f"nan at step {NAN_AT} on rank 1" in events[0].message, events[0].message

        def finished() -> list[dict[str, Any]] | None:
            done = [r for r in records(out) if r.get("event") == "done"]
            return done if len(done) >= 2 else None

        wait_for(finished, 240, "both ranks done after the rollback", interval_s=0.5)
        rows = records(out)
        injected = [r for r in rows if r.get("event") == "nan_injected"]
        assert [r["step"] for r in injected] == [NAN_AT], "the transient fault fired once"
        fired_at = float(injected[0]["t"])
        restarts = [r for r in rows if r.get("event") == "start" and float(r["t"]) > fired_at]
        assert {r["rank"] for r in restarts} == {0, 1}, "every rank restarted"
        assert all(0 <= int(r["restored_step"]) < NAN_AT for r in restarts), \
            [r["restored_step"] for r in restarts]
        last = max(int(r["step"]) for r in rows if r.get("event") == "step")
        final = [r for r in rows if r.get("event") == "step" and int(r["step"]) == last]
        assert last == STEPS - 1 and all(math.isfinite(float(r["loss"])) for r in final), final
        assert not [e for e in client.events(500).events if e.kind == "rollback_budget_spent"]
        info = client.call("GetRound", coordinator_pb2.GetRoundRequest(job="nan"), idempotent=True)
        assert info.restarts == 0 and info.round >= 1, "a rollback is a new round, not a restart"
        # The suspect steps of the first round were replaced by the rerun's; none is offered now.
        offered = [c for c in client.checkpoints("nan") if c.status.startswith("invalid: suspect")]
        assert all(c.step >= NAN_AT for c in offered), [(c.step, c.status) for c in offered]
    finally:
        client.close()
        localcluster.stop(cluster)
