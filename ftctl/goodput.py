"""``ftctl goodput``: the job's goodput as the leader accounts it (``GetGoodput``), with one line per
incident (when, kind, detection, recovery, steps redone): what an SRE reads after an incident.
``ftctl status`` shows its one-line summary."""

from __future__ import annotations

import re
import time
from typing import Any

import grpc

from ftd.client import CoordinatorClient
from ftd.rpc import rpc_code
from ftd.v1 import coordinator_pb2

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``1h``, ``2d`` or plain seconds; ``ValueError`` naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--since {text!r}: expected a positive duration such as 90s, 30m, 1h or 2d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def fetch(client: CoordinatorClient, job: str = "", since_s: float = 0.0) -> dict[str, Any]:
    r = client.call("GetGoodput", coordinator_pb2.GetGoodputRequest(job=job, since_s=since_s), idempotent=True)
    return report_dict(r)


def report_dict(r: coordinator_pb2.GoodputReport) -> dict[str, Any]:
    return {
        "job": r.job, "since_unix_s": r.since_unix_s, "now_unix_s": r.now_unix_s, "wall_s": r.wall_s,
        "goodput_ratio": r.goodput_ratio if r.HasField("goodput_ratio") else None,
        "goodput_1h_ratio": r.goodput_1h_ratio if r.HasField("goodput_1h_ratio") else None,
        "step": r.step, "steps_kept": r.steps_kept, "step_time_s": r.step_time_s, "productive_s": r.productive_s,
        "lost_s": {k: r.lost_s[k] for k in sorted(r.lost_s)}, "failures": r.failures, "steps_redone": r.steps_redone,
        "incidents": [{
            "kind": i.kind, "node_id": i.node_id, "started_unix_s": i.started_unix_s,
            "declared_unix_s": i.declared_unix_s, "detection_s": i.detection_s, "recovery_s": i.recovery_s,
            "steps_redone": i.steps_redone, "redone_s": i.redone_s, "lost_s": i.lost_s, "open": i.open,
            "step_before": i.step_before, "restored_step": i.restored_step, "also": list(i.also)}
            for i in r.incidents],
    }


def summary(client: CoordinatorClient, job: str) -> dict[str, Any] | None:
    """For ``ftctl status``: the report, or ``None`` when the job made no step yet (or the leader is
    older than GetGoodput)."""
    try:
        return fetch(client, job)
    except grpc.RpcError as exc:
        if rpc_code(exc) in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
            return None
        raise


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def one_line(d: dict[str, Any]) -> str:
    lost = d["lost_s"]
    return (f"{_pct(d['goodput_ratio'])} since the first step ({d['wall_s'] / 60:.1f} min), "
            f"{_pct(d['goodput_1h_ratio'])} over 1h; {d['failures']} failure(s), lost: detection "
            f"{lost.get('detection', 0):.1f}s, restart {lost.get('restart', 0):.1f}s, redone "
            f"{lost.get('redone_steps', 0):.1f}s, other {lost.get('other', 0):.1f}s")


def render(d: dict[str, Any]) -> str:
    lines = [f"job {d['job']}: goodput {one_line(d)}",
             f"step {d['step']} ({d['steps_kept']} kept, {d['steps_redone']} redone), failure-free step time "
             f"{d['step_time_s']:.3f}s, productive {d['productive_s']:.1f}s of {d['wall_s']:.1f}s"]
    if d["incidents"]:
        lines.append(f"{'when':20} {'kind':14} {'node':12} {'detection':>10} {'recovery':>10} {'redone':>7} "
                     f"{'lost':>8}")
    for i in d["incidents"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i["started_unix_s"]))
        also = f"  (+ {', '.join(i['also'])})" if i["also"] else ""
        lines.append(f"{when:20} {i['kind']:14} {i['node_id'] or '-':12} {i['detection_s']:9.2f}s "
                     f"{i['recovery_s']:9.2f}s {i['steps_redone']:7d} {i['lost_s']:7.1f}s"
                     f"{'  OPEN' if i['open'] else ''}{also}")
    return "\n".join(lines)
