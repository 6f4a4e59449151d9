"""Goodput under a seeded failure schedule: one job trained for a fixed wall time while failures arrive
with exponential inter-arrival times (a compressed MTTF), ftd next to torchrun c10d, the same schedule
against both in one invocation.

    python bench/goodput.py --minutes 10 --mttf-s 90 --seed 1 --json
    python bench/goodput.py --minutes 3 --mttf-s 45 --seed 2 --kinds node,worker
    python bench/goodput.py --workload fsdp --nproc-per-node 2 --params 38M --minutes 5 --kinds node,worker,preempt

Workloads: ``demo`` (``ftd.training.demo_job``: DDP, one rank per node, a paced 0.2 s step, durable
checkpoints every PERSIST_EVERY steps in both arms, ftd's memory snapshot every step) and ``fsdp``
(``examples/fsdp2_train.py`` as bench/recovery.py runs it: FSDP2 ``fully_shard`` per block with Adam,
``--nproc-per-node`` ranks per node; ftd: DCP format through the Checkpointer, memory snapshot every
step, durable every 1000; torchrun: torch DCP's own ``save`` to a shared directory every
PERSIST_EVERY steps, restored with DCP's ``load``).

Per arm, goodput = (steps kept x the failure-free step time) / wall time, where the steps kept are the
job's step at the end minus its step at the start of the measured window (steps run again after a
restore count once) and the failure-free step time is the arm's own, measured by a failure-free run of
the same arm in the same invocation (``--baseline-s``, both arms: the same job, its own checkpointing),
measured, like the window, once every ftd agent is warm (before that the standbys' ``import torch``
shares the cores: a first version measured a baseline 4 % slow and printed a goodput of 1.01).

The schedule (:func:`schedule`): failure i at ``t_i`` seconds into the window, the gaps drawn from an
exponential distribution of mean ``--mttf-s`` with ``random.Random(seed)``, a kind drawn from
``--kinds`` and a victim rank from the active ranks. A failure is injected at its time, or, when the
arm has not recovered from the previous one yet (or its replacement is not back as a spare), as soon
as it has: ``deferred_s`` says by how much. ftd's replacement is back once warm (registered, its
standby workers' torch imported: ``ftd_agent_standby_workers_ready``; ``spare_warm_s`` per failure),
as a node provisioned ahead of the next failure is on a cluster, where the next failure comes hours
later; torchrun's once its agent started (it has no warm standby). Kinds, as each arm meets them:

* ``node``: the node dies (ftd: ``ftctl drill --kill-node``, the agent SIGKILLs its workers and
  itself; torchrun: SIGKILL of the node's torchrun and its workers). A fresh node then joins as the
  spare / standby.
* ``worker``: one training process is SIGKILLed (ftd: ``drill --kill-worker``; torchrun: the rank's
  worker pid). Both restart the job in a new round on the same nodes.
* ``hang``: the node's training processes are SIGSTOPped (ftd: ``drill --hang-node``, found by the
  agent's hang watchdog, ``--hang-timeout-s``; torchrun: SIGSTOP of its workers, which only gloo's
  collective timeout, 30 minutes by default, would end).
* ``preempt``: a spot preemption notice (ftd: the agent's notice file, ``ftctl drill --preempt``: a
  planned hand-over at a final checkpoint; torchrun has no notice: the node is SIGKILLed at the notice's
  deadline, ``--notice-s`` later).

* ``partition``: the node is cut off from everyone, both ways (nftables on its link in the network
  lab, :mod:`ftd.netlab`: a silent loss, like a cut cable). ftd: declared dead by its missed
  heartbeats, the spare takes the rank; torchrun: its survivors wait in the collective (gloo's
  timeout) and its rendezvous notices nothing. Once the arm recovered (or ``RECOVER_TIMEOUT_S``
  passed) the cut-off node is replaced as after ``node`` (killed, the link healed, a fresh one joins).

With ``partition`` in the mix (the default) every run of both arms happens in a network lab of its
own, each process in its own namespace with its own address (root only, as ``ftctl up --isolate``):
the root half makes the lab, runs the phase inside its ``ctl`` host (this script again, ``--phase``)
and removes the lab after, proving nothing is left behind. Without it, everything runs on loopback.

Not in the mix: slow nodes (a straggler is not a failure of either arm's recovery; the chaos matrix's
``slow-node`` scenario measures ftd's hand-over of one).

Printed per arm: goodput, failures injected and recovered, per kind the mean and p90 of detection,
recovery and lost steps, the cost per failure (recovery + lost steps x step time), steps lost in
total, time with no training (gaps between steps longer than ``GAP_STEPS`` step times, less one step
time each) and whether the job ended healthy (stepping in the last 5 s of the window, every failure
recovered). ftd's own accounting (``GetGoodput``, what ``ftctl goodput`` shows) is printed beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recovery import STEP_TIME, Workload, current_step, kill_tree, new_world, records, torch_log_times

from ftd import netlab
from ftd.agent.torchrun_supervisor import descendants
from ftd.ftctl import drill, isolated, preempt_drill
from ftd.ftctl import goodput as ftd_goodput
from ftd.ftctl.etcd_server import free_port
from ftd.ftctl.localcluster import ClusterFile, TrainOptions, notice_file, spawn_agent, stop, up, wait_agent
from ftd.v1 import coordinator_pb2
from ftd.waiting import Timeout, wait_for

from _common import emit, percentile

KINDS = ("node", "worker", "hang", "preempt", "partition")
ENV_PHASE = "FTD_BENCH_GOODPUT_INSIDE"  # set in the phase re-executed inside a lab's ctl host
TORCHRUN_PORT = 29400  # the c10d store on node-0 (in a lab every host has its own address)
ARMS = ("ftd", "torchrun_c10d")
NODES = 2  # active nodes (ranks), plus one spare / standby
PERSIST_EVERY = 50  # durable checkpoints of both arms, every 10 s of the paced demo job
GAP_STEPS = 5
HANG_TIMEOUT_S = {"demo": 10.0, "fsdp": 60.0}  # ftd's agent hang watchdog (demo: a paced step is 0.2 s)
RECOVER_TIMEOUT_S = 180.0  # per failure; past it the failure counts as not recovered
WARM_TIMEOUT_S = 120.0  # a replacement's standbys importing torch, on a loaded two-core box


@dataclass(frozen=True)
class Failure:
    at_s: float  # into the measured window
    kind: str
    rank: int


def schedule(seed: int, window_s: float, mttf_s: float, kinds: tuple[str, ...], ranks: int) -> list[Failure]:
    """The failures of one run: exponential gaps of mean ``mttf_s`` until ``window_s`` (none in the
    last 30 s: a recovery must fit), each with a kind and a victim rank, from ``random.Random(seed)``.
    The same arguments give the same schedule, for every arm."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mttf_s)
        if t > window_s - 30.0:
            return out
        out.append(Failure(round(t, 3), rng.choice(kinds), rng.randrange(ranks)))


def goodput(kept_steps: int, step_s: float, wall_s: float) -> float | None:
    return kept_steps * step_s / wall_s if wall_s > 0 and step_s > 0 else None


def idle_seconds(times: list[float], step_s: float) -> float:
    """Time with no training: every gap between consecutive step records longer than GAP_STEPS step
    times, less one step time (the step that ended it)."""
    ordered = sorted(times)
    return sum(b - a - step_s for a, b in itertools.pairwise(ordered) if b - a > GAP_STEPS * step_s)


def failure_free_step_s(out: Path, t0: float, t1: float) -> float | None:
    """The mean time per step over [t0, t1] of a failure-free run: the first record of each step."""
    first: dict[int, float] = {}
    for r in records(out):
        if r["event"] == "step" and t0 <= r["t"] <= t1:
            first.setdefault(r["step"], r["t"])
    if len(first) < 2:
        return None
    lo, hi = min(first), max(first)
    return (first[hi] - first[lo]) / (hi - lo)


def by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [r for r in rows if r["kind"] == kind]
        stats: dict[str, Any] = {"injected": len(mine), "recovered": sum(1 for r in mine if r["recovered"])}
        for key in ("detected_s", "recovered_s", "lost_steps", "cost_s"):
            got = [r[key] for r in mine if r.get(key) is not None]
            stats[f"mean_{key}"] = round(statistics.fmean(got), 3) if got else None
            stats[f"p90_{key}"] = percentile(got, 90)
        out[kind] = stats
    return out


def standbys_ready(metrics_address: str) -> int:
    """``ftd_agent_standby_workers_ready`` of one agent, from its /metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=2.0) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("ftd_agent_standby_workers_ready "):
                return int(float(line.split()[1]))
    return 0


# ---- the arms -------------------------------------------------------------------------------------------


class FtdArm:
    name = "ftd"

    def __init__(self, work: Path, load: Workload, lab: netlab.Lab | None = None) -> None:
        self.out = work / "run"
        self.lab, self.load = lab, load
        cmd = (f"-m ftd.training.demo_job --steps 1000000 --memory-every 1 --persist-every {PERSIST_EVERY} "
               f"--step-time {STEP_TIME} --out {self.out}") if load.name == "demo" else \
            load.ftd_cmd(self.out, NODES * load.nproc)
        self.train = TrainOptions(cmd=cmd, job=load.job, nproc_per_node=load.nproc,
                                  hang_timeout_s=HANG_TIMEOUT_S[load.name])
        self.cluster: ClusterFile = up(work / "cluster", NODES, 1, train=self.train, isolate=lab is not None)
        self.client = self.cluster.client()

    def inject(self, f: Failure) -> dict[str, Any]:
        world = list(self.client.status().world)
        victim = world[f.rank % len(world)]
        if f.kind == "preempt":
            r = preempt_drill.run(self.client, victim, notice_file(self.cluster, victim), job_log=self.out,
                                  notice_s=10.0, timeout_s=RECOVER_TIMEOUT_S)
        elif f.kind == "partition":
            assert self.lab is not None, "a partition needs the network lab"
            host = self.lab.hosts[victim]
            r = drill.run(self.client, victim, mode="node", target_detect_s=60.0, target_recover_s=RECOVER_TIMEOUT_S,
                          timeout_s=RECOVER_TIMEOUT_S, inject=lambda: self.lab.partition(host) if self.lab else None)
        else:
            r = drill.run(self.client, victim, self.cluster.drill_token, f.kind, target_detect_s=60.0,
                          target_recover_s=RECOVER_TIMEOUT_S, timeout_s=RECOVER_TIMEOUT_S)
        warm_s = self._replace(victim) if f.kind != "worker" else None
        return {"victim": victim, "detected_s": r.detected_s, "recovered_s": r.recovered_s,
                "lost_steps": r.lost_steps, "recovered": r.recovered_s is not None, "spare_warm_s": warm_s}

    def _replace(self, victim: str) -> float | None:
        """The victim's host is gone (dead, hung and fenced, preempted): a fresh node joins as the
        spare. Returns how long it took to be warm (None: not within WARM_TIMEOUT_S): registered, and
        a standby worker per local rank with torch imported (``ftd_agent_standby_workers_ready``),
        as a replacement provisioned ahead of the next failure is; a failure due before that waits."""
        t0 = time.monotonic()
        agent = next(a for a in self.cluster.agents if a.name == victim)
        for pid in [agent.pid, *descendants(agent.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.lab is not None:
            self.lab.heal(self.lab.hosts[victim])  # the fresh host's link is whole
        notice_file(self.cluster, victim).unlink(missing_ok=True)  # a fresh host has no preemption notice
        # A drained node is refused until an operator admits it again (coordinator/admission.py): the
        # fresh host taking a preempted one's name is, as its operator would (``ftctl admit NODE --spare``).
        self.client.call("Admit", coordinator_pb2.AdmitRequest(node_id=victim, spare=True), idempotent=True)
        proc, _, _ = spawn_agent(self.cluster, victim, "spare", extra_args=self.train.agent_args(NODES))
        metrics = wait_agent(self.cluster, victim, proc).info["metrics"]
        with contextlib.suppress(Timeout):
            wait_for(lambda: standbys_ready(metrics) >= self.load.nproc, WARM_TIMEOUT_S, f"{victim}'s standbys",
                     interval_s=0.2)
            return round(time.monotonic() - t0, 2)
        return None

    def ready(self) -> bool:
        status = self.client.status()
        return len(status.world) == NODES and len(status.spares) >= 1 and not status.job_closed

    def accounting(self) -> dict[str, Any] | None:
        with contextlib.suppress(Exception):
            return ftd_goodput.fetch(self.client, self.load.job)
        return None

    def settled(self) -> bool:
        """Every agent warm (a standby per local rank with torch imported): before that the standbys'
        imports share the cores with the training, and a failure-free step time measured then is slow."""
        return all(standbys_ready(a.info["metrics"]) >= self.load.nproc for a in self.cluster.agents)

    def healthy(self) -> bool:
        status = self.client.status()
        return len(status.world) == NODES and not status.job_closed

    def close(self) -> None:
        self.client.close()
        stop(self.cluster)


class TorchrunArm:
    """``torchrun --rdzv-backend=c10d --nnodes=2:2`` on 2 nodes plus a standby, the job's own
    checkpoints (every rank ``torch.save``s to a shared directory, ``--plain-ckpt``) every
    PERSIST_EVERY steps, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see bench/recovery.py). node-0 hosts
    the c10d store: a victim rank held by node-0 falls to the other node (the store host's death ends
    a torchrun job)."""

    name = "torchrun_c10d"

    def __init__(self, work: Path, load: Workload, lab: netlab.Lab | None = None) -> None:
        self.work, self.out, self.ckpt = work, work / "run", work / "ckpt"
        self.lab, self.load = lab, load
        self.port = TORCHRUN_PORT if lab is not None else free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        work.mkdir(parents=True, exist_ok=True)
        self.start("node-0")
        time.sleep(1.0)  # the store host binds first; the others retry their connection anyway
        self.start("node-1")
        self.start("node-2")

    def _address(self, node: str) -> str:
        return self.lab.hosts[node].address if self.lab is not None else "127.0.0.1"

    def start(self, node: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self._address('node-0')}:{self.port}", "--rdzv-id=goodput",
                f"--nnodes={NODES}:{NODES}", f"--nproc-per-node={self.load.nproc}", "--max-restarts=100",
                "--monitor-interval=0.1",
                f"--local-addr={self._address(node)}",
                # node-0 hosts the store: in a lab its address is not what the machine's host name resolves
                # to, which is how c10d guesses it otherwise
                *([f"--rdzv-conf=is_host={int(node == 'node-0')}"] if self.lab is not None else []),
                *self.load.torchrun_argv(self.out, self.ckpt)]
        env = {**os.environ, "FTD_NODE_ID": node, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1",
               "TORCH_LOGS": "+torch.distributed.elastic.rendezvous.dynamic_rendezvous"}
        if self.lab is not None:  # the node's own namespace; gloo takes its lab interface
            host = self.lab.hosts[node]
            argv = host.wrap(argv)
            env.update({"GLOO_SOCKET_IFNAME": host.iface, "TP_SOCKET_IFNAME": host.iface})
        with open(self.work / f"{node}.log", "ab") as log:
            self.procs[node] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def _latest(self) -> dict[str, dict[str, Any]]:
        newest: dict[str, dict[str, Any]] = {}
        for r in records(self.out):
            if r["event"] == "step" and r["t"] > time.time() - 5:
                newest[r["node"]] = r
        return newest

    def inject(self, f: Failure) -> dict[str, Any]:
        latest = self._latest()
        holders = {r["rank"]: n for n, r in latest.items()}
        victim = holders.get((f.rank % NODES) * self.load.nproc, "")
        if victim in ("node-0", ""):
            victim = next((n for n in sorted(latest) if n != "node-0"), "node-1")
        proc = self.procs[victim]
        last_step = current_step(self.out)
        t_kill = time.time()
        if f.kind == "worker":
            os.kill(latest[victim]["pid"], signal.SIGKILL)
        elif f.kind == "partition":
            assert self.lab is not None, "a partition needs the network lab"
            self.lab.partition(self.lab.hosts[victim])
        elif f.kind == "hang":
            for pid in descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
        else:
            if f.kind == "preempt":
                time.sleep(10.0)  # the notice's deadline: torchrun has no notice to act on
                t_kill = time.time()
                last_step = current_step(self.out)
            kill_tree(proc.pid)
            proc.wait(timeout=10)
        marks = None
        with contextlib.suppress(AssertionError):
            marks = wait_for(lambda: new_world(self.out, t_kill), RECOVER_TIMEOUT_S, "torchrun to resume",
                             interval_s=0.2)
        dropped = [t for n in self.procs if n != victim
                   for t in torch_log_times(self.work / f"{n}.log", r"Detected dead node", t_kill)]
        if f.kind in ("hang", "partition"):  # an operator would find the node eventually; the next failure needs it
            kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            if f.kind == "partition" and self.lab is not None:
                self.lab.heal(self.lab.hosts[victim])  # the survivors' retransmissions now meet a reset
        if f.kind != "worker":
            self.start(victim)  # a fresh node as the standby
        recovered_s = round(marks["first_step"] - t_kill, 3) if marks else None
        return {"victim": victim, "detected_s": round(min(dropped) - t_kill, 3) if dropped else None,
                "recovered_s": recovered_s, "recovered": marks is not None,
                "lost_steps": max(0, last_step - marks["restored_step"]) if marks else None}

    def ready(self) -> bool:
        """Every node up and the job stepping (a failure it has not recovered from by itself, a hang or a
        partition, is not followed by the next one until it trains again)."""
        return all(p.poll() is None for p in self.procs.values()) and current_step(self.out) >= 0 \
            and bool(self._latest())

    def accounting(self) -> dict[str, Any] | None:
        return None

    def settled(self) -> bool:
        return True  # no standby workers: each restart starts its workers cold

    def healthy(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def close(self) -> None:
        for p in self.procs.values():
            kill_tree(p.pid)


# ---- one run --------------------------------------------------------------------------------------------


def run_arm(arm_cls: Any, work: Path, window_s: float, failures: list[Failure], load: Workload,
            warmup_steps: int = 30, lab: netlab.Lab | None = None) -> dict[str, Any]:
    arm = arm_cls(work, load, lab)
    rows: list[dict[str, Any]] = []
    try:
        wait_for(lambda: current_step(arm.out) >= warmup_steps, 300, f"{arm.name} training")
        wait_for(arm.ready, 120, f"{arm.name} ready")
        wait_for(arm.settled, WARM_TIMEOUT_S, f"{arm.name} warm", interval_s=0.5)
        t0 = time.time()
        step0 = current_step(arm.out)
        for f in failures:
            due = t0 + f.at_s
            if time.time() >= t0 + window_s - 20:
                break
            time.sleep(max(0.0, due - time.time()))
            with contextlib.suppress(AssertionError):
                wait_for(arm.ready, max(1.0, t0 + window_s - time.time()), f"{arm.name} ready for the next failure")
            start = time.time()
            if start >= t0 + window_s - 20:
                break
            row = {**asdict(f), "deferred_s": round(start - due, 3), **arm.inject(f)}
            rows.append(row)
        time.sleep(max(0.0, t0 + window_s - time.time()))
        t1 = time.time()
        step1 = current_step(arm.out, before=t1)
        times = [r["t"] for r in records(arm.out) if r["event"] == "step" and t0 <= r["t"] <= t1]
        last = max(times, default=0.0)
        return {"t0": t0, "t1": t1, "steps_kept": step1 - step0, "failures": rows, "step_times": times,
                "healthy": arm.healthy() and last > t1 - 5.0 and all(r["recovered"] for r in rows),
                "ftd_accounting": arm.accounting()}
    finally:
        arm.close()


def baseline(arm_cls: Any, work: Path, seconds: float, load: Workload, lab: netlab.Lab | None = None) -> float | None:
    """The arm's failure-free step time: a run with no failure, past the warm-up."""
    arm = arm_cls(work, load, lab)
    try:
        wait_for(lambda: current_step(arm.out) >= 30, 300, f"{arm.name} training")
        wait_for(arm.settled, WARM_TIMEOUT_S, f"{arm.name} warm", interval_s=0.5)
        t0 = time.time()
        time.sleep(seconds)
        return failure_free_step_s(arm.out, t0, time.time())
    finally:
        arm.close()


def summarize(run: dict[str, Any], step_s: float | None) -> dict[str, Any]:
    rows = run["failures"]
    for r in rows:
        if r.get("recovered_s") is not None and r.get("lost_steps") is not None and step_s:
            r["cost_s"] = round(r["recovered_s"] + r["lost_steps"] * step_s, 3)
    wall = run["t1"] - run["t0"]
    return {
        "goodput": goodput(run["steps_kept"], step_s or 0.0, wall), "wall_s": round(wall, 1),
        "failure_free_step_s": step_s, "steps_kept": run["steps_kept"],
        "failures_injected": len(rows), "failures_recovered": sum(1 for r in rows if r["recovered"]),
        "steps_lost_total": sum(r.get("lost_steps") or 0 for r in rows),
        "no_training_s": round(idle_seconds(run["step_times"], step_s), 1) if step_s else None,
        "healthy_at_end": run["healthy"], "by_kind": by_kind(rows), "failures": rows,
        **({"ftd_accounting": run["ftd_accounting"]} if run["ftd_accounting"] else {}),
    }


CLASSES = {"ftd": FtdArm, "torchrun_c10d": TorchrunArm}


def phase(name: str, arm: str, work: Path, window_s: float, failures: list[Failure], baseline_s: float,
          load: Workload, lab: netlab.Lab | None) -> dict[str, Any]:
    """One phase of one arm, where this process runs (loopback, or inside the lab's ctl host)."""
    if name == "baseline":
        return {"step_s": baseline(CLASSES[arm], work, baseline_s, load, lab)}
    return run_arm(CLASSES[arm], work, window_s, failures, load, lab=lab)


def in_lab(name: str, arm: str, work: Path, argv: list[str], timeout_s: float) -> dict[str, Any]:
    """The root half of a phase: a lab of its own (every etcd, coordinator and node host of the ftd
    cluster; the torchrun arm uses the node hosts), this script again inside its ctl host, the lab
    removed after and proven gone."""
    cluster_dir = work / "cluster"
    iso = isolated.prepare(cluster_dir, isolated.host_names(NODES, 1))
    prefix = iso["prefix"]
    log = work / f"{name}.log"
    try:
        env = {**os.environ, isolated.ENV_INSIDE: iso["ctl"], ENV_PHASE: "1"}
        cmd = isolated.wrap(iso, isolated.CTL, [sys.executable, str(Path(__file__).resolve()), *argv,
                                                "--phase", name, "--arms", arm, "--workdir", str(work)])
        with log.open("ab") as err:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, env=env, timeout=timeout_s)
        lines = proc.stdout.decode(errors="replace").strip().splitlines()
        if proc.returncode != 0 or not lines:
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{arm} {name} in the lab exited {proc.returncode}: {tail}")
        result: dict[str, Any] = json.loads(lines[-1])
    finally:
        isolated.teardown(cluster_dir)
    if left := netlab.leftovers(prefix):
        raise RuntimeError(f"the lab of {arm} {name} left {left} behind")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="the measured window per arm")
    ap.add_argument("--mttf-s", type=float, default=90.0, help="mean time between failures (compressed)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"the mix, of {', '.join(KINDS)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--baseline-s", type=float, default=60.0, help="the failure-free run of each arm")
    ap.add_argument("--workload", choices=("demo", "fsdp"), default="demo")
    ap.add_argument("--nproc-per-node", type=int, default=2, help="fsdp: ranks per node")
    ap.add_argument("--params", default="38M", help="fsdp: the model's size (examples/fsdp2_train.py)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--phase", choices=("baseline", "run"), help=argparse.SUPPRESS)  # inside a lab
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    arms = [a for a in args.arms.split(",") if a]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes {', '.join(KINDS)}")
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms takes {', '.join(ARMS)}")
    window = args.minutes * 60.0
    failures = schedule(args.seed, window, args.mttf_s, kinds, NODES)
    if args.nproc_per_node < 1:
        ap.error("--nproc-per-node must be >= 1")
    load = Workload("demo") if args.workload == "demo" else \
        Workload("fsdp", nproc=args.nproc_per_node, params=args.params, baseline_every=PERSIST_EVERY)
    if args.phase:  # the inside half: one phase in the lab's ctl host, its result as the last line
        if os.environ.get(ENV_PHASE) != "1" or args.workdir is None or len(arms) != 1:
            ap.error("--phase is this script's own, run inside a lab it made")
        lab = netlab.Lab(args.workdir / "cluster" / isolated.LAB_DIR).attach()
        try:
            got = phase(args.phase, arms[0], args.workdir, window, failures, args.baseline_s, load, lab)
        finally:
            lab.close()
        print(json.dumps(got))
        return
    isolate = "partition" in kinds
    if isolate:
        try:
            isolated.check()
        except netlab.MissingPrivileges as exc:
            ap.error(f"partitions run in a network lab: {exc}; or leave them out: --kinds node,worker,hang,preempt")
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-goodput-"))
    passed = [a for a in sys.argv[1:] if a != "--json"]

    def one(name: str, arm: str) -> dict[str, Any]:
        where = work / f"{arm}-{name}" if name == "baseline" else work / arm
        if isolate:
            where.mkdir(parents=True, exist_ok=True)
            return in_lab(name, arm, where, passed, window + args.baseline_s + 900.0)
        return phase(name, arm, where, window, failures, args.baseline_s, load, None)

    result: dict[str, Any] = {"setup": {
        "minutes": args.minutes, "mttf_s": args.mttf_s, "seed": args.seed, "kinds": list(kinds),
        "schedule": [asdict(f) for f in failures],
        "workload": f"ftd.training.demo_job, DDP on gloo, {NODES} nodes x 1 rank + 1 spare/standby, a step every "
        f"{STEP_TIME}s, durable checkpoints every {PERSIST_EVERY} steps" if load.name == "demo" else
        f"examples/fsdp2_train.py --params {load.params}, FSDP2 with Adam on gloo, {NODES} nodes x {load.nproc} "
        "ranks + 1 spare/standby",
        "ftd": f"warm launcher, memory snapshot every step, hang watchdog {HANG_TIMEOUT_S[load.name]:g}s"
        + ("" if load.name == "demo" else ", DCP format, durable every 1000 steps"),
        "torchrun_c10d": ("--plain-ckpt (torch.save per rank to a shared directory)" if load.name == "demo" else
                          f"torch DCP save to a shared directory every {PERSIST_EVERY} steps")
        + ", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "network": "a lab per run: every process in its own network namespace (partitions: nftables)" if isolate
        else "loopback", "workdir": str(work)}}
    for name in arms:
        step_s = one("baseline", name)["step_s"]
        result[name] = summarize(one("run", name), step_s)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in arms:
            print(f"== {name}")
            emit({k: v for k, v in result[name].items() if k not in ("failures", "by_kind", "ftd_accounting")}, False)
            for kind, stats in result[name]["by_kind"].items():
                print(f"   {kind}: {stats}")


if __name__ == "__main__":
    main()
