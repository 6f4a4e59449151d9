"""Sharded state through ftd's Checkpointer on real processes: a 2-rank gloo FSDP2 job
(tests/fsdp_job.py: ``fully_shard`` per block, Adam, the state as ``get_state_dict`` returns it, a
Stateful data loader, dropout and python-random jitter) saves memory snapshots in DCP form through
the agents of a local cluster, crashes, and a fresh world restores in place: every rank's parameter
and optimizer fingerprints and every later loss equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftd.ftctl.localcluster import ClusterFile

pytestmark = pytest.mark.etcd
JOB_SCRIPT = Path(__file__).with_name("fsdp_job.py")
STEPS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(cluster: ClusterFile, job: str, out: Path, *extra: str, world: int = 2,
              timeout_s: float = 240.0) -> list[subprocess.CompletedProcess[str]]:
    """One world of ``world`` ranks, rank r using node-r's agent, run to its end."""
    port = free_port()
    procs = []
    for rank in range(world):
        agent = next(a for a in cluster.agents if a.name == f"node-{rank}")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "FTD_AGENT_SOCKET": agent.info["socket"]}
        procs.append(subprocess.Popen([sys.executable, str(JOB_SCRIPT), "--job", job, "--steps", str(STEPS),
                                       "--out", str(out), *extra], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    done = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout_s)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return done


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_fsdp2_state_saved_sharded_and_restored_in_place_bit_identical(local_cluster: ClusterFile,
                                                                         tmp_path: Path) -> None:
    ref, rec = tmp_path / "ref", tmp_path / "rec"
    for p in run_world(local_cluster, "fsdp-ref", ref):
        assert p.returncode == 0, p.stdout[-3000:]
    for p in run_world(local_cluster, "fsdp-rec", rec, "--crash-after", "3"):
        assert p.returncode == -9, p.stdout[-3000:]  # SIGKILLed itself once step 3 was committed
    for p in run_world(local_cluster, "fsdp-rec", rec):
        assert p.returncode == 0, p.stdout[-3000:]
    for rank in range(2):
        want = {r["step"]: r for r in records(ref, rank) if r["event"] == "step"}
        got = records(rec, rank)
        crash = next(r for r in got if r["event"] == "crash")
        assert crash["saved"] == [True, "mem", ""], crash
        start = [r for r in got if r["event"] == "start"][-1]
        assert start["restored"] == 3 and start["source"].startswith("mem@node-"), start
        assert set(start["extra"]) >= {"python", "torch", "dataloader"} and start["position"] == 4, start
        assert start["prints"] == want[3]["prints"], "the restored shards differ from the saved ones"
        saved_after = [r for r in got if r["event"] == "saved" and r["step"] > 3]
        assert saved_after and all(r["alloc_s"] == 0.0 for r in saved_after), "prepare() allocated the buffers"
        after = [r for r in got if r["event"] == "step" and r["step"] > 3]
        assert [r["step"] for r in after] == [4, 5]
        for r in after:
            assert r["loss"] == want[r["step"]]["loss"], (rank, r["step"])  # bit-identical: dropout, data, jitter
            assert r["prints"] == want[r["step"]]["prints"], (rank, r["step"])
