"""The agent forwards a memory snapshot's commit only while it has a coordinator leader: without one
(etcd down, a failover) it answers UNAVAILABLE at once, so the training's next snapshot does not wait
behind a commit that can only time out. Durable commits are always forwarded (they are rare and worth
the wait)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from ftd.agent.service import AgentService
from ftd.v1 import checkpoint_pb2


class Aborted(Exception):
    pass


class Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


class Client:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, method: str, request: Any, idempotent: bool) -> Any:
        self.calls.append(f"{method}:{request.tier}")
        return checkpoint_pb2.CommitShardResponse(message="recorded")


def service(connected: bool, away_s: float = 0.0) -> tuple[AgentService, Client]:
    client = Client()
    session = SimpleNamespace(connected=connected, disconnected_for=lambda: 0.0 if connected else away_s)
    daemon = SimpleNamespace(node_id="node-0", session=session, client=client,
                             replicator=None, tiering=SimpleNamespace(notify=lambda: None))
    return AgentService(daemon), client  # type: ignore[arg-type]


def request(tier: str) -> checkpoint_pb2.CommitShardRequest:
    return checkpoint_pb2.CommitShardRequest(tier=tier, manifest=checkpoint_pb2.ShardManifest(job="j", step=7, rank=1))


def test_a_memory_commit_without_a_leader_fails_fast_naming_the_snapshot() -> None:
    svc, client = service(connected=False)
    ctx = Context()
    started = time.monotonic()
    with pytest.raises(Aborted):
        svc.CommitShard(request("mem"), ctx)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.5
    assert ctx.code is grpc.StatusCode.UNAVAILABLE
    assert "node-0 has had no coordinator leader" in ctx.details and "step 7 (rank 1) on mem" in ctx.details
    assert client.calls == []
    with pytest.raises(Aborted):
        svc.RecordCopy(checkpoint_pb2.RecordCopyRequest(job="j", step=5, rank=1, tier="mem"), ctx)  # type: ignore[arg-type]
    assert "memory copy of step 5 (rank 1) not recorded" in ctx.details and client.calls == []


def test_a_durable_commit_rides_out_a_failover_but_not_an_outage() -> None:
    svc, client = service(connected=False, away_s=30.0)
    ctx = Context()
    with pytest.raises(Aborted):
        svc.CommitShard(request("ssd"), ctx)  # type: ignore[arg-type]
    assert "no coordinator leader for 30.0s: step 7 (rank 1) on ssd not recorded" in ctx.details
    assert client.calls == []


def test_durable_commits_and_connected_memory_commits_are_forwarded() -> None:
    svc, client = service(connected=False, away_s=1.0)  # a failover under way: worth the wait
    assert svc.CommitShard(request("ssd"), Context()).message == "recorded"  # type: ignore[arg-type]
    svc, client2 = service(connected=True)
    assert svc.CommitShard(request("mem"), Context()).message == "recorded"  # type: ignore[arg-type]
    assert client.calls == ["CommitShard:ssd"] and client2.calls == ["CommitShard:mem"]
