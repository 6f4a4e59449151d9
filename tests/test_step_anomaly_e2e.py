"""A NaN loss in a real DDP job on a local cluster: the agent of the rank's node judges it from
report_step, carries it in its heartbeat progress, and the leader records one step_anomaly event and
counts it (agents, gRPC, etcd and torch workers all real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftd.ftctl import localcluster
from ftd.v1 import coordinator_pb2
from ftd.waiting import wait_for

NAN_AT = 25


@pytest.mark.timeout(300)
def test_a_nan_loss_on_one_rank_becomes_a_step_anomaly_event(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "training"
    train = localcluster.TrainOptions(
        cmd=f"-m ftd.training.demo_job --steps 60 --ckpt-every 1000 --step-time 0.05 --out {out} "
            f"--nan-at {NAN_AT} --nan-rank 1", job="nan", min_nodes=2)
    cluster = localcluster.up(tmp_path / "cluster", 2, 0, train=train)
    client = cluster.client()
    try:
        def anomalies() -> list[coordinator_pb2.Event] | None:
            got = [e for e in client.events(500).events if e.kind == "step_anomaly"]
            return got if any(f"rank 1 step {NAN_AT}: loss is nan" in e.message for e in got) else None

        # The NaN poisons every rank from the next step on (DDP averages it in), so node-0's anomaly (a step
        # later) may reach the leader first: wait for rank 1's own, then check nothing came before its step.
        events = wait_for(anomalies, 180, f"a step_anomaly event for rank 1 step {NAN_AT}", interval_s=0.5)
        first = next(e for e in events if f"rank 1 step {NAN_AT}: loss is nan" in e.message)
        assert not any(f"step {s}:" in e.message for e in events for s in range(NAN_AT)), "nothing before it"
        nodes = {n.node_id: n for n in client.nodes().nodes}
        assert nodes[first.node_id].progress.anomaly.kind == "nan"
    finally:
        client.close()
        localcluster.stop(cluster)
