"""Client library for the coordinator's API, used by agents and ``ftctl``: follows the leader across
replicas, retries only what is safe to retry, and explains failures in terms an operator can act on.

A standby answers UNAVAILABLE with the leader's address in the ``ftd-leader`` trailing metadata; the
client switches to it. A request refused by a standby was not processed, so even a non-idempotent
call may be re-sent to the leader; any other failure of a non-idempotent call is raised as is.

Transport security: ``tls`` is the caller's identity (:class:`~ftd.identity.IdentityFiles`: agents as
``node/<id>``, rendezvous handlers as ``rendezvous/<id>``, ``ftctl`` as an operator). The client
checks the files' stamp at most once a second; after a rotation, new calls go over channels opened
with the new certificate, while calls in flight (a heartbeat stream) keep their connection. Without
``tls`` the client uses the identity registered for those endpoints by :func:`remember_identity`
(what :func:`ftd.ftctl.localcluster.up` does for the cluster it started), else plaintext. Over TLS the
server must present a coordinator's certificate (:data:`~ftd.identity.COORDINATOR_SERVER_NAME`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import grpc

from ftd.identity import COORDINATOR_SERVER_NAME, IdentityFiles, PkiError, TlsMaterial
from ftd.rpc import NEVER_IDLE, Tls, connect_now, parse_endpoints, rpc_code, rpc_details
from ftd.rpc import channel as open_channel
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("ftd.client")
LEADER_METADATA_KEY = "ftd-leader"
ROTATION_CHECK_S = 1.0  # how often a client looks for a rotated certificate
_RETIRED_KEPT = 4  # channels of older certificates kept open for the calls still running on them

# endpoint -> the identity to dial it with when a client is given none (remember_identity)
_REMEMBERED: dict[str, Tls] = {}
_REMEMBERED_LOCK = threading.Lock()


def remember_identity(endpoints: str | Sequence[str], tls: Tls) -> None:
    """Clients of this process made without ``tls`` dial ``endpoints`` with ``tls``: how the process
    that started a local cluster (and holds its operator certificate) reaches it by default."""
    with _REMEMBERED_LOCK:
        for endpoint in parse_endpoints(endpoints, "coordinator endpoint"):
            _REMEMBERED[endpoint] = tls


def remembered_identity(endpoints: str | Sequence[str]) -> Tls | None:
    """The identity :func:`remember_identity` registered for any of ``endpoints``, else ``None``."""
    with _REMEMBERED_LOCK:
        for endpoint in parse_endpoints(endpoints, "coordinator endpoint"):
            if endpoint in _REMEMBERED:
                return _REMEMBERED[endpoint]
    return None


class CoordinatorUnreachable(ConnectionError):
    """No replica answered as leader; names every endpoint tried and the last error."""

    def __init__(self, endpoints: Sequence[str], last: str, tls: bool = True) -> None:
        hint = "" if tls else (" If the coordinators use mTLS (pki_dir), give ftctl the PKI directory "
                               "(--pki-dir or FTD_PKI_DIR): a plaintext client is refused during the handshake.")
        super().__init__(
            f"no coordinator leader reachable at {','.join(endpoints)} (last error: {last}). "
            "Check that ftd-coordinator runs there (systemctl status ftd-coordinator), that etcd is up, "
            f"and that --coordinator / FTD_COORDINATOR names the right HOST:PORT list.{hint}"
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


def next_endpoint(endpoints: Sequence[str], current: str, broken: Collection[str] = ()) -> str:
    """The endpoint to try after ``current`` when no leader was named: the next configured one whose
    connection is not known broken, else simply the next. A SIGKILLed replica refuses connections; in
    plain rotation every other try of a two-replica cluster's failover went there and cost a backoff.
    ``current`` itself comes last (a standby that knows no leader yet is worth asking again)."""
    index = list(endpoints).index(current) if current in endpoints else -1
    order = [endpoints[(index + k) % len(endpoints)] for k in range(1, len(endpoints) + 1)]
    return next((e for e in order if e not in broken), order[0])


class CoordinatorClient:
    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 5.0, tls: Tls | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoints = parse_endpoints(endpoints, "coordinator endpoint")
        self.timeout_s = timeout_s
        self.tls = tls if tls is not None else remembered_identity(self.endpoints)
        self.clock = clock
        self._current = self.endpoints[0]
        self._channels: dict[str, grpc.Channel] = {}
        self.broken: set[str] = set()  # endpoints whose channel is in TRANSIENT_FAILURE now (follow skips them)
        self._retired: list[grpc.Channel] = []
        self._lock = threading.Lock()
        # The certificate the channels are opened with: read once here (a bad identity fails now,
        # naming the file), again after its files change on disk.
        self._material: TlsMaterial | None = None
        self._stamp: tuple[tuple[int, int, int], ...] = ()
        self._refused: tuple[tuple[int, int, int], ...] = ()
        self._checked_at = clock()
        self.rotations = 0
        if isinstance(self.tls, IdentityFiles):
            self._stamp = self.tls.stamp()
            self._material = self.tls.load()
        elif isinstance(self.tls, TlsMaterial):
            self._material = self.tls

    @property
    def current(self) -> str:
        return self._current

    def _check_rotation(self) -> None:
        """At most every :data:`ROTATION_CHECK_S`: when the identity's files changed and check out,
        later calls use channels with the new certificate (caller holds the lock). Channels of the
        old one stay open for the calls still running on them (a heartbeat stream)."""
        files = self.tls
        now = self.clock()
        if not isinstance(files, IdentityFiles) or now - self._checked_at < ROTATION_CHECK_S:
            return
        self._checked_at = now
        stamp = files.stamp()
        if stamp in (self._stamp, self._refused):
            return
        try:
            material = files.load(attempts=3)
        except PkiError as exc:  # half copied, expired, another CA: keep the current certificate
            log.warning("keeping the current certificate of %s/%s: %s", files.kind, files.name, exc)
            self._refused = stamp
            return
        self._stamp, self._material, self.rotations = files.stamp(), material, self.rotations + 1
        self._retired.extend(self._channels.values())
        self._channels.clear()
        while len(self._retired) > _RETIRED_KEPT:
            self._retired.pop(0).close()
        log.info("using the rotated certificate of %s/%s for new calls", files.kind, files.name)

    def stub(self, endpoint: str | None = None) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self._channel(endpoint or self._current))

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            self._check_rotation()
            channel = self._channels.get(endpoint)
            if channel is None:
                # The server must prove it is a coordinator (its certificate's coordinator.ftd.internal), not
                # only some certificate of the CA for this address: a node's would do for 127.0.0.1.
                channel = open_channel(endpoint, NEVER_IDLE, tls=self._material, server_name=COORDINATOR_SERVER_NAME)
                self._channels[endpoint] = channel
                channel.subscribe(self._watch(endpoint, channel))
        return channel

    def _watch(self, endpoint: str, channel: grpc.Channel) -> Callable[[grpc.ChannelConnectivity], None]:
        """Keeps :attr:`broken` in step with ``channel``'s state (called on gRPC's thread)."""
        def seen(state: grpc.ChannelConnectivity) -> None:
            if self._channels.get(endpoint) is not channel:  # retired by a rotation: its state says nothing
                return
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                self.broken.add(endpoint)
            else:
                self.broken.discard(endpoint)
        return seen

    def warm(self) -> list[str]:
        """Connects the channel of every other configured endpoint now, while its replica is a quiet
        standby: when the leader dies, thousands of agents move their streams to the new leader over
        connections already up instead of all handshaking TLS with it at once. Returns those endpoints."""
        others = [e for e in self.endpoints if e != self._current]
        for endpoint in others:
            connect_now(self._channel(endpoint))
        return others

    def follow(self, exc: BaseException) -> bool:
        """Moves to the next endpoint to try after ``exc``: the named leader if any, else the next
        configured endpoint. Returns whether the request is known not to have been processed."""
        hint = leader_hint(exc)
        if hint:
            self._current = hint
            return True
        self._current = next_endpoint(self.endpoints, self._current, self.broken)
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
                raise CoordinatorUnreachable(self.endpoints, last, tls=self.tls is not None)
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

    def nodes(self, max_pages: int = 1000, **kw: Any) -> coordinator_pb2.ListNodesResponse:
        """Every registered node: the pages (at most ``max_pages``) joined into one answer."""
        out = coordinator_pb2.ListNodesResponse()
        token = ""
        for _ in range(max_pages):
            page = self.call("ListNodes", coordinator_pb2.ListNodesRequest(page_token=token), idempotent=True, **kw)
            out.nodes.extend(page.nodes)
            token = page.next_page_token
            if not token:
                break
        return out

    def checkpoints(self, job: str, max_pages: int = 1000, **kw: Any) -> list[checkpoint_pb2.CheckpointInfo]:
        """Every checkpoint of ``job`` in step order, following the catalog's pages."""
        out: list[checkpoint_pb2.CheckpointInfo] = []
        token = ""
        for _ in range(max_pages):
            page = self.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=job, page_token=token),
                             idempotent=True, **kw)
            out.extend(page.checkpoints)
            token = page.next_page_token
            if not token:
                break
        return out

    def events(self, limit: int = 100, **kw: Any) -> coordinator_pb2.ListEventsResponse:
        return self.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=limit), idempotent=True, **kw)  # type: ignore[no-any-return]

    def events_after(self, after_seq: int, limit: int = 1000, **kw: Any) -> list[cluster_pb2.Event]:
        """Every event after ``after_seq`` (0: all), oldest first, following the pages: how a watcher
        follows the log, from the newest ``seq`` it has seen."""
        out: list[cluster_pb2.Event] = []
        while True:
            page = self.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=limit, after_seq=after_seq),
                             idempotent=True, **kw)
            out.extend(page.events)
            if not page.next_page_token or not page.events:
                return out
            after_seq = page.events[-1].seq

    def register(self, request: coordinator_pb2.RegisterRequest, **kw: Any) -> coordinator_pb2.RegisterResponse:
        # Idempotent: the same incarnation registering twice is answered "already registered".
        return self.call("Register", request, idempotent=True, **kw)  # type: ignore[no-any-return]

    def heartbeat_stream(self, requests: Iterator[coordinator_pb2.HeartbeatRequest]) -> Any:
        """Opens a heartbeat stream to the current endpoint; the caller follows refusals."""
        return self.stub().Heartbeat(requests)

    def close(self) -> None:
        with self._lock:
            for channel in [*self._channels.values(), *self._retired]:
                channel.close()
            self._channels.clear()
            self._retired.clear()
