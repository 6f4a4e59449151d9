"""``ftctl drill --kill-node``: kill a node for real through its agent and measure the recovery.

The clock starts when the agent acknowledges the Kill (it SIGKILLs its supervised processes before
answering and itself 50 ms after), so the detection figure is, if anything, slightly pessimistic.
Decisions about the outcome are a pure function (:func:`verdict`) of the measurements.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from ftd.coordinator.client import CoordinatorClient, rpc_code, rpc_details
from ftd.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2

_GONE = (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)


class DrillError(RuntimeError):
    pass


@dataclass
class DrillResult:
    node: str
    rank: int
    detected_s: float | None
    replacement: str | None
    epoch_before: int
    epoch_after: int
    committed_s: float | None
    target_detect_s: float
    verdict: str
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def verdict(detected_s: float | None, target_s: float, was_active: bool, replacement: str | None,
            epoch_before: int, epoch_after: int, spares_before: int) -> tuple[bool, str]:
    """Pass/fail with the reason, from the measurements alone."""
    if detected_s is None:
        return False, "fail: the node was not declared dead before the drill timed out"
    if detected_s > target_s:
        return False, f"fail: detected after {detected_s:.2f}s, target {target_s:g}s"
    if was_active and epoch_after <= epoch_before:
        return False, "fail: no new epoch was committed for the dead active node"
    if was_active and spares_before > 0 and replacement is None:
        return False, "fail: a spare was available but none took the dead node's rank"
    detail = f"detected in {detected_s:.2f}s (target {target_s:g}s)"
    if was_active:
        detail += f"; {replacement} took the rank" if replacement else "; no spare: the world shrank"
    return True, f"pass: {detail}"


def kill_node(client: CoordinatorClient, node_id: str, token: str, target_s: float = 3.0,
              timeout_s: float = 30.0, reason: str = "ftctl drill") -> DrillResult:
    status = client.status()
    nodes = {n.node_id: n for n in client.nodes().nodes}
    if node_id not in nodes:
        raise DrillError(f"node {node_id!r} is not registered; known nodes: {', '.join(sorted(nodes)) or 'none'}")
    node = nodes[node_id]
    if node.state in _GONE:
        raise DrillError(f"node {node_id} is already {cluster_pb2.NodeState.Name(node.state)}; nothing to kill")
    if not node.agent_address:
        raise DrillError(f"node {node_id} registered no agent address; cannot reach its agent")
    rank = list(status.world).index(node_id) if node_id in status.world else -1
    epoch_before, spares_before = status.epoch, len(status.spares)
    world_before = set(status.world)

    channel = grpc.insecure_channel(node.agent_address)
    try:
        stub = agent_pb2_grpc.AgentStub(channel)
        stub.Kill(agent_pb2.KillRequest(reason=reason), timeout=5.0,
                  metadata=(("authorization", f"Bearer {token}"),))
    except grpc.RpcError as exc:
        code = rpc_code(exc)
        raise DrillError(f"agent of {node_id} at {node.agent_address} refused Kill: "
                         f"{code.name if code else '?'} {rpc_details(exc)}") from exc
    finally:
        channel.close()
    killed_at = time.monotonic()

    detected_s = committed_s = None
    replacement = None
    epoch_after = epoch_before
    deadline = killed_at + timeout_s
    while time.monotonic() < deadline:
        if detected_s is None:
            listed = {n.node_id: n for n in client.nodes(deadline_s=max(0.5, deadline - time.monotonic())).nodes}
            if listed[node_id].state in _GONE:
                detected_s = time.monotonic() - killed_at
        if detected_s is not None:
            status = client.status(deadline_s=max(0.5, deadline - time.monotonic()))
            if rank < 0 or status.epoch > epoch_before:
                epoch_after = status.epoch
                committed_s = time.monotonic() - killed_at
                if 0 <= rank < len(status.world) and status.world[rank] not in world_before:
                    replacement = status.world[rank]  # a newcomer at the dead node's rank, not a shifted survivor
                break
        time.sleep(0.02)
    ok, why = verdict(detected_s, target_s, rank >= 0, replacement, epoch_before, epoch_after, spares_before)
    return DrillResult(node_id, rank, _round(detected_s), replacement, epoch_before, epoch_after,
                       _round(committed_s), target_s, why, ok)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
