"""``ftctl demo``: the README's main command, end to end on this machine.

Starts a local cluster on the embedded default (etcd started for you; each node's SSD tier and a
shared HDD tier as local directories; S3 only with ``--s3-endpoint`` or ``--s3``: moto), trains a small real model with
DDP on gloo with the ftd rendezvous on the warm path (standby workers with torch imported, started by
the agents; 2 active nodes and a hot spare), snapshots the job into the peer-replicated memory tier
every step and persists a durable checkpoint every 1000 steps (the save cadence of a real job), kills
an active node for real, waits for the spare to take its rank and the training to resume from the
newest restorable step (at most one step lost), prints the timeline, and tears everything down.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ftd.v1 import checkpoint_pb2, coordinator_pb2
from ftd.waiting import wait_for

from . import drill, localcluster, preempt_drill
from .json_shapes import status_dict
from .throttle import CpuThrottle

SLOW_SHARE = 0.2
# The coordinator's straggler watch for a demo: replace a straggler, judged on 30 s windows (the
# defaults, 60 s and 10 s of evidence, are for real jobs). The window bounds the samples' age only: a
# judgement needs 5 steps in it, and a throttled node on a loaded two-core box can take seconds a step.
STRAGGLER_DEMO_ARGS = ["--straggler-action", "replace", "--straggler-window-s", "30", "--straggler-min-evidence-s",
                       "4", "--straggler-warmup-s", "20", "--straggler-min-replace-interval-s", "60"]


def run_demo(workdir: Path | None, nodes: int = 2, spares: int = 1, keep: bool = False, say: Any = print,
             steps: int = 100000, memory_every: int = 1, persist_every: int = 1000, warmup_steps: int = 30,
             s3_endpoint: str = "",
             timeout_s: float = 150.0, preempt: bool = False, isolate: bool = False,
             shared_hdd: bool = True, s3: bool = False, straggler: bool = False) -> dict[str, Any]:
    """Returns ``{"mode", "passed", "lost_steps", "drill", "checkpoints", "status_before",
    "status_after", "timeline", "workdir"}``; ``lost_steps`` and the drill's ``resumed_step`` are what
    the new world restored (never negative), not what the catalog offered. With ``preempt`` the
    victim gets a spot preemption notice instead of a SIGKILL: a planned hand-over after a final
    checkpoint. With ``straggler`` the victim is made slow instead (its training processes held to
    a fifth of a CPU, its heartbeats still green): the coordinator's straggler watch (replace policy,
    short windows for a demo) finds it and hands its rank over to the spare through the same planned
    hand-over, and the decisions and their reasons go into the timeline. ``isolate``: in the network lab
    that ``ftctl demo --isolate`` made under ``workdir/cluster`` (this runs in its ctl namespace)."""
    temp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ftd-demo-")) if workdir is None else workdir.resolve()
    started = time.monotonic()
    timeline: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - started, 2), what))
        say(f"[{timeline[-1][0]:7.2f}s] {what}")

    out = work / "training"
    # A straggler shows in compute: the demo's steps then do GPU-like work (about 30 ms on one core).
    pace = "--step-time 0.02 --work 60" if straggler else "--step-time 0.05"
    train = localcluster.TrainOptions(
        cmd=f"-m ftd.training.demo_job --steps {steps} --memory-every {memory_every} --persist-every {persist_every} "
            f"{pace} --out {out}",
        job="demo", min_nodes=nodes)
    mark(f"starting etcd, a coordinator and {nodes} active + {spares} spare agents in {work}")
    cluster = localcluster.up(work / "cluster", nodes, spares, s3_endpoint=s3_endpoint, train=train,
                              shared_hdd=shared_hdd, isolate=isolate, s3=s3,
                              extra_coordinator_args=STRAGGLER_DEMO_ARGS if straggler else None)
    throttle: CpuThrottle | None = None
    decided: list[str] = []
    client = cluster.client()
    try:
        before = status_dict(client.status())
        mark(f"cluster formed: epoch {before['epoch']}, world {before['world']}, hot spare(s) {before['spares']}")
        mark("training a small MLP with DDP on gloo: the agents activate standby workers (torch already "
             "imported) through the ftd rendezvous ...")

        def progress() -> int:
            steps_seen = [n.progress.step for n in client.nodes().nodes if n.HasField("progress")]
            return max(steps_seen, default=-1)

        def valid_step() -> int:
            target = client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job="demo"),
                                 idempotent=True)
            return target.checkpoint.step if target.found else -1

        # Memory snapshots count as restorable (the catalog's restore target): wait for a recent one.
        wait_for(lambda: progress() >= warmup_steps and valid_step() >= warmup_steps - memory_every, timeout_s,
                 f"training past step {warmup_steps} with a restorable checkpoint", interval_s=0.2)
        before = status_dict(client.status())
        victim = before["world"][-1]
        if straggler:
            throttle = CpuThrottle(worker_pids(out, victim), SLOW_SHARE)

            def slow_down() -> str:
                assert throttle is not None
                how = throttle.start()
                return (f"{victim} (rank {len(before['world']) - 1}) made slow: its training processes held to "
                        f"{SLOW_SHARE:.0%} of a CPU ({how}), as a throttled GPU slows them; its agent and "
                        "heartbeats stay healthy")

            mark(f"step {progress()}, newest valid checkpoint at step {valid_step()}; slowing {victim} down")
            seq = _last_event_seq(client)
            result = preempt_drill.run(client, victim, None, job_log=out, timeout_s=timeout_s, start=slow_down,
                                       mode="straggler")
            decided = _decisions(client, seq)
        elif preempt:
            mark(f"step {progress()}, newest valid checkpoint at step {valid_step()}; a spot preemption notice "
                 f"for {victim} (rank {len(before['world']) - 1}): {preempt_drill.NOTICE_S:g}s to go")
            result = preempt_drill.run(client, victim, localcluster.notice_file(cluster, victim), job_log=out,
                                       timeout_s=timeout_s)
        else:
            mark(f"step {progress()}, newest valid checkpoint at step {valid_step()}; killing {victim} "
                 f"(rank {len(before['world']) - 1}) for real: its agent SIGKILLs its workers, then itself")
            result = drill.run(client, victim, mode="node", timeout_s=timeout_s)
        for t, what in result.timeline[1:]:
            mark(f"  +{t:.2f}s {what}")
        for what in decided:
            mark(f"  decided: {what}")
        if result.resumed_step is not None:  # what the new world restored, as its Checkpointer reported
            source = f" ({result.resumed_from})" if result.resumed_from else ""
            mark(f"training resumed from checkpoint step {result.resumed_step}{source} (last step before the "
                 f"{'hand-over' if preempt or straggler else 'kill'} {result.last_step_before}: "
                 f"{result.lost_steps} steps redone)")
        if preempt or straggler:
            mark(f"job restarts counted: {result.restarts_before} before, {result.restarts_after} after")
        mark(f"verdict: {result.verdict}")
        after = status_dict(client.status())
        ckpts = [{"step": c.step, "valid": c.valid, "bytes": c.bytes, "tiers": dict(c.on_tier)}
                 for c in client.checkpoints("demo")]
        valid = [c["step"] for c in ckpts if c["valid"]]
        mark(f"checkpoints: {len(ckpts)} in the catalog, valid steps {valid[-3:]} (last three kept per tier)")
        passed = result.passed and (not straggler or any(d.startswith("straggler_detected") for d in decided))
        return {"mode": result.mode, "passed": passed, "lost_steps": result.lost_steps,
                **({"decisions": decided} if straggler else {}),
                "handover_s": result.handover_s, "drill": result.as_dict(), "checkpoints": ckpts,
                "status_before": before, "status_after": after,
                "timeline": timeline, "workdir": str(work)}
    finally:
        if throttle is not None:
            throttle.stop()
        client.close()
        if not keep:
            localcluster.stop(cluster)
            mark("cluster stopped")
            if temp:
                shutil.rmtree(work, ignore_errors=True)


def _last_event_seq(client: Any) -> int:
    events = client.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=1), idempotent=True).events
    return int(events[0].seq) if events else 0


def _decisions(client: Any, after: int) -> list[str]:
    """What the coordinator decided since event ``after`` and why: the straggler watch's verdicts
    and the drain it asked for."""
    events = client.call("ListEvents", coordinator_pb2.ListEventsRequest(after_seq=after), idempotent=True).events
    kinds = ("straggler_detected", "straggler_cleared", "drain_requested")
    return [f"{e.kind}: {e.message}" for e in events if e.kind in kinds]


def worker_pids(out: Path, node: str) -> list[int]:
    """The pids of ``node``'s current training processes: the newest ``start`` line of each of its
    ranks in the demo job's log, still alive."""
    newest: dict[int, tuple[float, int]] = {}
    for path in out.glob(f"{node}-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if rec.get("event") == "start" and rec.get("node") == node:
                rank = int(rec["rank"])
                if rank not in newest or rec["t"] > newest[rank][0]:
                    newest[rank] = (float(rec["t"]), int(rec["pid"]))
    return [pid for _, pid in newest.values() if Path(f"/proc/{pid}").exists()]
