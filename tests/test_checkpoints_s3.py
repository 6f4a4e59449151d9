"""The cold tier on moto's S3 server over HTTP: shards migrate SSD → HDD → S3, a restore falls back
to S3 when the faster tiers are corrupt (also from a bucket outside the default region), and an
unreachable S3 only makes the cold tier lag."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from storage_fixtures import MotoServer, RegionCheckingProxy

from ftd.checkpoints.layout import shard_prefix
from ftd.client import CoordinatorClient
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.training import Checkpointer
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.s3, pytest.mark.slow]
JOB = "cold"


@pytest.fixture
def s3_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ClusterFile, MotoServer]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto = MotoServer(tmp_path / "moto.log").start()
    bucket = moto.new_bucket()
    cluster = up(tmp_path / "c", nodes=1, spares=0, s3_endpoint=moto.endpoint, s3_bucket=bucket, unmanaged_jobs=True,
                 extra_agent_args=["--tiering-interval-s", "0.5", "--s3-timeout-s", "1", "--s3-max-attempts", "2"])
    try:
        yield cluster, moto
    finally:
        stop(cluster)
        if moto.proc is not None:
            os.kill(moto.proc.pid, signal.SIGCONT)
        moto.stop()


def info_of(client: CoordinatorClient, step: int) -> Any:
    infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=JOB), idempotent=True)
    return next((c for c in infos.checkpoints if c.step == step), None)


def metric(address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_cold_tier_migration_restore_and_outage(s3_cluster: tuple[ClusterFile, MotoServer]) -> None:
    cluster, moto = s3_cluster
    agent = cluster.agents[0].info
    node_dir = Path(cluster.agents[0].info["workdir"])
    ck = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent["socket"], install_signal_handlers=False)
    client = CoordinatorClient(cluster.coordinator_endpoints)
    try:
        ck.save(1, {"w": torch.arange(1_000_000, dtype=torch.float32), "step": 1})
        assert ck.wait().ok  # type: ignore[union-attr]
        wait_for(lambda: (i := info_of(client, 1)) is not None and i.on_tier["s3"] and i.on_tier["hdd"], 30,
                 "step 1 on HDD and S3")

        # SSD and HDD copies both corrupt: the restore comes from S3, verified.
        for root in (node_dir / "ssd", Path(cluster.workdir) / "shared" / "hdd"):
            (root / shard_prefix(JOB, 1, 0) / "state.pt").write_bytes(b"\0" * 100)
        step, loaded = ck.load_latest()  # type: ignore[misc]
        assert step == 1 and torch.equal(loaded["w"], torch.arange(1_000_000, dtype=torch.float32))
        bad = next(s for s in info_of(client, 1).shards if s.rank == 0).bad
        assert set(bad) == {"ssd@node-0", "hdd@shared"}

        # S3 stops answering: saves go on, the cold tier lags and says so.
        assert moto.proc is not None
        os.kill(moto.proc.pid, signal.SIGSTOP)
        for step in (2, 3):
            ck.save(step, {"w": torch.full((1_000_000,), float(step)), "step": step})
            assert ck.wait().ok  # type: ignore[union-attr]
        wait_for(lambda: info_of(client, 3).on_tier["hdd"], 30, "step 3 on HDD while S3 is down")
        wait_for(lambda: metric(agent["metrics"], 'ftd_agent_tier_lag_steps{tier="s3"}') >= 1, 30, "S3 lag metric")
        wait_for(lambda: metric(agent["metrics"], 'ftd_agent_tier_errors_total{tier="s3"}') >= 1, 30,
                 "S3 error metric")
        assert not info_of(client, 3).on_tier["s3"]

        # S3 is back: the cold tier catches up, nothing was lost.
        os.kill(moto.proc.pid, signal.SIGCONT)
        wait_for(lambda: info_of(client, 2).on_tier["s3"] and info_of(client, 3).on_tier["s3"], 60, "S3 catches up")
        wait_for(lambda: metric(agent["metrics"], 'ftd_agent_tier_lag_steps{tier="s3"}') == 0, 30, "lag back to 0")
        for root in (node_dir / "ssd", Path(cluster.workdir) / "shared" / "hdd"):
            (root / shard_prefix(JOB, 3, 0) / "state.pt").unlink()
        step, loaded = ck.load_latest()  # type: ignore[misc]
        assert step == 3 and torch.equal(loaded["w"], torch.full((1_000_000,), 3.0))
    finally:
        ck.close()
        client.close()


def test_a_restore_from_s3_outside_the_default_region(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training side opens the cold tier with the agent's region (and every other S3 setting):
    a store that refuses requests signed for another region serves both the agent's migrations and
    the training's restore."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto = MotoServer(tmp_path / "moto.log").start()
    proxy = RegionCheckingProxy(moto.port, "eu-west-2").start()
    cluster = up(tmp_path / "c", nodes=1, spares=0, s3_endpoint=proxy.endpoint, s3_bucket=moto.new_bucket("eu-west-2"),
                 unmanaged_jobs=True, extra_agent_args=["--tiering-interval-s", "0.5", "--s3-region", "eu-west-2"])
    node_dir = Path(cluster.agents[0].info["workdir"])
    client = CoordinatorClient(cluster.coordinator_endpoints)
    ck = Checkpointer(JOB, rank=0, world_size=1, agent_socket=cluster.agents[0].info["socket"],
                      install_signal_handlers=False)
    try:
        ck.save(1, {"w": torch.arange(100_000, dtype=torch.float32), "step": 1})
        assert ck.wait().ok  # type: ignore[union-attr]
        wait_for(lambda: (i := info_of(client, 1)) is not None and i.on_tier["s3"] and i.on_tier["hdd"], 30,
                 "step 1 on HDD and S3")
        for root in (node_dir / "ssd", Path(cluster.workdir) / "shared" / "hdd"):
            (root / shard_prefix(JOB, 1, 0) / "state.pt").write_bytes(b"\0" * 100)
        step, loaded = ck.load_latest()  # type: ignore[misc]
        assert step == 1 and torch.equal(loaded["w"], torch.arange(100_000, dtype=torch.float32))
        assert set(next(s for s in info_of(client, 1).shards if s.rank == 0).bad) == {"ssd@node-0", "hdd@shared"}
        assert proxy.refused == []
    finally:
        ck.close()
        client.close()
        stop(cluster)
        proxy.stop()
        moto.stop()
