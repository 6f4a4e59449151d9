"""``ftctl demo --nan``: a bad step rolled back, on a real local cluster.

The demo job's failpoint makes one rank's loss NaN at a step past the warm-up (once: a transient
fault, as a flipped bit or a bad batch would be); DDP spreads it to every rank at the next
all-reduce, and from there every checkpoint would hold a poisoned model. The coordinator runs with
``anomaly_action=rollback``: the agents report the anomaly, the leader holds the commits from the
bad step on, marks the ones already made suspect, and rolls the job back to the newest checkpoint
saved before it in a new round of the same nodes (no restart counted). The timeline shows each of
those steps with what was decided and why; ``passed`` means the ranks restored a step before the
NaN, the rerun went past it with finite losses, and nothing after it was offered.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ftd.v1 import cluster_pb2, coordinator_pb2
from ftd.waiting import Timeout, wait_for

from . import localcluster
from .json_shapes import status_dict

NAN_RANK = 1


def run(workdir: Path | None, nodes: int = 2, keep: bool = False, say: Any = print, warmup_steps: int = 30,
        timeout_s: float = 150.0, isolate: bool = False, shared_hdd: bool = True) -> dict[str, Any]:
    """Returns ``{"mode": "nan", "passed", "nan_step", "restored_steps", "decisions", "suspect_steps",
    "restarts", "round", "timeline", "workdir"}``."""
    temp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ftd-demo-")) if workdir is None else workdir.resolve()
    started = time.monotonic()
    timeline: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - started, 2), what))
        say(f"[{timeline[-1][0]:7.2f}s] {what}")

    out = work / "training"
    nan_at = warmup_steps + 30
    train = localcluster.TrainOptions(
        cmd=f"-m ftd.training.demo_job --steps 100000 --memory-every 1 --persist-every 10 --step-time 0.05 "
            f"--out {out} --nan-at {nan_at} --nan-rank {NAN_RANK}", job="demo", min_nodes=nodes)
    mark(f"starting etcd, a coordinator (anomaly_action=rollback) and {nodes} agents in {work}")
    cluster = localcluster.up(work / "cluster", nodes, 0, train=train, shared_hdd=shared_hdd, isolate=isolate,
                              extra_coordinator_args=["--anomaly-action", "rollback"])
    client = cluster.client()
    passed, decided, restored, suspect = False, [], [], []
    info = coordinator_pb2.RoundInfo()
    try:
        mark(f"training a small MLP with DDP on gloo; rank {NAN_RANK}'s loss turns NaN at step {nan_at} (a "
             "failpoint, once)")

        def fired() -> dict[str, Any] | None:
            return next((r for r in records_of(out) if r.get("event") == "nan_injected"), None)

        injected = wait_for(fired, timeout_s, f"the NaN at step {nan_at}", interval_s=0.2)
        fired_at = float(injected["t"])
        mark(f"step {nan_at}: rank {NAN_RANK}'s loss is NaN; the next all-reduce spreads it to every rank")

        def rollback() -> list[cluster_pb2.Event] | None:
            events = client.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=500), idempotent=True).events
            got = [e for e in events if e.kind.startswith("rollback")]
            kinds = ("step_anomaly", "rollback", "rollback_budget_spent")
            return sorted((e for e in events if e.kind in kinds), key=lambda e: e.seq) if got else None

        events = wait_for(rollback, timeout_s, "the coordinator's rollback", interval_s=0.3)
        for e in events:
            late = e.at_unix_s - fired_at
            decided.append(f"{e.kind}: {e.message}")
            mark(f"  +{late:.2f}s {e.kind}: {e.message}")

        def rerun() -> list[dict[str, Any]] | None:
            rows = records_of(out)
            starts = [r for r in rows if r.get("event") == "start" and float(r["t"]) > fired_at]
            if len({r["rank"] for r in starts}) < nodes:
                return None
            since = max(float(r["t"]) for r in starts)
            past = [r for r in rows if r.get("event") == "step" and float(r["t"]) > since and int(r["step"]) > nan_at]
            return starts + past if len(past) >= 5 * nodes else None

        got = wait_for(rerun, timeout_s, f"the rerun past step {nan_at}", interval_s=0.3)
        starts = [r for r in got if r.get("event") == "start"]
        past = [r for r in got if r.get("event") == "step"]
        restored = sorted({int(r["restored_step"]) for r in starts})
        mark(f"  +{max(float(r['t']) for r in starts) - fired_at:.2f}s every rank restarted from step(s) {restored} "
             f"({', '.join(sorted({str(r['restored_from']) for r in starts}))})")
        clean = all(math.isfinite(float(r["loss"])) for r in past)
        mark(f"the rerun passed step {nan_at}: {len(past)} steps, every loss {'finite' if clean else 'NOT finite'}")
        info = client.call("GetRound", coordinator_pb2.GetRoundRequest(job="demo"), idempotent=True)
        suspect = sorted({int(step) for d in decided if d.startswith("rollback:") for step in _steps_in(d)})
        mark(f"job round {info.round}: {info.restarts} restart(s) counted (a rollback is not a restart)")
        passed = bool(restored) and all(0 <= s < nan_at for s in restored) and clean and info.restarts == 0 \
            and sum(d.startswith("rollback:") for d in decided) == 1
        mark(f"verdict: {'pass' if passed else 'FAIL'}: rolled back to {restored} before the NaN at {nan_at}")
        return {"mode": "nan", "passed": passed, "nan_step": nan_at, "restored_steps": restored,
                "decisions": decided, "suspect_steps": suspect, "restarts": info.restarts,
                "round": info.round, "status_after": status_dict(client.status()), "timeline": timeline,
                "workdir": str(work)}
    except Timeout as exc:
        mark(f"verdict: FAIL: {exc}")
        return {"mode": "nan", "passed": False, "nan_step": nan_at, "restored_steps": restored,
                "decisions": decided, "suspect_steps": suspect, "restarts": info.restarts, "round": info.round,
                "timeline": timeline, "workdir": str(work), "error": str(exc)}
    finally:
        client.close()
        if not keep:
            localcluster.stop(cluster)
            mark("cluster stopped")
            if temp:
                shutil.rmtree(work, ignore_errors=True)


def _steps_in(decision: str) -> list[int]:
    """The suspect steps a rollback event names ("... steps [70, 72] suspect")."""
    try:
        listed = decision.rsplit("steps [", 1)[1].split("]", 1)[0]
    except IndexError:
        return []
    return [int(s) for s in listed.split(",") if s.strip().isdigit()]


def records_of(out: Path) -> list[dict[str, Any]]:
    """Every line of the demo job's logs (every rank, every incarnation); a line being written is skipped."""
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


__all__ = ["records_of", "run"]
