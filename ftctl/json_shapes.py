"""The JSON shapes of ftctl's output (``--json``, the demo's report): one definition, used by every
command that prints a status or a node, so scripts reading them see one format."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from ftd.v1 import cluster_pb2


def status_dict(status: Any) -> dict[str, Any]:
    return {
        "leader": status.leader_id, "leader_address": status.leader_address, "epoch": status.epoch,
        "world": list(status.world), "target_world_size": status.target_world_size,
        "spares": list(status.spares), "dead": list(status.dead), "suspect": list(status.suspect),
        "degraded": status.degraded, "degraded_reason": status.degraded_reason,
        "last_change_reason": status.last_change_reason, "last_change_unix_s": status.last_change_unix_s,
        "etcd_reachable": status.etcd_reachable, "draining": list(status.draining),
        "problems": list(status.problems), "etcd_alarms": list(status.etcd_alarms),
        "stragglers": list(status.stragglers), "straggler_decision": status.straggler_decision,
        "rollback_decision": status.rollback_decision,
        "job": {"id": status.job, "round": status.job_round, "restarts": status.job_restarts,
                "max_restarts": status.job_max_restarts, "closed": status.job_closed, "message": status.job_message,
                "round_unix_s": status.job_round_unix_s, "on_no_spare": status.job_on_no_spare or "shrink",
                "rollbacks": status.job_rollbacks}
        if status.job else None,
    }


def node_dict(n: Any) -> dict[str, Any]:
    return {
        "node_id": n.node_id, "host": n.host, "pid": n.pid,
        "role": "active" if n.role == cluster_pb2.ROLE_ACTIVE else "spare",
        "state": cluster_pb2.NodeState.Name(n.state).removeprefix("NODE_STATE_").lower(),
        "rank": n.rank, "epoch": n.epoch, "last_heartbeat_age_s": round(n.last_heartbeat_age_s, 3),
        "labels": dict(n.labels), "agent_address": n.agent_address, "state_reason": n.state_reason,
        "step": n.progress.step if n.HasField("progress") else None,
        # What the node's training restored when its world started (its Checkpointer's report).
        "restored": {"step": n.progress.restored.step, "source": n.progress.restored.source,
                     "epoch": n.progress.restored.epoch, "world_size": n.progress.restored.world_size,
                     "saved_world_size": n.progress.restored.saved_world_size}
        if n.HasField("progress") and n.progress.HasField("restored") else None,
        "health": json_format.MessageToDict(n.health, preserving_proto_field_name=True),
        # The agent's own verdict against its thresholds; None when it reports none.
        "healthy": n.health.verdict.healthy if n.health.HasField("verdict") else None,
        "health_reason": n.health.verdict.reason if n.health.HasField("verdict") else "",
        # The leader's straggler watch: score against the other nodes (0: not judged), why, and the
        # slow mark of a node replaced as a straggler (not promoted until it passes a health check).
        "straggler_score": round(n.straggler_score, 3), "straggler_reason": n.straggler_reason, "slow": n.slow,
    }
