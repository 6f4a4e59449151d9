"""Tiered checkpoints end to end on real processes: etcd, a coordinator, agents (SSD per node, a
shared HDD directory), the training-side API in this process talking to the agents' Unix sockets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ftd.checkpoints.layout import MANIFEST, BadIdentifier, shard_prefix
from ftd.client import CoordinatorClient
from ftd.ftctl.cli import main as ftctl
from ftd.ftctl.localcluster import ClusterFile, spawn_agent, wait_agent
from ftd.training import Checkpointer
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd
JOB = "job-a"


def agent(cluster: ClusterFile, node_id: str) -> Any:
    return next(a for a in cluster.agents if a.name == node_id)


def checkpointer(cluster: ClusterFile, node_id: str, rank: int, world: int, **kw: Any) -> Checkpointer:
    return Checkpointer(JOB, rank=rank, world_size=world, agent_socket=agent(cluster, node_id).info["socket"],
                        install_signal_handlers=False, **kw)


def state(seed: int, size: int = 50_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(size, generator=g), "b": torch.randn(10, generator=g)},
            "optim": {"step": seed, "exp_avg": torch.randn(size, generator=g)}, "step": seed}


def listed(capsys: pytest.CaptureFixture[str], cluster: ClusterFile) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert ftctl(["checkpoints", "list", "--job", JOB, "--json", "--workdir", cluster.workdir]) == 0
    return list(json.loads(capsys.readouterr().out))


def save_all(cks: list[Checkpointer], step: int) -> None:
    for rank, ck in enumerate(cks):
        ck.save(step, state(step * 10 + rank))
    for ck in cks:
        result = ck.wait()
        assert result is not None and result.ok, result


def ssd(cluster: ClusterFile, node_id: str) -> Path:
    return Path(agent(cluster, node_id).info["workdir"]) / "ssd"


def hdd(cluster: ClusterFile) -> Path:
    return Path(cluster.workdir) / "shared" / "hdd"


def test_save_valid_restore_corruption_fallback_retention(
        local_cluster: ClusterFile, capsys: pytest.CaptureFixture[str]) -> None:
    cks = [checkpointer(local_cluster, "node-0", 0, 2), checkpointer(local_cluster, "node-1", 1, 2)]
    try:
        assert cks[0].load_latest() is None  # fresh start
        cks[0].save(10, state(100))
        r0 = cks[0].wait()
        assert r0 is not None and r0.ok and not r0.valid, "one of two ranks: not valid yet"
        assert listed(capsys, local_cluster)[0]["valid"] is False
        cks[1].save(10, state(101))
        r1 = cks[1].wait()
        assert r1 is not None and r1.ok and r1.valid and r1.blocked_s < r1.persist_s
        rows = listed(capsys, local_cluster)
        assert rows[0]["step"] == 10 and rows[0]["valid"] and rows[0]["world_size"] == 2
        assert rows[0]["tiers"]["ssd"]
        wait_for(lambda: listed(capsys, local_cluster)[0]["tiers"]["hdd"], 20, "migration to the shared HDD")

        step, loaded = cks[1].load_latest()  # type: ignore[misc]
        assert step == 10 and torch.equal(loaded["model"]["w"], state(101)["model"]["w"]) and loaded["step"] == 101

        # A bit flip on rank 1's SSD copy: detected, read from the HDD instead, the bad copy recorded.
        save_all(cks, 20)
        wait_for(lambda: next(r for r in listed(capsys, local_cluster) if r["step"] == 20)["tiers"]["hdd"], 20,
                 "step 20 on HDD")
        shard_file = ssd(local_cluster, "node-1") / shard_prefix(JOB, 20, 1) / "state.pt"
        data = bytearray(shard_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard_file.write_bytes(bytes(data))
        step, loaded = cks[1].load_latest()  # type: ignore[misc]
        assert step == 20 and torch.equal(loaded["optim"]["exp_avg"], state(201)["optim"]["exp_avg"])
        client = CoordinatorClient(local_cluster.coordinator_endpoints)
        info = next(c for c in client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=JOB),
                                           idempotent=True).checkpoints if c.step == 20)
        bad = next(s for s in info.shards if s.rank == 1).bad
        assert list(bad) == ["ssd@node-1"] and "crc32c" in bad["ssd@node-1"]

        # ftctl verify names the corrupt shard and tier and exits 1.
        capsys.readouterr()
        assert ftctl(["checkpoints", "verify", "20", "--job", JOB, "--workdir", local_cluster.workdir]) == 1
        assert "rank 1 on ssd@node-1" in capsys.readouterr().err
        assert ftctl(["checkpoints", "verify", "10", "--job", JOB, "--workdir", local_cluster.workdir]) == 0

        # Corrupt on every tier: step 20 can no longer be restored (every copy of rank 1 is recorded
        # corrupt, with the reason), step 10 is restored. Invalidating is the operator's call.
        hdd_file = hdd(local_cluster) / shard_prefix(JOB, 20, 1) / "state.pt"
        hdd_file.write_bytes(b"garbage")
        step, loaded = cks[1].load_latest()  # type: ignore[misc]
        assert step == 10 and loaded["step"] == 101
        rows = {r["step"]: r for r in listed(capsys, local_cluster)}
        assert rows[20]["status"] == "unrestorable: every copy of rank(s) 1 was found corrupt", rows[20]

        # Retention: after 10 checkpoints each tier holds exactly its last 3 valid ones.
        for step in range(30, 130, 10):
            save_all(cks, step)
        newest = [100, 110, 120]
        wait_for(lambda: all(r["tiers"]["hdd"] for r in listed(capsys, local_cluster) if r["step"] in newest), 30,
                 "the newest three on HDD")

        def tier_steps(root: Path) -> set[int]:
            found = set()
            for rank in (0, 1):
                for d in (root / JOB).glob("step-*"):
                    if (d / f"rank-{rank:05d}" / MANIFEST).exists():
                        found.add(int(d.name[5:]))
            return found

        wait_for(lambda: tier_steps(hdd(local_cluster)) == set(newest), 30, "HDD retention")
        wait_for(lambda: tier_steps(ssd(local_cluster, "node-0")) == set(newest), 30, "SSD retention node-0")
        wait_for(lambda: tier_steps(ssd(local_cluster, "node-1")) == set(newest), 30, "SSD retention node-1")
        client.close()
    finally:
        for ck in cks:
            ck.close()


def test_bad_identifiers_are_refused(local_cluster: ClusterFile) -> None:
    for job in ("..", "a/b", "/etc", ""):
        with pytest.raises(BadIdentifier):
            Checkpointer(job, rank=0, world_size=1, agent_socket=agent(local_cluster, "node-0").info["socket"],
                         install_signal_handlers=False)
    ck = checkpointer(local_cluster, "node-0", 0, 1)
    try:
        with pytest.raises(BadIdentifier):
            ck.save(-5, {"x": torch.zeros(1)})
    finally:
        ck.close()
    # A node's own identity: CommitShard is a node's call, at its own location (the validators run after
    # the authorization check, which an operator certificate would fail first).
    client = CoordinatorClient(local_cluster.coordinator_endpoints, tls=local_cluster.identity("node", "node-0"))
    stub = client.stub()
    good = checkpoint_pb2.ShardManifest(job=JOB, step=1, epoch=1, rank=0, world_size=1, format="torch",
                                        files=[checkpoint_pb2.ShardFile(name="state.pt", size=3, crc32c="0a0b0c0d")])
    cases = [("manifest.job", {"job": "../../etc"}), ("manifest.step", {"step": -1}),
             ("manifest.rank", {"rank": 3}), ("manifest.format", {"format": "pickle"})]
    for field, change in cases:
        m = checkpoint_pb2.ShardManifest()
        m.CopyFrom(good)
        for k, v in change.items():
            setattr(m, k, v)
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitShard(checkpoint_pb2.CommitShardRequest(manifest=m, tier="ssd", location="node-0"), timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
    bad_file = checkpoint_pb2.ShardManifest()
    bad_file.CopyFrom(good)
    bad_file.files[0].name = "../../etc/passwd"
    with pytest.raises(grpc.RpcError) as err:
        stub.CommitShard(checkpoint_pb2.CommitShardRequest(manifest=bad_file, tier="ssd", location="node-0"),
                         timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.GetRestoreTarget(checkpoint_pb2.GetRestoreTargetRequest(job=".."), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    client.close()


def test_disk_full_on_the_hot_tier(local_cluster: ClusterFile, tmp_path: Path) -> None:
    small = tmp_path / "small-ssd"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        proc, _, _ = spawn_agent(local_cluster, "node-9", "spare", extra_args=["--ssd-dir", str(small)])
        info = wait_agent(local_cluster, "node-9", proc).info
        ck = Checkpointer("job-full", rank=0, world_size=1, agent_socket=info["socket"], install_signal_handlers=False)
        try:
            ck.save(1, {"w": torch.zeros(1000)})
            assert ck.wait().ok  # type: ignore[union-attr]
            ck.save(2, {"w": torch.zeros(2_000_000)})  # 8 MB on a 3 MB disk
            result = ck.wait()
            assert result is not None and not result.ok and "no space left" in result.error
            assert "step 2" in ck.last_error
            leftovers = [p for p in small.rglob("*") if "ftd-" in p.name]
            assert leftovers == [], leftovers
            step, loaded = ck.load_latest()  # type: ignore[misc]
            assert step == 1 and loaded["w"].shape == (1000,)
            with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            assert 'ftd_agent_checkpoint_save_failures_total{reason="disk_full"} 1.0' in text
        finally:
            ck.close()
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_rollback_makes_an_older_step_the_restore_target(
        local_cluster: ClusterFile, capsys: pytest.CaptureFixture[str]) -> None:
    ck = Checkpointer(JOB, rank=0, world_size=1, agent_socket=agent(local_cluster, "node-0").info["socket"],
                      install_signal_handlers=False)
    try:
        for step in (5, 6, 7):
            ck.save(step, state(step))
            assert ck.wait().ok  # type: ignore[union-attr]
        capsys.readouterr()
        assert ftctl(["checkpoints", "rollback", "--to", "6", "--job", JOB, "--workdir", local_cluster.workdir]) == 0
        assert "removed newer steps: [7]" in capsys.readouterr().out
        step, loaded = ck.load_latest()  # type: ignore[misc]
        assert step == 6 and loaded["step"] == 6
        # The new timeline saves step 7 again: the old folder is replaced, not reused.
        ck.save(7, state(77))
        assert ck.wait().ok  # type: ignore[union-attr]
        step, loaded = ck.load_latest()  # type: ignore[misc]
        assert step == 7 and loaded["step"] == 77
        assert ftctl(["checkpoints", "rollback", "--to", "3", "--job", JOB, "--workdir", local_cluster.workdir]) == 1
    finally:
        ck.close()


CRASH_WORKER = r"""
import os, sys, torch
from ftd.training import Checkpointer
ck = Checkpointer("crash", rank=0, world_size=1, agent_socket=sys.argv[1], install_signal_handlers=False)
start = int(sys.argv[2])
for step in range(start, start + 3):
    ck.save(step, {"w": torch.full((300_000,), float(step)), "step": step})
    ck.wait()
    print("saved", step, flush=True)
"""


def test_sigkill_during_save_never_leaves_an_incomplete_valid_checkpoint(local_cluster: ClusterFile) -> None:
    """Loops over every failpoint of the save path, then over random kill times: afterwards no
    checkpoint marked valid is incomplete, leftovers are gone, and the previous valid step loads."""
    sock = agent(local_cluster, "node-0").info["socket"]
    root = ssd(local_cluster, "node-0")
    ck = Checkpointer("crash", rank=0, world_size=1, agent_socket=sock, install_signal_handlers=False)
    ck.save(1, {"w": torch.full((300_000,), 1.0), "step": 1})
    assert ck.wait().ok  # type: ignore[union-attr]
    client = CoordinatorClient(local_cluster.coordinator_endpoints)
    points = ["ckpt.before_write", "ckpt.after_write", "ckpt.before_publish", "ckpt.after_publish",
              "ckpt.before_commit"]
    kills: list[tuple[str, float]] = [(p, 0.0) for p in points] + [("", d) for d in (0.05, 0.15, 0.3, 0.5, 0.8)]
    next_step = 100
    try:
        for failpoint, delay in kills:
            env = dict(os.environ, FTD_FAILPOINTS=failpoint)
            proc = subprocess.Popen([sys.executable, "-c", CRASH_WORKER, sock, str(next_step)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                proc.wait(timeout=delay or 60)  # a random kill point: SIGKILL whatever the save is doing then
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)
            next_step += 10
            infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="crash"),
                                idempotent=True).checkpoints
            for info in infos:
                if info.valid:
                    assert len(info.shards) == info.world_size
                    folder = root / shard_prefix("crash", info.step, 0)
                    assert (folder / MANIFEST).exists(), f"valid step {info.step} has no published shard"
            # The next process start cleans what the killed one left behind, and restores.
            fresh = Checkpointer("crash", rank=0, world_size=1, agent_socket=sock, install_signal_handlers=False)
            leftovers = [p for p in (root / "crash").rglob("*") if ".ftd-" in p.name]
            assert leftovers == [], (failpoint, delay, leftovers)
            step, loaded = fresh.load_latest()  # type: ignore[misc]
            assert loaded["step"] == step and torch.equal(loaded["w"], torch.full((300_000,), float(step)))
            fresh.close()
    finally:
        ck.close()
        client.close()


def test_dcp_folders_are_supported(local_cluster: ClusterFile) -> None:
    ck = Checkpointer("job-dcp", rank=0, world_size=1, format="dcp",
                      agent_socket=agent(local_cluster, "node-0").info["socket"], install_signal_handlers=False)
    try:
        ck.save(3, {"model": {"w": torch.arange(10_000, dtype=torch.float32)}, "optim": {"m": torch.ones(5)}})
        result = ck.wait()
        assert result is not None and result.ok and result.valid
        folder = ssd(local_cluster, "node-0") / shard_prefix("job-dcp", 3, 0)
        assert (folder / ".metadata").exists() and any(p.suffix == ".distcp" for p in folder.iterdir())
        template = {"model": {"w": torch.zeros(10_000)}, "optim": {"m": torch.zeros(5)}}
        step, loaded = ck.load_latest(template=template)  # type: ignore[misc]
        assert step == 3 and torch.equal(loaded["model"]["w"], torch.arange(10_000, dtype=torch.float32))
    finally:
        ck.close()


SIGTERM_WORKER = r"""
import os, signal, sys, torch
from ftd.training import Checkpointer
ck = Checkpointer("job-term", rank=0, world_size=1, agent_socket=sys.argv[1])
ck.save(5, {"w": torch.full((4_000_000,), 5.0)})   # returns after the snapshot; the write is in flight
os.kill(os.getpid(), signal.SIGTERM)                # e.g. a preemption: the handler flushes, then exits
raise SystemExit("unreachable: SIGTERM must end the process")
"""


def test_sigterm_flushes_the_latest_snapshot(local_cluster: ClusterFile) -> None:
    sock = agent(local_cluster, "node-0").info["socket"]
    proc = subprocess.run([sys.executable, "-c", SIGTERM_WORKER, sock], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -15, proc.stderr[-2000:]
    assert "emergency flush: step 5 persisted" in proc.stderr
    client = CoordinatorClient(local_cluster.coordinator_endpoints)
    infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="job-term"),
                        idempotent=True).checkpoints
    client.close()
    assert [(i.step, i.valid) for i in infos] == [(5, True)]


def test_migrations_are_bandwidth_bounded_and_visible(local_cluster: ClusterFile,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    proc, _, _ = spawn_agent(local_cluster, "node-8", "spare", extra_args=["--tier-bandwidth-mb-s", "2",
                                                                            "--tiering-interval-s", "0.2"])
    info = wait_agent(local_cluster, "node-8", proc).info
    ck = Checkpointer("job-slow", rank=0, world_size=1, agent_socket=info["socket"], install_signal_handlers=False)
    try:
        ck.save(1, {"w": torch.zeros(2_000_000)})  # 8 MB at 2 MB/s: ~3 s in flight after a 1 MiB burst
        assert ck.wait().ok  # type: ignore[union-attr]

        def in_flight() -> Any:
            capsys.readouterr()
            assert ftctl(["checkpoints", "migrations", "--json", "--workdir", local_cluster.workdir]) == 0
            moves = [m for m in json.loads(capsys.readouterr().out) if m["node"] == "node-8"]
            return moves[0] if moves else None

        # The pacing itself is unit-tested with a fake clock (tests/test_tiering.py); here: the copy,
        # paced by the agent's limit, is visible to operators while in flight, then completes.
        move = wait_for(in_flight, 10, "a migration in progress")
        assert move["tier"] == "hdd" and move["job"] == "job-slow" and move["total_bytes"] >= 8_000_000
        client = CoordinatorClient(local_cluster.coordinator_endpoints)
        wait_for(lambda: client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="job-slow"),
                                     idempotent=True).checkpoints[0].on_tier["hdd"], 30, "migration done")
        client.close()
    finally:
        ck.close()
