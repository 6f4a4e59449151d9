"""Your own script on a local cluster: ``ftctl up --train-cmd examples/fsdp2_train.py --nproc-per-node 2``
(2 nodes x 2 ranks + a spare, FSDP2 ``fully_shard`` on gloo, the state as ``get_state_dict`` gives it),
then ``ftctl drill --kill-node``: the job resumes from memory, and every rank's loss and parameter
checksum after the recovery equal an uninterrupted run's (the same script under torchrun with
``--no-ftd``) at every step. Plus the pure parts: the command normalisation of ``ftctl up`` and the
example's sizes and contract."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from job_records import fsdp2_reference, records, restore_target_step

from ftd.agent.torchrun_supervisor import descendants
from ftd.ftctl import cli, localcluster
from ftd.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp2_train.py"
STEPS = 60
# 2.1 M parameters (4 blocks of 256), a memory snapshot every step, paced so that the drill lands mid-run.
JOB_ARGS = ["--params", "2M", "--steps", str(STEPS), "--memory-every", "1", "--persist-every", "1000"]


# ---- pure parts --------------------------------------------------------------------------------------


def test_train_command_is_torchruns_form_with_an_absolute_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert localcluster.train_command("train.py --lr 1", cwd=tmp_path) == f"{script} --lr 1"
    assert localcluster.train_command(f"python3 {script} --x 'a b'") == f"{script} --x 'a b'"
    assert localcluster.train_command(f"{sys.executable} -m pkg.train --y") == "-m pkg.train --y"
    for bad in ("", "python", "-m", "--lr 1", "missing.py", "'unclosed"):
        with pytest.raises(localcluster.ClusterError):
            localcluster.train_command(bad, cwd=tmp_path)


def test_up_refuses_training_flags_without_a_command(tmp_path: Path) -> None:
    for flags in (["--nproc-per-node", "2"], ["--job", "j"], ["--min-nodes", "1"], ["--on-no-spare", "wait"],
                  ["--launcher", "torchrun"], ["--max-restarts", "3"], ["--hang-timeout-s", "5"]):
        with pytest.raises(cli.UsageError, match="without --train-cmd"):
            cli.run(["up", "--workdir", str(tmp_path), *flags], {})
    with pytest.raises(cli.UsageError, match="more than the 2 active"):
        cli.run(["up", "--workdir", str(tmp_path), "--train-cmd", str(EXAMPLE), "--min-nodes", "3"], {})
    assert not (tmp_path / "cluster.json").exists()  # refused before anything started


def test_the_example_sizes_and_its_prepare_contract() -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import fsdp2_train as ex

        from ftd.training import warm_worker
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert ex.parse_size("2M") == 2_000_000 and ex.parse_size("38M") == 38_000_000 and ex.parse_size("512") == 512
    assert ex.shape_for(2_000_000) == (256, 4)
    assert ex.shape_for(38_000_000) == (512, 18) and ex.shape_for(152_000_000) == (1024, 18)
    assert 4 * ex.block_params(256) >= 2_000_000 and abs(18 * ex.block_params(512) - 38e6) < 1e6
    assert warm_worker.script_opts_in(EXAMPLE.read_text())  # a standby imports it ahead and runs prepare()
    prepared = ex.prepare(["--out", "/nonexistent", "--params", "300K"])
    assert prepared.model.training and all(p.grad is None for p in prepared.model.parameters())
    assert prepared.data.position == 0 and len(prepared.model.blocks) == 1


# ---- the script on a cluster ---------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running: not gone and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def ftctl(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ftd.ftctl.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    work = tmp_path / "cluster"
    yield work
    with contextlib.suppress(localcluster.ClusterError):
        localcluster.stop(localcluster.ClusterFile.load(work))


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(600)  # a cluster of 6 torch workers and 3 standbys, then the reference run: on 2 cores
def test_ftctl_up_runs_the_fsdp2_example_and_a_killed_node_recovers_exactly(tmp_path: Path, workdir: Path) -> None:
    out = tmp_path / "run"
    # the standbys reserve the snapshot buffers of a rank of the 4-rank world in prepare()
    cmd = " ".join([os.path.relpath(EXAMPLE, ROOT), *JOB_ARGS, "--step-time", "0.25", "--reserve-world", "4",
                    "--out", str(out)])
    up = ftctl("up", "--workdir", str(workdir), "--nodes", "2", "--spares", "1", "--nproc-per-node", "2",
               "--job", "fsdp2", "--train-cmd", cmd, "--start-timeout", "120")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "job fsdp2, 2 rank(s) per node" in up.stdout
    cluster = localcluster.ClusterFile.load(workdir)
    client = cluster.client()
    try:
        def valid_step() -> int:
            return restore_target_step(client, "fsdp2")

        def max_step() -> int:
            return max((r["step"] for r in records(out) if r["event"] == "step"), default=-1)

        wait_for(lambda: max_step() >= 12 and valid_step() >= 8, 240, "training past step 12, held in memory",
                 interval_s=0.2)
        boots = [r for r in records(out) if r["event"] == "boot"]
        assert len(boots) == 4 and all(b["prepared"] for b in boots), boots  # the standbys ran prepare()
        status = client.status()
        # node-0's buddy is node-1 (the next node of the ring, coordinator/buddies.py): the spare must
        # pull node-0's shards from node-1, which its agent does ahead (agent/restore_prefetch.py)
        victim = "node-0"
        assert victim in status.world, status
        agent_pid = next(a.pid for a in cluster.agents if a.name == victim)
        wait_for(lambda: len(descendants(agent_pid)) >= 4, 120, f"{victim}'s workers and its next standbys")
        on_victim = descendants(agent_pid)  # its 2 workers and its 2 standbys for the next round
        drill = ftctl("--workdir", str(workdir), "drill", "--kill-node", victim, "--json", "--target-recover-s",
                      "90", "--drill-timeout", "200")
        result = json.loads(drill.stdout) if drill.stdout.strip().startswith("{") else {}
        assert drill.returncode == 0, drill.stdout + drill.stderr
        # a killed node's processes all die with it, its standbys too (they would compete for the CPU
        # with the new world on this shared box, where a dead machine's cannot)
        wait_for(lambda: not any(alive(p) for p in on_victim), 10, f"every process of {victim} gone")
        wait_for(lambda: sum(1 for r in records(out) if r["event"] == "done") >= 4, 240,
                 f"the job to reach step {STEPS - 1} in the new world", interval_s=0.5)
    finally:
        client.close()

    got = records(out)
    starts = [r for r in got if r["event"] == "start" and r["restored_step"] >= 0]
    assert {s["world"] for s in starts} == {4} and len(starts) == 4, starts  # the new world: 2 nodes x 2 ranks
    assert victim not in {s["node"] for s in starts} and "node-2" in {s["node"] for s in starts}
    restored = {s["restored_step"] for s in starts}
    assert len(restored) == 1, starts
    resumed = restored.pop()
    assert result.get("resumed_step") in (None, resumed), result
    new_pids = {s["pid"] for s in starts}
    before = max(r["step"] for r in got if r["event"] == "step" and r["pid"] not in new_pids)
    assert resumed >= before - 1, f"resumed from step {resumed}, the old world had done step {before}"
    assert all(s["restored_from"].startswith("mem@") for s in starts), [s["restored_from"] for s in starts]
    pulled = [s for s in starts if s["node"] == "node-2"]
    assert len(pulled) == 2 and all(s["restored_from"] == "mem@node-1 (pulled through the agent)" for s in pulled)
    log = (workdir / "logs" / "node-2.log").read_text()
    assert "restore prefetch (node rank" in log, log[-3000:]  # the spare's agent pulled them ahead
    for s in pulled:  # a pull of the step the world resumed from served the worker's own FetchShard
        if f"pulled job fsdp2 step {resumed} rank {s['rank']} from" in log:
            assert f"FetchShard of job fsdp2 step {resumed} rank {s['rank']} from" in log, log[-3000:]
    firsts = {p: min(r["t"] for r in got if r["event"] == "step" and r["pid"] == p) for p in new_pids}
    print(f"\nftctl drill --kill-node {victim}: detected {result.get('detected_s')} s, recovered "
          f"{result.get('recovered_s')} s, resumed step {resumed} (the old world reached step {before})")
    for s in starts:
        print(f"  rank {s['rank']} on {s['node']}: process group {s['pg_s']} s, fully_shard + Adam {s['wrap_s']} s, "
              f"restore {s['restore_s']} s from {s['restored_from']}, buffers {s['buffers_s']} s, first step "
              f"{firsts[s['pid']] - s['t']:.3f} s later")

    reference = fsdp2_reference(tmp_path, JOB_ARGS)
    after = {(r["rank"], r["step"]): (r["loss"], r["params_crc"]) for r in got
             if r["event"] == "step" and r["pid"] in new_pids}
    assert set(after) == {(rank, step) for rank in range(4) for step in range(resumed + 1, STEPS)}
    mismatched = sorted(k for k, v in after.items() if reference[k] != v)
    assert not mismatched, f"{len(mismatched)} (rank, step) differ from the uninterrupted run, first {mismatched[:5]}"
    first = [r for r in got if r["event"] == "step" and r["pid"] not in new_pids]
    assert all(reference[(r["rank"], r["step"])] == (r["loss"], r["params_crc"]) for r in first)
