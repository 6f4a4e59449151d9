"""Client library for the coordinator's API, used by agents and ``ftctl``: follows the leader across
replicas, retries only what is safe to retry, and explains failures in terms an operator can act on.

A standby answers UNAVAILABLE with the leader's address in the ``ftd-leader`` trailing metadata; the
client switches to it. A request refused by a standby was not processed, so even a non-idempotent
call may be re-sent to the leader; any other failure of a non-idempotent call is raised as is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from ftd.rpc import channel as open_channel
from ftd.rpc import parse_endpoints, rpc_code, rpc_details
from ftd.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("ftd.client")
LEADER_METADATA_KEY = "ftd-leader"


class CoordinatorUnreachable(ConnectionError):
    """No replica answered as leader; names every endpoint tried and the last error."""

    def __init__(self, endpoints: Sequence[str], last: str) -> None:
        super().__init__(
            f"no coordinator leader reachable at {','.join(endpoints)} (last error: {last}). "
            "Check that ftd-coordinator runs there (systemctl status ftd-coordinator), that etcd is up, "
            "and that --coordinator / FTD_COORDINATOR names the right HOST:PORT list."
        )
        self.endpoints = list(endpoints)


def leader_hint(exc: BaseException) -> str | None:
    """The leader address a standby named in its refusal, or ``None`` if this was no refusal."""
    if rpc_code(exc) is not grpc.StatusCode.UNAVAILABLE:
        return None
    trailers = getattr(exc, "trailing_metadata", None)
    for key, value in (trailers() if callable(trailers) else None) or ():
        if key == LEADER_METADATA_KEY:
            return str(value)
    return None


class CoordinatorClient:
    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints, "coordinator endpoint")
        self.timeout_s = timeout_s
        self._current = self.endpoints[0]
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self._current

    def stub(self, endpoint: str | None = None) -> coordinator_pb2_grpc.CoordinatorStub:
        endpoint = endpoint or self._current
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = open_channel(endpoint)
                self._channels[endpoint] = channel
        return coordinator_pb2_grpc.CoordinatorStub(channel)

    def follow(self, exc: BaseException) -> bool:
        """Moves to the next endpoint to try after ``exc``: the named leader if any, else the next
        configured endpoint. Returns whether the request is known not to have been processed."""
        hint = leader_hint(exc)
        if hint:
            self._current = hint
            return True
        index = self.endpoints.index(self._current) if self._current in self.endpoints else -1
        self._current = self.endpoints[(index + 1) % len(self.endpoints)]
        return hint is not None  # "" = a standby that knows no leader: not processed either

    def call(self, method: str, request: Any, *, idempotent: bool, timeout_s: float | None = None,
             deadline_s: float | None = None) -> Any:
        """Calls ``method`` on the leader, following refusals until ``deadline_s`` (default: the
        per-call timeout times the endpoint count, at least 3 s)."""
        budget = deadline_s if deadline_s is not None else max(3.0, self.timeout_s * len(self.endpoints))
        deadline = time.monotonic() + budget
        last = "no attempt"
        pause = 0.05
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorUnreachable(self.endpoints, last)
            try:
                fn = getattr(self.stub(), method)
                return fn(request, timeout=min(timeout_s or self.timeout_s, remaining))
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                last = f"{self._current}: {code.name if code else '?'} {rpc_details(exc)}"
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                not_processed = self.follow(exc)
                if not idempotent and not not_processed:
                    raise  # it may have been applied: never blindly re-send a non-idempotent call
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)

    # ---- typed helpers -------------------------------------------------------------------------

    def status(self, **kw: Any) -> coordinator_pb2.ClusterStatus:
        return self.call("GetStatus", coordinator_pb2.GetStatusRequest(), idempotent=True, **kw)  # type: ignore[no-any-return]

    def nodes(self, **kw: Any) -> coordinator_pb2.ListNodesResponse:
        return self.call("ListNodes", coordinator_pb2.ListNodesRequest(), idempotent=True, **kw)  # type: ignore[no-any-return]

    def events(self, limit: int = 100, **kw: Any) -> coordinator_pb2.ListEventsResponse:
        return self.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=limit), idempotent=True, **kw)  # type: ignore[no-any-return]

    def register(self, request: coordinator_pb2.RegisterRequest, **kw: Any) -> coordinator_pb2.RegisterResponse:
        # Idempotent: the same incarnation registering twice is answered "already registered".
        return self.call("Register", request, idempotent=True, **kw)  # type: ignore[no-any-return]

    def heartbeat_stream(self, requests: Iterator[coordinator_pb2.HeartbeatRequest]) -> Any:
        """Opens a heartbeat stream to the current endpoint; the caller follows refusals."""
        return self.stub().Heartbeat(requests)

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
