"""Recovery after a node is killed mid-training: ftd next to plain torchrun (c10d rendezvous, a standby
node), the same training script (ftd.training.demo_job: DDP on gloo, a checkpoint every 10 steps),
side by side in one run.

    python bench/recovery.py --trials 5 [--json]

Per trial a node holding a rank is SIGKILLed with its workers. Figures (from the workers' own
per-step records and, for ftd, the drill's timeline):

* ``detected_s``: ftd — the coordinator declares the node dead; torchrun — the re-formed round's
  workers boot (torchrun only notices a dead node when its keep-alive expires);
* ``recovered_s``: kill → the first training step completed in the new world;
* ``lost_steps``: the last step before the kill minus the step the new world restored.

Where ftd's seconds go, per trial: detection, the epoch commit and push-abort, the rendezvous (until
the new workers start), worker start + process group + restore, the first step.
torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the default shared store the job
never resumes after a non-store node dies (measured: see docs/architecture.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftd.agent.training import descendants
from ftd.ftctl import drill
from ftd.ftctl.etcd_server import free_port
from ftd.ftctl.localcluster import TrainOptions, spawn_agent, stop, up, wait_agent
from ftd.testing import wait_for

from _common import emit, percentile

STEP_TIME = 0.05


def records(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["t"])


def max_step(out: Path) -> int:
    return max((r["step"] for r in records(out) if r["event"] == "step"), default=-1)


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def after_kill(out: Path, kill_wall: float) -> dict[str, float | int | None]:
    """From the workers' records: the new world's boot, start (restored), first step."""
    rows = [r for r in records(out) if r["t"] > kill_wall]
    boots = [r for r in rows if r["event"] == "boot"]
    starts = [r for r in rows if r["event"] == "start"]
    new_pids = {r["pid"] for r in starts}
    steps = [r for r in rows if r["event"] == "step" and r["pid"] in new_pids]
    return {
        "boot": min((r["booted"] for r in boots), default=None),
        "start": min((r["t"] for r in starts), default=None),
        "first_step": min((r["t"] for r in steps), default=None),
        "restored": starts[0]["restored_step"] if starts else None,
    }


def ftd_trials(work: Path, trials: int) -> list[dict[str, Any]]:
    out = work / "run"
    train = TrainOptions(cmd=f"-m ftd.training.demo_job --steps 1000000 --ckpt-every 10 --step-time {STEP_TIME} "
                             f"--out {out}", job="demo")
    cluster = up(work / "cluster", 2, 1, train=train)
    from ftd.coordinator.client import CoordinatorClient

    client = CoordinatorClient(cluster.coordinator_endpoints)
    results = []
    try:
        wait_for(lambda: max_step(out) >= 30, 120, "ftd training")
        for i in range(trials):
            victim = list(client.status().world)[i % 2]
            last_step = max_step(out)
            kill_wall = time.time()
            r = drill.run(client, victim, cluster.drill_token, "node", timeout_s=120)
            marks = after_kill(out, kill_wall)
            phases = {}
            if marks["boot"] and marks["start"] and marks["first_step"] and r.committed_s is not None:
                t_boot = marks["boot"] - kill_wall
                t_start = marks["start"] - kill_wall
                phases = {"detect": r.detected_s, "commit_and_abort": r.committed_s - (r.detected_s or 0),
                          "rendezvous_to_worker_start": t_boot - r.committed_s,
                          "init_and_restore": t_start - t_boot, "first_step": marks["first_step"] - marks["start"]}
            lost = last_step - marks["restored"] if marks["restored"] is not None else None  # as for torchrun
            results.append({"detected_s": r.detected_s, "recovered_s": r.recovered_s, "lost_steps": lost,
                            "phases": phases, "verdict": r.verdict})
            proc, _, _ = spawn_agent(cluster, victim, "spare", extra_args=train.agent_args(2))
            wait_agent(cluster, victim, proc)
            wait_for(lambda v=victim: v in client.status().spares, 60, "the victim back as a spare")
            before = max_step(out)
            wait_for(lambda b=before: max_step(out) >= b + 20, 120, "training moving again")
    finally:
        client.close()
        stop(cluster)
    return results


def torchrun_trials(work: Path, trials: int) -> list[dict[str, Any]]:
    out, ckpt = work / "run", work / "ckpt"
    port = free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(node: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=baseline", "--nnodes=2:2", "--nproc-per-node=1",
                "--max-restarts=100", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                "-m", "ftd.training.demo_job", "--steps", "1000000", "--ckpt-every", "10", "--step-time",
                str(STEP_TIME), "--out", str(out), "--plain-ckpt", str(ckpt)]
        env = {**os.environ, "FTD_NODE_ID": node, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
        with open(work / f"{node}.log", "ab") as log:
            procs[node] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    work.mkdir(parents=True, exist_ok=True)
    start("node-0")  # the first torchrun hosts the c10d store: never the victim (it would end the job)
    time.sleep(1.0)  # the store host must bind first; the others retry their connection anyway
    start("node-1")
    start("node-2")  # the standby (torch >= 2.3 keeps it in the redundancy list)
    results = []
    try:
        wait_for(lambda: max_step(out) >= 30, 180, "torchrun training")
        for _ in range(trials):
            latest = {r["node"]: r for r in records(out) if r["event"] == "step"}
            victim = max((n for n in latest if n != "node-0"), key=lambda n: latest[n]["t"])
            last_step = max_step(out)
            kill_wall = time.time()
            kill_tree(procs[victim].pid)
            procs[victim].wait(timeout=10)

            def recovered(kw: float = kill_wall) -> Any:
                m = after_kill(out, kw)
                return m if m["first_step"] else None

            try:
                marks = wait_for(recovered, 120, "torchrun to resume", interval_s=0.1)
                results.append({
                    "detected_s": marks["boot"] - kill_wall if marks["boot"] else None,
                    "recovered_s": marks["first_step"] - kill_wall,
                    "lost_steps": last_step - marks["restored"] if marks["restored"] is not None else None})
            except AssertionError:
                results.append({"detected_s": None, "recovered_s": None, "lost_steps": None,
                                "note": "did not resume within 120 s"})
                break
            start(victim)  # back as the standby for the next trial
            before = max_step(out)
            wait_for(lambda b=before: max_step(out) >= b + 20, 120, "torchrun training moving again")
    finally:
        for p in procs.values():
            kill_tree(p.pid)
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    def values(key: str) -> list[float]:
        return [r[key] for r in results if r.get(key) is not None]

    out: dict[str, Any] = {
        "trials": len(results), "recovered": len(values("recovered_s")),
        "p50_recovered_s": percentile(values("recovered_s"), 50),
        "p90_recovered_s": percentile(values("recovered_s"), 90),
        "p50_detected_s": percentile(values("detected_s"), 50),
        "p50_lost_steps": percentile(values("lost_steps"), 50),
    }
    phases = [r["phases"] for r in results if r.get("phases")]
    if phases:
        out["p50_phases_s"] = {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]}
    out["runs"] = results
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-recovery-"))
    result = {"ftd": summary(ftd_trials(work / "ftd", args.trials)),
              "torchrun_c10d": summary(torchrun_trials(work / "torchrun", args.trials))}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, s in result.items():
            print(f"== {name}")
            emit({k: v for k, v in s.items() if k != "runs"}, False)


if __name__ == "__main__":
    main()
