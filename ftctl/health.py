"""``ftctl health [NODE]``: runs every (or one) node's health checks now, through its agent's
``CheckHealth``, and shows each check with its value and threshold. Exit 1 when a node is unhealthy
or its agent cannot be reached. ``ftctl health NODE --clear-gpu-faults`` forgets the XIDs that keep
NODE unhealthy (``ClearGpuFaults``: after the GPU was reset, or the fault judged benign)."""

from __future__ import annotations

from typing import Any

import grpc

from ftd import rpc
from ftd.client import CoordinatorClient
from ftd.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2

_GONE = (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)


class HealthCommandError(RuntimeError):
    pass


def check(client: CoordinatorClient, node: str | None = None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    nodes = [n for n in client.nodes().nodes if node is None or n.node_id == node]
    if node is not None and not nodes:
        raise HealthCommandError(f"node {node!r} is not registered")
    rows = []
    for n in nodes:
        row: dict[str, Any] = {"node": n.node_id, "healthy": None, "reason": "", "checks": []}
        if n.state in _GONE or not n.agent_address:
            row["reason"] = f"not checked: {cluster_pb2.NodeState.Name(n.state).removeprefix('NODE_STATE_').lower()}"
            rows.append(row)
            continue
        try:
            with rpc.agent_channel(n.agent_address, n.node_id, client.tls) as channel:
                verdict = agent_pb2_grpc.AgentStub(channel).CheckHealth(agent_pb2.CheckHealthRequest(),
                                                                        timeout=timeout_s)
        except grpc.RpcError as exc:
            row.update(healthy=False, reason=f"agent at {n.agent_address} unreachable: {rpc.describe(exc)}")
            rows.append(row)
            continue
        rows.append(_row(n.node_id, verdict))
    return rows


def clear_gpu_faults(client: CoordinatorClient, node: str, reason: str = "ftctl health --clear-gpu-faults",
                     timeout_s: float = 10.0) -> dict[str, Any]:
    """Clears NODE's latched GPU faults; the row of :func:`check` for NODE afterwards, with ``cleared``."""
    found = [n for n in client.nodes().nodes if n.node_id == node]
    if not found:
        raise HealthCommandError(f"node {node!r} is not registered")
    n = found[0]
    if n.state in _GONE or not n.agent_address:
        raise HealthCommandError(f"node {node} has no reachable agent "
                                 f"({cluster_pb2.NodeState.Name(n.state).removeprefix('NODE_STATE_').lower()})")
    try:
        with rpc.agent_channel(n.agent_address, n.node_id, client.tls) as channel:
            answer = agent_pb2_grpc.AgentStub(channel).ClearGpuFaults(
                agent_pb2.ClearGpuFaultsRequest(reason=reason), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise HealthCommandError(f"agent of {node} at {n.agent_address} refused: {rpc.describe(exc)}") from exc
    return {**_row(node, answer.verdict), "cleared": list(answer.cleared)}


def _row(node: str, verdict: cluster_pb2.HealthVerdict) -> dict[str, Any]:
    return {"node": node, "healthy": verdict.healthy, "reason": verdict.reason,
            "checked_unix_s": verdict.checked_unix_s,
            "checks": [{"name": c.name, "ok": c.ok, "value": c.value if c.HasField("value") else None,
                        "threshold": c.threshold if c.HasField("threshold") else None, "reason": c.reason}
                       for c in verdict.checks]}


def render(rows: list[dict[str, Any]]) -> str:
    from .render import table

    out = []
    for r in rows:
        if "cleared" in r:
            out.append(f"{r['node']}: cleared {', '.join(r['cleared']) or 'nothing (no GPU faults recorded)'}")
        state = "healthy" if r["healthy"] else "UNHEALTHY" if r["healthy"] is False else "-"
        out.append(f"{r['node']}: {state}{': ' + r['reason'] if r['reason'] else ''}")
    lines = [(r["node"], c["name"], "ok" if c["ok"] else "FAIL", _num(c["value"]), _num(c["threshold"]), c["reason"])
             for r in rows for c in r["checks"]]
    if lines:
        out.append(table(("NODE", "CHECK", "RESULT", "VALUE", "THRESHOLD", "WHY"), lines))
    return "\n".join(out)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
