"""``ftctl health [NODE]``: runs every (or one) node's health checks now, through its agent's
``CheckHealth``, and shows each check with its value and threshold. Exit 1 when a node is unhealthy
or its agent cannot be reached."""

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
            with rpc.channel(n.agent_address, tls=client.tls) as channel:
                verdict = agent_pb2_grpc.AgentStub(channel).CheckHealth(agent_pb2.CheckHealthRequest(),
                                                                        timeout=timeout_s)
        except grpc.RpcError as exc:
            row.update(healthy=False, reason=f"agent at {n.agent_address} unreachable: {rpc.describe(exc)}")
            rows.append(row)
            continue
        row.update(healthy=verdict.healthy, reason=verdict.reason, checked_unix_s=verdict.checked_unix_s,
                   checks=[{"name": c.name, "ok": c.ok, "value": c.value if c.HasField("value") else None,
                            "threshold": c.threshold if c.HasField("threshold") else None, "reason": c.reason}
                           for c in verdict.checks])
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    from .render import table

    out = []
    for r in rows:
        state = "healthy" if r["healthy"] else "UNHEALTHY" if r["healthy"] is False else "-"
        out.append(f"{r['node']}: {state}{': ' + r['reason'] if r['reason'] else ''}")
    lines = [(r["node"], c["name"], "ok" if c["ok"] else "FAIL", _num(c["value"]), _num(c["threshold"]), c["reason"])
             for r in rows for c in r["checks"]]
    if lines:
        out.append(table(("NODE", "CHECK", "RESULT", "VALUE", "THRESHOLD", "WHY"), lines))
    return "\n".join(out)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
