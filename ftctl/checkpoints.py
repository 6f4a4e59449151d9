"""``ftctl checkpoints``: list the catalog, verify every copy of a step on every tier, roll back, and
watch migrations between tiers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from rich.console import Console

from ftd import rpc
from ftd.checkpoints.catalog import CopyRef
from ftd.client import CoordinatorClient
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

TIERS = ("mem", "ssd", "hdd", "s3")
SHARED = ("shared", "s3")  # copies any node can read, whoever wrote them
_GONE = (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)


class CheckpointCommandError(RuntimeError):
    pass


def checkpoints(client: CoordinatorClient, job: str = "") -> list[Any]:
    return list(client.checkpoints(job))


def resolve_job(client: CoordinatorClient, job: str | None) -> str:
    if job:
        return job
    jobs = sorted({str(c.job) for c in checkpoints(client)})
    if len(jobs) == 1:
        return jobs[0]
    known = "known jobs: " + ", ".join(jobs) if jobs else "no jobs yet"
    raise CheckpointCommandError(f"name the job with --job ({known})")


def alive_nodes(client: CoordinatorClient) -> set[str]:
    return {n.node_id for n in client.nodes().nodes if n.state not in _GONE}


def reachable_sources(c: Any, alive: set[str]) -> dict[int, list[str]]:
    """Per rank, the good copies that can be read right now: on a shared tier (HDD mount, S3), or on
    a node whose agent is alive (its own memory or SSD, served to others over the peer copy path)."""
    out: dict[int, list[str]] = {}
    for shard in c.shards:
        bad = set(shard.bad)
        out[shard.rank] = [str(CopyRef(cp.tier, cp.location)) for cp in shard.copies
                           if str(CopyRef(cp.tier, cp.location)) not in bad
                           and (cp.location in SHARED or cp.location in alive)]
    return out


def as_dict(c: Any, alive: set[str] | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "job": c.job, "step": c.step, "valid": c.valid, "status": c.status, "epoch": c.epoch,
        "world_size": c.world_size, "format": c.format, "bytes": c.bytes, "created_unix_s": c.created_unix_s,
        "tiers": {t: bool(c.on_tier.get(t, False)) for t in TIERS}, "cadence": c.cadence,
    }
    if alive is not None:
        sources = reachable_sources(c, alive)
        unreachable = sorted(r for r in range(c.world_size) if not sources.get(r))
        row.update(sources=sources, restorable_now=c.valid and not unreachable, unreachable_ranks=unreachable)
    return row


def rollback(client: CoordinatorClient, job: str, step: int) -> dict[str, Any]:
    resp = client.call("Rollback", checkpoint_pb2.RollbackRequest(job=job, step=step), idempotent=False)
    return {"job": job, "restore_target": resp.target.step, "removed_steps": list(resp.removed_steps)}


def forget(client: CoordinatorClient, job: str, reason: str) -> dict[str, Any]:
    resp = client.call("ForgetJob", checkpoint_pb2.ForgetJobRequest(job=job, reason=reason), idempotent=True)
    return {"job": job, "removed_steps": list(resp.removed_steps)}


def _agent_for(nodes: dict[str, Any], location: str) -> Any:
    """The agent that can read a copy: its own node for node-local tiers, any alive one for shared."""
    if location in nodes:
        return nodes[location]
    alive = [n for n in nodes.values() if n.state == cluster_pb2.NODE_STATE_ALIVE]
    return alive[0] if alive else None


def verify(client: CoordinatorClient, job: str, step: int,
           progress: Callable[[int, int, str], None] | None = None) -> list[dict[str, Any]]:
    """Asks the agents to re-read every recorded copy of every shard of ``step``; a bad copy is
    recorded as corrupt in the catalog so no restore trusts it. Returns one row per copy."""
    record = next((c for c in checkpoints(client, job) if c.step == step), None)
    if record is None:
        raise CheckpointCommandError(f"job {job} has no checkpoint at step {step}")
    nodes = {n.node_id: n for n in client.nodes().nodes}
    copies = [(s, c) for s in record.shards for c in s.copies]
    total = sum(s.bytes for s, _ in copies)
    done = 0
    rows = []
    for shard, copy in copies:
        label = f"rank {shard.rank} on {CopyRef(copy.tier, copy.location)}"
        node = _agent_for(nodes, copy.location)
        row: dict[str, Any] = {"rank": shard.rank, "tier": copy.tier, "location": copy.location}
        if node is None or node.state != cluster_pb2.NODE_STATE_ALIVE:
            row.update(ok=False, error=f"no alive agent can read {CopyRef(copy.tier, copy.location)}", checked=False)
        else:
            with rpc.agent_channel(node.agent_address, node.node_id, client.tls) as ch:
                try:
                    r = agent_pb2_grpc.AgentStub(ch).VerifyCopy(agent_pb2.VerifyCopyRequest(
                        job=job, step=step, rank=shard.rank, tier=copy.tier), timeout=3600)
                    row.update(ok=r.ok, error=r.error, bytes=r.bytes, seconds=round(r.seconds, 3), checked=True)
                except grpc.RpcError as exc:
                    code = rpc_code(exc)
                    row.update(ok=False, checked=False,
                               error=f"agent {node.node_id} at {node.agent_address}: {code.name if code else '?'} "
                                     f"{rpc_details(exc)}")
            if row["checked"] and not row["ok"]:
                client.call("RecordCopy", checkpoint_pb2.RecordCopyRequest(
                    job=job, step=step, rank=shard.rank, tier=copy.tier, location=copy.location, present=True,
                    corrupt_reason=f"ftctl verify: {row['error']}"[:400]), idempotent=True)
        done += shard.bytes
        rows.append(row)
        if progress is not None:
            progress(done, total, label)
    return rows


def bar(done: int, total: int, width: int = 30) -> str:
    frac = 1.0 if total <= 0 else min(1.0, done / total)
    filled = int(frac * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {100 * frac:5.1f}% {done / 1e9:.2f}/{total / 1e9:.2f} GB"


class VerifyProgress:
    """A rich progress bar on stderr while copies are re-read (only on a terminal)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._task: Any = None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("verifying", total=total)
        self._progress.update(self._task, completed=done, description=f"verifying {label}")
        if done >= total:
            self._progress.stop()


def migrations(client: CoordinatorClient) -> list[dict[str, Any]]:
    out = []
    for node in client.nodes().nodes:
        if node.state != cluster_pb2.NODE_STATE_ALIVE or not node.agent_address:
            continue
        with rpc.agent_channel(node.agent_address, node.node_id, client.tls) as ch:
            try:
                info = agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=5)
            except grpc.RpcError:
                continue
        for m in info.migrations:
            out.append({"node": node.node_id, "job": m.job, "step": m.step, "rank": m.rank, "tier": m.tier,
                        "done_bytes": m.done_bytes, "total_bytes": m.total_bytes})
    return out


def watch_migrations(client: CoordinatorClient, seconds: float, say: Callable[[str], None] = print) -> None:
    end = time.monotonic() + seconds
    while True:
        moves = migrations(client)
        lines = [f"{m['node']:<10} {m['job']} step {m['step']} rank {m['rank']} -> {m['tier']:<3} "
                 f"{bar(m['done_bytes'], m['total_bytes'])}" for m in moves] or ["no migration in progress"]
        say("\n".join(lines))
        if time.monotonic() >= end:
            return
        time.sleep(1.0)
