"""Recovery after a node is killed mid-training, phase by phase: ftd next to plain torchrun (c10d
rendezvous, a standby node), the same training script side by side in one run.

    python bench/recovery.py --trials 5 [--json] [--arms ftd,torchrun_c10d] [--step-time 0.2]
    python bench/recovery.py --workload fsdp --nproc-per-node 2 --params 38M --trials 3 --json

The workloads (:class:`Workload`):

* ``demo`` (the default): ``ftd.training.demo_job``, DDP on gloo, 1 rank per node, a step every 0.2 s,
  a durable checkpoint every 1000 steps in both arms.
* ``fsdp``: ``examples/fsdp2_train.py``, FSDP2 ``fully_shard`` per block and Adam on gloo, ``--params``
  (38 M: 18 blocks of width 512) over ``--nproc-per-node`` ranks per node (2), unpaced. ftd: the
  Checkpointer in DCP format (memory every step, the cadence widening it when snapshots slow the
  step), standbys that ran the script's ``prepare()`` (model built, snapshot buffers reserved for a
  rank of the 4-rank world). torchrun: the same script with ``--no-ftd --plain-dcp``: torch DCP's own
  collective ``save`` every 20 steps into a shared directory and ``load`` of the newest one at start,
  so its restore is a real DCP load. The first kill comes after 40 steps (the cadence has settled),
  the next ones 24 steps after the previous recovery.

The arms, each as it would be deployed:

* ``ftd``: 2 active nodes and a hot spare under ftd's agents with their default launcher (``warm``:
  standby worker processes with torch imported); the job snapshots into the peer-replicated memory tier
  every step and persists every 1000 steps (``--memory-every 1 --persist-every 1000``). The victim is
  killed by ``ftd.ftctl.drill`` (``node`` mode: its agent SIGKILLs its workers, then itself).
* ``torchrun_c10d``: ``torchrun --rdzv-backend=c10d --nnodes=2:2`` on 2 nodes plus a standby, the job's
  own checkpoints (``--plain-ckpt``: every rank ``torch.save``s to a shared directory) every 1000 steps;
  the victim's torchrun is SIGKILLed with its workers. It runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
  with the default shared store the job never resumes after a non-store node dies (measured: see
  docs/training.md), and the first torchrun (the store host) is never the victim.

Per trial, with the kill as time 0 (ftd: the victim agent's own log line, written right after it
SIGKILLed its workers; torchrun: the benchmark's SIGKILL):

* ``recovered_s``: the first training step completed by the new world's workers (the job's log);
* ``detected_s``: the node judged dead (ftd: the coordinator's ``node_dead`` event in its event log;
  torchrun: the first surviving elastic agent's rendezvous drops the node, ``Detected dead node`` in its
  log, a debug line that ``TORCH_LOGS=+torch.distributed.elastic.rendezvous.dynamic_rendezvous`` shows);
* ``lost_steps``: the last step run before the kill minus the step the new world restored;
* ``at_s``: when each phase ended, from the kill: ``detect`` (as above), ``commit`` (ftd: the new epoch
  committed, the coordinator's log; torchrun: every agent of the new world completed the re-formed
  rendezvous round, ``Rendezvous complete for workers`` in its log), ``abort`` (the survivors' old
  workers gone: a 5 ms poll of their pids), ``restart`` (every new worker's entry called: the job's
  ``boot`` record, ``booted``),
  ``process_group`` (``init_process_group`` done and the model wrapped in DDP: the ``start`` record's
  ``ddp_ready``), ``restore`` (the checkpointer set up and ``load_latest`` done: the ``start`` record),
  ``first_step``; ``None`` with a reason in ``notes`` where a moment is not in the logs;
* ``phases_s``: the same as durations, each from the latest earlier moment (0 when it ended before it,
  e.g. an abort that happened before the detection), so they add up to ``recovered_s``.

Before each kill every agent's standby worker is warm again (imported and idle), as it is between two
real incidents; for torchrun the standby's torchrun is back in the rendezvous and training moves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftd.agent.torchrun_supervisor import descendants
from ftd.ftctl import drill
from ftd.ftctl.etcd_server import free_port
from ftd.ftctl.localcluster import ClusterFile, TrainOptions, spawn_agent, stop, up, wait_agent
from ftd.waiting import wait_for

from _common import emit, percentile

STEP_TIME = 0.2  # seconds per step of the demo job: see docs/training.md#measured for 0.05
PERSIST_EVERY = 1000  # durable checkpoints, both arms
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_train.py"
WORKLOADS = ("demo", "fsdp")


@dataclass(frozen=True)
class Workload:
    """The training script both arms run, with its flags. ``demo``: ``ftd.training.demo_job`` (DDP, 1 rank
    per node, paced); ``fsdp``: ``examples/fsdp2_train.py`` (FSDP2 ``fully_shard`` per block, Adam, the
    state as ``get_state_dict`` gives it; ftd: DCP format through the Checkpointer, the standby's
    ``prepare()`` building the model and reserving the snapshot buffers; torchrun: torch DCP's own
    collective ``save``/``load`` to a shared directory every ``baseline_every`` steps, so that its restore
    is a real DCP load)."""

    name: str
    nproc: int = 1
    params: str = "38M"
    step_time: float = STEP_TIME
    baseline_every: int = 20
    warmup_steps: int = 30  # trained before the first kill (fsdp: past torchrun's first DCP checkpoint)
    between_steps: int = 20  # trained again between two kills

    @property
    def job(self) -> str:
        return "demo" if self.name == "demo" else "fsdp2"

    def ftd_cmd(self, out: Path, world: int) -> str:
        if self.name == "demo":
            return (f"-m ftd.training.demo_job --steps 1000000 --memory-every 1 --persist-every {PERSIST_EVERY} "
                    f"--step-time {self.step_time} --out {out}")
        return (f"{EXAMPLE} --params {self.params} --steps 1000000 --memory-every 1 --persist-every {PERSIST_EVERY}"
                f" --reserve-world {world} --step-time {self.step_time} --job {self.job} --out {out}")

    def torchrun_argv(self, out: Path, ckpt: Path) -> list[str]:
        if self.name == "demo":
            return ["-m", "ftd.training.demo_job", "--steps", "1000000", "--ckpt-every", str(PERSIST_EVERY),
                    "--step-time", str(self.step_time), "--out", str(out), "--plain-ckpt", str(ckpt)]
        return [str(EXAMPLE), "--params", self.params, "--steps", "1000000", "--no-ftd", "--plain-dcp", str(ckpt),
                "--persist-every", str(self.baseline_every), "--step-time", str(self.step_time), "--out", str(out)]
PHASES = ("detect", "commit", "abort", "restart", "process_group", "restore", "first_step")
ARMS = ("ftd", "torchrun_c10d")
RDZV_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


# ---- the job's own records ------------------------------------------------------------------------------


def records(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["t"])


def current_step(out: Path, before: float | None = None) -> int:
    """The step of the newest step record (before ``before``): where training is now. Not the largest
    step ever logged: a restart from an older checkpoint runs those steps again."""
    steps = [r for r in records(out) if r["event"] == "step" and (before is None or r["t"] < before)]
    return steps[-1]["step"] if steps else -1


def latest_pids(out: Path, nodes: set[str]) -> list[int]:
    """The worker pids of ``nodes`` in the world that logged the newest step: every local rank's."""
    newest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records(out):
        if r["event"] == "step":
            newest[(r["node"], r.get("rank", 0))] = r
    if not newest:
        return []
    last = max(r["t"] for r in newest.values())
    return sorted({r["pid"] for (node, _), r in newest.items() if node in nodes and r["t"] > last - 30})


def new_world(out: Path, t_kill: float) -> dict[str, Any] | None:
    """The workers that trained after the kill, from their records: when every one's entry was called
    (``boot``: ``booted``), its process group was up and the model wrapped in DDP (``start``:
    ``ddp_ready``), it restored (``start``); the first step; the step restored. ``None`` until a new
    worker completed a step."""
    rows = [r for r in records(out) if r["t"] > t_kill]
    boots = {r["pid"]: r for r in rows if r["event"] == "boot"}
    starts = {r["pid"]: r for r in rows if r["event"] == "start" and r["pid"] in boots}
    steps = [r for r in rows if r["event"] == "step" and r["pid"] in starts]
    if not steps:
        return None
    first = steps[0]
    world = [pid for pid, b in boots.items() if pid in starts and b["world"] == first["world"]
             and b["booted"] <= first["t"]]
    if len(world) < first["world"]:
        return None  # a rank's records are not all there yet
    world = sorted(world, key=lambda p: boots[p]["booted"])[-first["world"]:]
    return {"restart": max(boots[p]["booted"] for p in world),
            "process_group": max(starts[p].get("ddp_ready", boots[p]["t"]) for p in world),
            "restore": max(starts[p]["t"] for p in world), "first_step": first["t"],
            "restored_step": starts[world[0]]["restored_step"], "world": first["world"],
            "restored_from": sorted({starts[p].get("restored_from", "") for p in world})}


# ---- processes and logs -----------------------------------------------------------------------------------


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie not yet reaped by its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class ExitWatch:
    """Notes when each of ``pids`` exits, polling every 5 ms on a thread (started before the kill)."""

    def __init__(self, pids: list[int], timeout_s: float = 120.0) -> None:
        self.pids = list(pids)
        self.exited: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(timeout_s,), daemon=True)
        self._thread.start()

    def _run(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline and len(self.exited) < len(self.pids):
            now = time.time()
            for pid in self.pids:
                if pid not in self.exited and gone(pid):
                    self.exited[pid] = now
            self._stop.wait(0.005)

    def all_exited(self) -> float | None:
        """When the last of the pids exited (``None``: not all did, or none were watched)."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        return max(self.exited.values()) if self.pids and len(self.exited) == len(self.pids) else None


_FTD_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d{3}) ")  # ftd.logs: local time, ms
# torch's glog-style prefix (torch >= 2.4): "I1130 03:28:17.123456 4242 torch/...": local time, no year
_TORCH_LOG_TIME = re.compile(r"^[A-Z](\d\d)(\d\d) (\d\d:\d\d:\d\d)\.(\d{6}) ")


def ftd_log_lines(path: Path, pattern: str, after: float) -> list[tuple[float, str]]:
    """(wall-clock time, line) of the lines of an ftd log matching ``pattern``, at or after ``after``
    (the log has milliseconds, truncated: a line can read up to 1 ms early)."""
    found = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            m = _FTD_LOG_TIME.match(line)
            if m and re.search(pattern, line):
                t = time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + int(m.group(2)) / 1000
                if t >= after - 0.002:
                    found.append((t, line))
    return found


def ftd_log_times(path: Path, pattern: str, after: float) -> list[float]:
    return [t for t, _ in ftd_log_lines(path, pattern, after)]


def torch_log_times(path: Path, pattern: str, after: float) -> list[float]:
    found = []
    year = time.localtime().tm_year
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            m = _TORCH_LOG_TIME.match(line)
            if m and re.search(pattern, line):
                stamp = f"{year}-{m.group(1)}-{m.group(2)}T{m.group(3)}"
                t = time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")) + int(m.group(4)) / 1e6
                if t >= after:
                    found.append(t)
    return found


def phases_of(at: dict[str, float | None]) -> dict[str, float | None]:
    """Durations: each phase from the latest earlier moment known (0 if it ended before it)."""
    out: dict[str, float | None] = {}
    done = 0.0
    for name in PHASES:
        t = at.get(name)
        if t is None:
            out[name] = None
            continue
        out[name] = round(max(0.0, t - done), 3)
        done = max(done, t)
    return out


def trial_result(t_kill: float, last_step: int, marks: dict[str, Any] | None, at: dict[str, float | None],
                 notes: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    if marks is None:
        return {"detected_s": None, "recovered_s": None, "lost_steps": None, "note": "did not resume in time", **extra}
    for name in ("restart", "process_group", "restore", "first_step"):
        at[name] = marks[name]
    rel = {k: (round(v - t_kill, 3) if v is not None else None) for k, v in at.items()}
    rel = {name: rel.get(name) for name in PHASES}
    return {"detected_s": rel["detect"], "recovered_s": rel["first_step"],
            "lost_steps": last_step - marks["restored_step"], "last_step": last_step,
            "restored_step": marks["restored_step"], "restored_from": marks["restored_from"],
            "at_s": rel, "phases_s": phases_of(rel), "notes": notes, **extra}


# ---- ftd ------------------------------------------------------------------------------------------------


def standbys_warm(cluster: ClusterFile) -> bool:
    """Every agent holds a standby worker that finished importing: a ``warm_worker`` process that used
    no CPU for 0.3 s (an importing standby burns CPU; a running worker steps every 50 ms)."""
    from _common import cpu_seconds

    def standbys(agent_pid: int) -> list[int]:
        out = []
        for pid in descendants(agent_pid):
            with contextlib.suppress(OSError):
                if b"ftd.training.warm_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
        return out

    per_agent = {a.name: standbys(a.pid) for a in cluster.agents}
    before = {pid: cpu_seconds(pid) for pids in per_agent.values() for pid in pids}
    time.sleep(0.3)
    idle = set()
    for pid, cpu in before.items():
        with contextlib.suppress(OSError):
            if cpu_seconds(pid) == cpu:
                idle.add(pid)
    return all(any(p in idle for p in pids) for pids in per_agent.values())


def ftd_trials(work: Path, trials: int, load: Workload) -> list[dict[str, Any]]:
    out = work / "run"
    train = TrainOptions(cmd=load.ftd_cmd(out, 2 * load.nproc), job=load.job, nproc_per_node=load.nproc)
    assert train.launcher == "warm"
    cluster = up(work / "cluster", 2, 1, train=train)
    logs = Path(cluster.workdir) / "logs"
    client = cluster.client()
    results = []
    try:
        wait_for(lambda: current_step(out) >= load.warmup_steps, 300, "ftd training")
        for i in range(trials):
            wait_for(lambda: standbys_warm(cluster), 120, "every agent's standby worker warm")
            world = list(client.status().world)
            victim = world[i % len(world)]
            survivors = set(world) - {victim}
            watch = ExitWatch(latest_pids(out, survivors))
            before_call = time.time()
            r = drill.run(client, victim, cluster.drill_token, "node", timeout_s=120)
            t_kill = min(ftd_log_times(logs / f"{victim}.log", rf"drill: killing node {victim} now", before_call),
                         default=before_call)
            marks = None
            with contextlib.suppress(AssertionError):
                marks = wait_for(lambda t=t_kill: new_world(out, t), 60, "the new world's first step", interval_s=0.1)
            aborted = watch.all_exited()
            dead = [e.at_unix_s for e in client.events(limit=100).events
                    if e.kind == "node_dead" and e.node_id == victim and e.at_unix_s >= t_kill - 0.01]
            committed = ftd_log_times(logs / "coordinator-0.log", rf"epoch {r.epoch_after} committed", t_kill)
            at = {"detect": min(dead, default=None), "commit": min(committed, default=None), "abort": aborted}
            pushed = [t for node in sorted(survivors) for t in ftd_log_times(logs / f"{node}.log", "aborted workers",
                                                                             t_kill)]
            if aborted is not None and at["commit"] is not None and aborted < at["commit"]:
                notes = {"abort": "the survivors' workers exited by themselves before the commit (gloo: connection "
                                  "closed by the dead peer)"}
            else:
                notes = {"abort": "the survivors' workers were SIGKILLed by their agents on the new epoch (push-abort)"
                         if pushed else "the survivors' workers exited after the commit"}
            last_step = current_step(out, before=t_kill)
            results.append(trial_result(t_kill, last_step, marks, at, notes, {
                "victim": victim, "verdict": r.verdict,
                "drill": {"detected_s": r.detected_s, "committed_s": r.committed_s, "recovered_s": r.recovered_s,
                          "lost_steps": r.lost_steps}}))
            proc, _, _ = spawn_agent(cluster, victim, "spare", extra_args=train.agent_args(2))
            wait_agent(cluster, victim, proc)
            wait_for(lambda v=victim: v in client.status().spares, 60, "the victim back as a spare")
            before = current_step(out)
            wait_for(lambda b=before: current_step(out) >= b + load.between_steps, 240, "training moving again")
    finally:
        client.close()
        stop(cluster)
    return results


# ---- torchrun -------------------------------------------------------------------------------------------


def torchrun_trials(work: Path, trials: int, load: Workload) -> list[dict[str, Any]]:
    out, ckpt = work / "run", work / "ckpt"
    port = free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(node: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=baseline", "--nnodes=2:2",
                f"--nproc-per-node={load.nproc}", "--max-restarts=100", "--monitor-interval=0.1",
                "--local-addr=127.0.0.1", *load.torchrun_argv(out, ckpt)]
        # TORCH_LOGS: torch's rendezvous logs (debug) when it drops a dead node, its agent (info) when a
        # round is complete; logging only, nothing else changes
        env = {**os.environ, "FTD_NODE_ID": node, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1",
               "TORCH_LOGS": f"+{RDZV_LOGGER},{AGENT_LOGGER}"}
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
        wait_for(lambda: current_step(out) >= load.warmup_steps, 300, "torchrun training")
        for _ in range(trials):
            latest = {r["node"]: r for r in records(out) if r["event"] == "step"}
            victim = max((n for n in latest if n != "node-0"), key=lambda n: latest[n]["t"])
            survivors = {n for n, r in latest.items() if n != victim and r["t"] > time.time() - 5}
            watch = ExitWatch(latest_pids(out, survivors))
            t_kill = time.time()
            kill_tree(procs[victim].pid)
            procs[victim].wait(timeout=10)
            marks = None
            with contextlib.suppress(AssertionError):
                marks = wait_for(lambda t=t_kill: new_world(out, t), 120, "torchrun to resume", interval_s=0.1)
            aborted = watch.all_exited()
            # torch's elastic agents log when their rendezvous drops the dead node (its keep-alive expired)
            # and when the new round is complete (the membership agreed: torchrun's commit)
            others = sorted(set(procs) - {victim})
            dropped = [t for n in others
                       for t in torch_log_times(work / f"{n}.log", r"Detected dead node", t_kill)]
            formed = [min(torch_log_times(work / f"{n}.log", r"Rendezvous complete for workers", t_kill), default=None)
                      for n in others]
            notes = {"detect": "the first surviving torchrun's rendezvous drops the dead node (keep-alive expired)",
                     "commit": "every torchrun of the new world has completed the re-formed rendezvous round",
                     "abort": "the survivors' workers exit by themselves (gloo: connection closed by the dead peer)"}
            at = {"detect": min(dropped, default=None),
                  "commit": max(formed) if formed and None not in formed else None, "abort": aborted}
            for name in ("detect", "commit"):
                if at[name] is None:
                    notes[name] = "not in torchrun's log: " + notes[name]
            last_step = current_step(out, before=t_kill)
            results.append(trial_result(t_kill, last_step, marks, at, notes, {"victim": victim}))
            if marks is None:
                break
            start(victim)  # back as the standby for the next trial
            before = current_step(out)
            wait_for(lambda b=before: current_step(out) >= b + load.between_steps, 240,
                     "torchrun training moving again")
    finally:
        for p in procs.values():
            kill_tree(p.pid)
    return results


# ---- summary --------------------------------------------------------------------------------------------


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    def values(key: str) -> list[float]:
        return [r[key] for r in results if r.get(key) is not None]

    out: dict[str, Any] = {
        "trials": len(results), "recovered": len(values("recovered_s")),
        "p50_recovered_s": percentile(values("recovered_s"), 50),
        "p90_recovered_s": percentile(values("recovered_s"), 90),
        "p50_detected_s": percentile(values("detected_s"), 50),
        "p90_detected_s": percentile(values("detected_s"), 90),
        "p50_lost_steps": percentile(values("lost_steps"), 50),
        "max_lost_steps": max(values("lost_steps"), default=None),
    }
    for key in ("phases_s", "at_s"):
        per = [r[key] for r in results if r.get(key)]
        medians = {}
        for name in PHASES:
            got = [p[name] for p in per if p.get(name) is not None]
            medians[name] = round(statistics.median(got), 3) if got else None
        out[f"p50_{key}"] = medians
    notes: dict[str, dict[str, int]] = {}
    for r in results:
        for key, text in r.get("notes", {}).items():
            notes.setdefault(key, {}).setdefault(text, 0)
            notes[key][text] += 1
    out["notes"] = {key: "; ".join(text if len(seen) == 1 else f"{text} ({n} of {len(results)})"
                                   for text, n in seen.items()) for key, seen in notes.items()}
    out["runs"] = results
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workload", choices=WORKLOADS, default="demo",
                    help="demo: the DDP demo job, 1 rank per node; fsdp: examples/fsdp2_train.py (FSDP2, DCP)")
    ap.add_argument("--nproc-per-node", type=int, default=0, help="ranks per node (default: demo 1, fsdp 2)")
    ap.add_argument("--params", default="38M", help="fsdp: the model's size (e.g. 2M, 38M)")
    ap.add_argument("--step-time", type=float, default=None,
                    help="pace: at least this many seconds per step, both arms (default: demo 0.2, fsdp 0 = unpaced)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms takes {', '.join(ARMS)}")
    demo = args.workload == "demo"
    load = Workload(args.workload, nproc=args.nproc_per_node or (1 if demo else 2), params=args.params,
                    step_time=args.step_time if args.step_time is not None else (STEP_TIME if demo else 0.0),
                    warmup_steps=30 if demo else 40, between_steps=20 if demo else 24)
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-recovery-"))
    runners = {"ftd": ftd_trials, "torchrun_c10d": torchrun_trials}
    result: dict[str, Any] = {name: summary(runners[name](work / name, args.trials, load)) for name in arms}
    ftd, base = result.get("ftd"), result.get("torchrun_c10d")
    if ftd and base and ftd["p50_recovered_s"] and base["p50_recovered_s"]:
        result["ftd_over_torchrun_p50_recovered"] = round(ftd["p50_recovered_s"] / base["p50_recovered_s"], 3)
    baseline_ckpt = (f"--plain-ckpt every {PERSIST_EVERY} steps" if demo
                     else f"torch DCP save every {load.baseline_every} steps (--plain-dcp)")
    result["setup"] = {"workload": load.name, "nproc_per_node": load.nproc,
                       "params": None if demo else load.params, "step_time_s": load.step_time,
                       "durable_every_steps": PERSIST_EVERY, "trials": args.trials,
                       "ftd": f"warm launcher, --memory-every 1 --persist-every {PERSIST_EVERY}"
                              + ("" if demo else f", prepare() with --reserve-world {2 * load.nproc}"),
                       "torchrun_c10d": f"{baseline_ckpt}, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                       "workdir": str(work)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in arms:
            print(f"== {name}")
            emit({k: v for k, v in result[name].items() if k not in ("runs", "notes")}, False)
        if "ftd_over_torchrun_p50_recovered" in result:
            print(f"ftd / torchrun p50 recovered: {result['ftd_over_torchrun_p50_recovered']}")


if __name__ == "__main__":
    main()
