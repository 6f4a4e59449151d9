"""Watching a cluster through a fault: sample what every agent and the coordinator say, and report
any node declared dead or any epoch change."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from ftd import rpc
from ftd.ftctl.localcluster import ClusterFile
from ftd.v1 import agent_pb2, agent_pb2_grpc


@dataclass
class Watch:
    epochs_seen: set[int] = field(default_factory=set)
    fenced_agents: set[str] = field(default_factory=set)
    dead_seen: set[str] = field(default_factory=set)
    status_ok: int = 0
    status_failed: int = 0
    longest_gap_s: float = 0.0


def watch(cluster: ClusterFile, seconds: float, query_coordinator: bool = True) -> Watch:
    """Samples for ``seconds`` (bounded): agents' assignments over their own gRPC endpoints, and the
    coordinator's status when ``query_coordinator``."""
    out = Watch()
    channels = {a.name: rpc.channel(a.info["address"], tls=cluster.operator) for a in cluster.agents}
    client = cluster.client(timeout_s=1.0)
    end = time.monotonic() + seconds
    last_ok = time.monotonic()
    try:
        while time.monotonic() < end:
            for name, ch in channels.items():
                try:
                    info = agent_pb2_grpc.AgentStub(ch).GetInfo(agent_pb2.GetInfoRequest(), timeout=1.0)
                except grpc.RpcError:
                    continue
                out.epochs_seen.add(info.assignment.epoch)
                if info.assignment.fenced:
                    out.fenced_agents.add(name)
            if query_coordinator:
                try:
                    status = client.status(deadline_s=1.0)
                    out.status_ok += 1
                    now = time.monotonic()
                    out.longest_gap_s = max(out.longest_gap_s, now - last_ok)
                    last_ok = now
                    out.epochs_seen.add(status.epoch)
                    out.dead_seen.update(status.dead)
                except ConnectionError:
                    out.status_failed += 1
            time.sleep(0.1)
        if query_coordinator:
            out.longest_gap_s = max(out.longest_gap_s, time.monotonic() - last_ok)  # failures at the end count too
    finally:
        client.close()
        for ch in channels.values():
            ch.close()
    return out
