"""``ftctl drill --preempt NODE`` and ``ftctl demo --preempt``: a spot preemption notice delivered for
real (the node agent's trigger file), and the planned hand-over it starts, measured.

The notice reaches the agent's preemption watcher; the agent asks the coordinator to drain the node;
every rank of the job stops at the same step, saves a final checkpoint and waits; once that step is
valid the coordinator commits the new world (a spare in the node's rank) without charging the job's
restart budget; the job resumes from the final step. The resumed step is what the new world
restored, as its Checkpointer reported it (``Progress.restored``), else as the job's own step log
says (``--out`` of the demo job); lost work is counted from that log's last step when one is given,
else from the progress the agents reported, and is never negative.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd.client import CoordinatorClient
from ftd.v1 import checkpoint_pb2

from .drill import DrillError, DrillResult, _progress, lost_steps, restored_since

NOTICE_S = 30.0  # GCE and Azure give about 30 s, the shortest of the clouds


def write_notice(path: Path, notice_s: float, detail: str) -> None:
    """The trigger file, written to a temporary name and renamed (never seen half written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"kind": "preempt", "in_s": notice_s, "detail": detail}))
    os.replace(tmp, path)


def steps_from_log(out: Path, cut_unix: float) -> tuple[int | None, int | None]:
    """(the last step any rank ran before ``cut_unix``, the step the first round after it restored
    from), read from the demo job's JSON lines."""
    last: int | None = None
    resumed: int | None = None
    first_start = float("inf")
    for path in out.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if rec.get("event") == "step" and rec["t"] < cut_unix:
                last = max(last if last is not None else -1, int(rec["step"]))
            elif rec.get("event") == "start" and rec["t"] >= cut_unix and rec["t"] < first_start:
                first_start, resumed = rec["t"], int(rec["restored_step"])
    return last, resumed


def verdict(committed: bool, replacement: str | None, spares: int, lost: int | None, restarts_same: bool,
            recovered_s: float | None, training: bool) -> tuple[bool, str]:
    """Pass/fail with the reason, from the measurements alone."""
    if not committed:
        return False, "fail: the hand-over was not committed before the drill timed out"
    if spares > 0 and replacement is None:
        return False, "fail: a spare was available but none took the node's rank"
    if training and recovered_s is None:
        return False, "fail: training did not step again in the new world"
    if training and lost is not None and lost > 0:
        return False, f"fail: {lost} step(s) were lost"
    if not restarts_same:
        return False, "fail: the planned hand-over was charged to the job's restart budget"
    detail = f"{replacement} took the rank" if replacement else "no spare: the world shrank"
    if training:
        detail += f"; {lost if lost is not None else '?'} steps lost; the restart budget is untouched"
    return True, f"pass: {detail}"


def run(client: CoordinatorClient, node_id: str, trigger: Path | None, job_log: Path | None = None,
        notice_s: float = NOTICE_S, timeout_s: float = 120.0, start: Callable[[], str] | None = None,
        mode: str = "preempt") -> DrillResult:
    """``trigger``: the node's notice file (a preemption notice is written there). ``start``: another
    way the planned hand-over begins (``ftctl demo --straggler`` throttles the node and the
    coordinator's straggler watch drains it); it returns the first line of the timeline."""
    status = client.status()
    world_before = list(status.world)
    if node_id not in world_before:
        raise DrillError(f"node {node_id} holds no rank; a preemption drill needs an active node")
    rank = world_before.index(node_id)
    epoch_before, spares, round_before = status.epoch, len(status.spares), status.job_round
    job = status.job if status.job and not status.job_closed else ""
    restarts_before = status.job_restarts
    if start is not None:
        first = start()
    else:
        assert trigger is not None, "a preemption drill needs the node's notice file"
        write_notice(trigger, notice_s, "ftctl drill --preempt")
        first = f"preemption notice for {node_id} (rank {rank}): {notice_s:g}s"
    t0, wall0 = time.monotonic(), time.time()
    timeline: list[tuple[float, str]] = [(0.0, first)]

    def mark(what: str) -> float:
        elapsed = round(time.monotonic() - t0, 3)
        timeline.append((elapsed, what))
        return elapsed

    deadline = t0 + timeout_s
    drained_s = committed_s = recovered_s = None
    replacement: str | None = None
    epoch_after, restarts_after, target_step = epoch_before, restarts_before, None
    reported = None  # what the new world restored, as it reported
    last_seen = max((s for s, _ in _progress(client, world_before)), default=None)
    while time.monotonic() < deadline:
        status = client.status(deadline_s=max(0.5, deadline - time.monotonic()))
        if drained_s is None and node_id in status.draining:
            drained_s = mark(f"drain of {node_id} pending: every rank saves a final checkpoint")
        if committed_s is None:
            last_seen = max([s for s, _ in _progress(client, world_before)] + [last_seen or -1])
            if status.epoch > epoch_before and node_id not in status.world:
                epoch_after = status.epoch
                committed_s = mark(f"hand-over committed: epoch {status.epoch}, world {list(status.world)}")
                if rank < len(status.world) and status.world[rank] not in world_before:
                    replacement = status.world[rank]
                if not job:
                    break
                target = client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=job),
                                     idempotent=True)
                target_step = target.checkpoint.step if target.found else -1
        elif status.job_round > round_before:
            nodes = [n for n in client.nodes().nodes if n.node_id in status.world and n.HasField("progress")]
            if reported is None:
                reported = next((r for n in nodes if (r := restored_since(
                    n.progress, status.job_round_unix_s, epoch_after)) is not None), None)
            floor = reported.step if reported is not None else (target_step if target_step is not None else -1)
            fresh = [n.progress.step for n in nodes
                     if n.progress.reported_unix_s > status.job_round_unix_s and n.progress.step > floor]
            if fresh:
                restarts_after = status.job_restarts
                recovered_s = mark(f"training steps again in round {status.job_round} (step {max(fresh)})")
                break
        time.sleep(0.05)
    last_before = last_seen
    resumed_step = reported.step if reported is not None else None
    if job_log is not None and committed_s is not None:
        logged_last, logged_resumed = steps_from_log(job_log, wall0 + committed_s)
        last_before = logged_last if logged_last is not None else last_before
        resumed_step = resumed_step if resumed_step is not None else logged_resumed
    lost = lost_steps(last_before, resumed_step)
    ok, why = verdict(committed_s is not None, replacement, spares, lost, restarts_after == restarts_before,
                      recovered_s, bool(job))
    return DrillResult(node_id, mode, rank, drained_s, replacement, epoch_before, epoch_after, committed_s,
                       last_before, resumed_step, lost, recovered_s, notice_s, timeout_s, why, ok, timeline,
                       handover_s=committed_s, restarts_before=restarts_before, restarts_after=restarts_after,
                       restore_target_step=target_step, resumed_from=reported.source if reported is not None else "")
