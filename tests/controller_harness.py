"""The coordinator's Controller on the in-memory store, driven by hand for test_controller*.py: a clock
that moves only when told, the requests agents send (RegisterRequest, a heartbeat), ticks of 0.1 s with
heartbeats and the leader's keep-alive, and a small cluster (two active nodes and a spare) under a leader
past its grace."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ftd.coordinator import errors
from ftd.coordinator.control import Controller
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.v1 import cluster_pb2, coordinator_pb2

T = TypeVar("T")


class Clock:
    """The controller's monotonic clock: it reads 1000 s until a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


WALL = 1_700_000_000.0  # the wall clock's reading when the monotonic test clock reads 0


def make(store: MemoryStore, clock: Clock, rid: str = "c0") -> Controller:
    settings = CoordinatorSettings(replica_id=rid, failover_grace_s=5.0)
    return Controller(store, settings, f"127.0.0.1:{7400 + int(rid[1:])}", clock=clock,
                      wall=lambda: WALL + clock.now)


def reg(node_id: str, role: int = cluster_pb2.ROLE_ACTIVE, host: str = "10.0.0.1",
        inc: str = "i1", rack: str = "") -> coordinator_pb2.RegisterRequest:
    return coordinator_pb2.RegisterRequest(node_id=node_id, host=host, role=role,  # type: ignore[arg-type]
                                           labels={"rack": rack} if rack else {}, agent_address="127.0.0.1:9",
                                           pid=1, incarnation=inc)


def hb(ctl: Controller, node_id: str, inc: str = "i1") -> None:
    stream = ctl.membership.streams.get(node_id)
    req = coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation=inc, seq=1)
    if stream is None:
        ctl.membership.open_stream(req)
    else:
        ctl.membership.on_heartbeat(stream, req)


def send(ctl: Controller, req: coordinator_pb2.HeartbeatRequest) -> None:
    """One heartbeat on the node's stream (opened by the first); a standby's NotLeader is ignored."""
    stream = ctl.membership.streams.get(req.node_id)
    with contextlib.suppress(errors.NotLeader):
        if stream is None:
            ctl.membership.open_stream(req)
        else:
            ctl.membership.on_heartbeat(stream, req)


async def step(ctl: Controller, clock: Clock, beats: tuple[str, ...] = (), n: int = 1) -> None:
    """Moves time by ``n`` ticks of 0.1 s: heartbeats from ``beats``, the leader's keep-alive once a
    second, one detection tick each."""
    for _ in range(n):
        clock.advance(0.1)
        for node_id in beats:
            with contextlib.suppress(errors.NotLeader):  # a refused agent backs off and retries
                hb(ctl, node_id)
        if ctl.committer.lease is not None and round(clock.now * 10) % 10 == 0:
            await ctl.leadership_step()
        await ctl.tick()


async def cluster(ctl: Controller, clock: Clock) -> None:
    await ctl.leadership_step()
    assert ctl.is_leader
    await step(ctl, clock, n=60)  # past the new leader's grace
    for node_id in ("a", "b"):
        await ctl.membership.register(reg(node_id))
    await ctl.membership.register(reg("s", cluster_pb2.ROLE_SPARE))
    for node_id in ("a", "b", "s"):
        hb(ctl, node_id)
    await ctl.tick()
