"""Property-based fuzzing of every Coordinator RPC (issue 11 item 8).

A controller on the in-memory store, served by the real :class:`~ftd.coordinator.service.CoordinatorService`
on an in-process gRPC server (plaintext on 127.0.0.1: the handlers are under test, not the transport),
gets random and boundary messages for every method of the service descriptor. Each call must end in a
clear status from :data:`ALLOWED` (never INTERNAL or UNKNOWN, always with details when not OK), a
refused call must leave the store's nodes, world and kv as they were, and the server must keep
serving as the leader. A method without a strategy fails the suite.

Runs are bounded and reproducible: ``derandomize=True``, no example database, ``MAX_EXAMPLES`` per
method.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc import aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftd import rpc
from ftd.coordinator import validation
from ftd.coordinator.control import Controller
from ftd.coordinator.service import add_to_server
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

MAX_EXAMPLES = 80
ALLOWED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
}
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
WALL = 1_700_000_000.0

# ---- strategies, derived from the message descriptors ---------------------------------------------

BOUNDARY_STRINGS = [
    "", "a", "node-0\n", "node-0\r\n", " node-0", "x" * 129, "x" * 5000, "\x00", "\x1b[31mred", "[bold]x[/]",
    "\u202eevil", "../../etc/passwd", "/", ".", "..", "s3", "shared", ":", "h:0", "h:65536", "[::1]:9",
    "127.0.0.1:9", "ü", "job/step", "%s%n", "j" * 128,
]
# What a field plausibly holds, so the fuzz also reaches past validation into the rules.
PLAUSIBLE: dict[str, list[Any]] = {
    "node_id": ["a", "b", "s", "ghost"], "job": ["j", "k"], "location": ["a", "b", "s3", "shared"],
    "tier": ["ssd", "hdd", "s3"], "format": ["torch", "dcp"], "crc32c": ["0a0b0c0d", "ffffffff"],
    "host": ["10.0.0.1", "10.0.0.9"], "incarnation": ["i1", "i2"], "address": ["127.0.0.1:9"],
    "agent_address": ["127.0.0.1:9"], "name": ["state.pt", ".metadata"], "reason": ["r", "disk full"],
    "corrupt_reason": ["", "crc mismatch"], "page_token": ["", "b", "j/000000000100", "5"],
    "step": [0, 1, 100, 200], "rank": [0, 1, 2], "world_size": [1, 2], "round": list(range(8)),
    "last_round": [-1, 0, 1], "limit": [0, 1, 5], "page_size": [0, 1, 2], "epoch": [0, 1],
    "on_no_spare": ["", "shrink", "wait"], "identity": ["node/a", "node/ghost", ""], "serial": ["", "ab12"],
    "serial_identity": ["", "node/a"],
}
INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar(field: FieldDescriptor, plausible: bool = False) -> st.SearchStrategy[Any]:
    """Random and boundary values of the field's type; with ``plausible``, values a real client sends."""
    likely = PLAUSIBLE.get(field.name, [])
    if plausible:
        if field.type == FieldDescriptor.TYPE_STRING:
            return st.sampled_from(likely or ["x", "r1"])
        if field.type in INTS:
            lo, hi = INTS[field.type]
            return st.sampled_from([p for p in likely if isinstance(p, int) and lo <= p <= hi] or [0, 1])
        if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return st.sampled_from([0.0, 1.0, WALL] if field.type == FieldDescriptor.TYPE_DOUBLE else [0.0, 1.0])
        if field.type == FieldDescriptor.TYPE_ENUM:
            return st.sampled_from([v.number for v in field.enum_type.values])
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(likely or ["x"]), st.sampled_from(BOUNDARY_STRINGS), st.text(max_size=40))
    if field.type in INTS:
        lo, hi = INTS[field.type]
        edges = sorted({lo, hi, 0, 1, -1 if lo < 0 else 0, hi // 2})
        ints = [p for p in likely if isinstance(p, int) and lo <= p <= hi]
        return st.one_of(st.sampled_from(ints or [0]), st.sampled_from(edges), st.integers(lo, hi))
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, -1.0, WALL, float("nan"), float("inf"), float("-inf"), 1e308]),
                         st.floats())
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers arrive too
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 9))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    raise AssertionError(f"no strategy for field {field.full_name} of type {field.type}")


def message(descriptor: Descriptor, depth: int = 0, plausible: bool = False) -> st.SearchStrategy[Any]:
    """A message of ``descriptor``: each field unset, plausible, at a boundary, or random; with
    ``plausible``, every field set to what a real client would send (so calls get past validation
    into the rules)."""
    cls = message_class(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                inner = message(value.message_type, depth + 1, plausible) \
                    if value.type == FieldDescriptor.TYPE_MESSAGE else scalar(value, plausible)
                keys = st.sampled_from(["rack", "zone"]) if plausible else scalar(key)
                fields[field.name] = st.dictionaries(keys, inner, max_size=3)
                continue
            if depth >= 3:
                continue
            sub = message(field.message_type, depth + 1, plausible)
            fields[field.name] = st.lists(sub, min_size=int(plausible), max_size=3) if field.is_repeated else sub
        elif field.is_repeated:
            fields[field.name] = st.lists(scalar(field, plausible), max_size=3)
        else:
            fields[field.name] = scalar(field, plausible)
    if plausible:
        return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def message_class(descriptor: Descriptor) -> Any:
    for module in (coordinator_pb2, checkpoint_pb2, cluster_pb2):
        found = module
        for part in descriptor.full_name.split(".")[2:]:
            found = getattr(found, part, None)
            if found is None:
                break
        if found is not None:
            return found
    raise AssertionError(f"no generated class for {descriptor.full_name}")


STRATEGIES: dict[str, st.SearchStrategy[Any]] = {}
for _method in SERVICE.methods:
    _request = st.one_of(message(_method.input_type, plausible=True), message(_method.input_type))
    STRATEGIES[_method.name] = st.lists(_request, min_size=1, max_size=3) if _method.client_streaming else _request


def test_every_rpc_has_a_strategy() -> None:
    missing = [m.name for m in SERVICE.methods if m.name not in STRATEGIES]
    assert not missing, f"RPCs without a fuzz strategy: {missing}"
    assert len(STRATEGIES) == len(SERVICE.methods) >= 17


# ---- the server under test ------------------------------------------------------------------------------


class Clock:
    """Never moves: no node dies and no lease expires while the fuzz runs."""

    now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A leader (controller + real service) on an event loop of its own thread, with nodes a, b
    (ranks 0, 1) and spare s, a job j and a valid checkpoint of it; a blocking client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server", daemon=True)
        self.thread.start()
        self.port = self.call(self._start())
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[*rpc.CHANNEL_OPTIONS, *validation.CLIENT_SIZE_OPTIONS])
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(30)

    async def _start(self) -> int:
        clock = Clock()
        self.store = MemoryStore(clock=clock)
        self.ctl = Controller(self.store, CoordinatorSettings(replica_id="c0", failover_grace_s=0.0),
                              "127.0.0.1:0", clock=clock, wall=lambda: WALL + clock.now)
        self.ctl.limiter.burst = 1e12  # the limiter has tests of its own; here it must not hide handlers
        await self.ctl.leadership_step()
        assert self.ctl.is_leader
        m = self.ctl.membership
        for node_id, role in (("a", cluster_pb2.ROLE_ACTIVE), ("b", cluster_pb2.ROLE_ACTIVE),
                              ("s", cluster_pb2.ROLE_SPARE)):
            await m.register(coordinator_pb2.RegisterRequest(node_id=node_id, host="10.0.0.1", role=role,
                                                             agent_address="127.0.0.1:9", incarnation="i1"))
            m.open_stream(coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation="i1"))
        await self.ctl.tick()
        await self.ctl.jobs.join(coordinator_pb2.JoinRoundRequest(job="j", node_id="a", last_round=-1))
        for rank in (0, 1):
            await self.ctl.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
                tier="ssd", location="ab"[rank], manifest=checkpoint_pb2.ShardManifest(
                    job="j", step=100, epoch=1, rank=rank, world_size=2, format="torch",
                    files=[checkpoint_pb2.ShardFile(name="state.pt", size=1, crc32c="0a0b0c0d")])))
        assert self.store.world.ranks == ("a", "b")
        self.server = aio.server(options=[*rpc.SERVER_OPTIONS, *validation.SERVER_SIZE_OPTIONS])
        add_to_server(self.server, self.ctl)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def state(self) -> tuple[dict[str, Any], Any, dict[str, bytes]]:
        return dict(self.store.nodes), self.store.world, dict(self.store.kv)

    def invoke(self, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
        fn: Callable[..., Any] = getattr(self.stub, method)
        try:
            if SERVICE.methods_by_name[method].client_streaming:
                for _ in fn(iter(request), timeout=10):
                    pass
            else:
                fn(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(None))
        self.call(self.ctl.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.close()


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_every_rpc_answers_a_clear_status_and_a_refusal_changes_nothing(harness: Harness, method: str) -> None:
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(STRATEGIES[method])
    def check(request: Any) -> None:
        before = harness.state()
        code, details = harness.invoke(method, request)
        seen[code] = seen.get(code, 0) + 1
        assert code in ALLOWED, f"{method}({request!r:.300}) -> {code.name}: {details}"
        if code is not grpc.StatusCode.OK:
            assert details.strip(), f"{method} answered {code.name} without saying why"
            assert harness.state() == before, f"{method} was refused ({code.name}: {details}) but changed state"
        assert harness.ctl.is_leader, f"{method}({request!r:.300}) cost the leadership"

    check()
    assert harness.invoke("GetStatus", coordinator_pb2.GetStatusRequest())[0] is grpc.StatusCode.OK
    # The plausible half of the examples gets past validation: every handler ran, not only its checks.
    assert grpc.StatusCode.OK in seen, f"{method}: no example was accepted ({ {c.name: n for c, n in seen.items()} })"
