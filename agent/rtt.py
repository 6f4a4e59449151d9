"""Network round-trip time from this node to the coordinator and a few peers: ``ftd_agent_peer_rtt_seconds``.

The probe is a TCP handshake: ``connect()`` to the peer agent's (or the coordinator's) gRPC port returns
once the kernel has sent the SYN and received the SYN-ACK, so its duration is one network round trip
plus the local kernel's work, with nothing to run in Python on the far side (the far kernel answers the
SYN by itself). The socket is closed at once with SO_LINGER 0, a RST instead of a FIN handshake, so no
TIME_WAIT piles up on either side; the far gRPC server accepts a connection that is already reset and
drops it. Each probe is bounded by a timeout; a timeout, a refused connection or any other error is a
lost probe (``ftd_agent_peer_probe_failures_total``), never an RTT.

Whom to probe (:func:`targets`): the coordinator (label ``coordinator``), the node's rank neighbours in
the world (rank-1 and rank+1, wrapping: the ring neighbours of a ring all-reduce) and its buddy (the
peer holding its in-memory replicas), deduplicated, at most 4, so the ``peer`` label stays a small
bounded set (node ids and ``coordinator``). The neighbours' and the buddy's addresses are the ones the
coordinator sends in the node's assignment (:func:`plan`).

What the figure means: through both kernels' TCP stacks and a Python thread (its wake-up after
``connect()`` returns, the GIL) a warmed-up handshake on loopback, with no network at all, already takes
about 10-20 us (p50), where an RDMA small-message round trip on InfiniBand/RoCE takes a few us. See
docs/operations.md, "ftdnetworklatencyhigh".
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from ftd.v1 import cluster_pb2

from .peers import Peer, buddy_of, ranked

log = logging.getLogger("ftd.agent.rtt")

COORDINATOR = "coordinator"  # the `peer` label of the coordinator (its leader's address changes on failover)
MAX_TARGETS = 4  # the coordinator, two rank neighbours, the buddy
# 10 us ... 1 s, dense around the seed's 50 us threshold: a bucket bound at exactly 50e-6 makes the
# alert's p50 > 50e-6 mean "more than half of the probes took longer than 50 us".
RTT_BUCKETS = (1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)
# l_onoff = 1, l_linger = 0: close() sends a RST and frees the socket at once (no TIME_WAIT).
_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass(frozen=True)
class Target:
    name: str  # the `peer` label: a node id, or "coordinator"
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` as (host, port); ValueError when it is neither."""
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {address!r}")
    return host, int(port)


def _target(name: str, address: str) -> Target | None:
    try:
        host, port = split_address(address)
    except ValueError:
        return None
    return Target(name, host, port)


def targets(me: str, world: Sequence[Peer], buddy: Peer | None, coordinator: str) -> list[Target]:
    """Whom node ``me`` probes, in this order: the coordinator (``coordinator`` is the leader's
    HOST:PORT, "" when none is known), the rank neighbours rank-1 and rank+1 (``world`` is the world in
    rank order, ``world[r]`` holding rank r, wrapping around its ends; none when ``me`` is not in it, a
    spare), then the buddy. Deduplicated by node id, at most :data:`MAX_TARGETS`. A peer that is not
    alive or has no usable address is left out (nothing to measure there; its death is the coordinator's
    business)."""
    chosen: list[Target] = []

    def add(target: Target | None) -> None:
        if target is None or len(chosen) >= MAX_TARGETS:
            return
        if any(t.name == target.name or (t.host, t.port) == (target.host, target.port) for t in chosen):
            return
        chosen.append(target)

    def add_peer(peer: Peer | None) -> None:
        if peer is not None and peer.alive and peer.node_id not in (me, COORDINATOR):
            add(_target(peer.node_id, peer.address))

    if coordinator:
        add(_target(COORDINATOR, coordinator))
    ids = [p.node_id for p in world]
    if me in ids:
        rank, size = ids.index(me), len(world)
        add_peer(world[(rank - 1) % size])
        add_peer(world[(rank + 1) % size])
    add_peer(buddy)
    return chosen


def plan(me: str, assignment: cluster_pb2.Assignment, coordinator: str) -> list[Target]:
    """:func:`targets` from node ``me``'s assignment: the world in rank order with the addresses the
    coordinator sent (``Assignment.peers``: a rank it names no address for, a dead or fenced node, counts
    as not alive), the buddy it chose, and ``coordinator``, the leader's address."""
    buddy = buddy_of(assignment)
    told = Peer(buddy.node_id, buddy.address, bool(buddy.address)) if buddy.node_id else None
    return targets(me, ranked(me, assignment), told, coordinator)


# ---- the probe ---------------------------------------------------------------------------------------------


def resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]]:
    """The first TCP address of host:port (a name lookup, kept out of the timed part); OSError when none."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return family, tuple(sockaddr)


def connect_rtt(family: socket.AddressFamily, sockaddr: tuple[object, ...], timeout_s: float) -> float:
    """Seconds ``connect()`` took (SYN sent to SYN-ACK received), the socket reset at once. Raises
    OSError for a lost probe: TimeoutError after ``timeout_s``, ConnectionRefusedError (nothing
    listens: the far kernel answered with a RST, which is no RTT of a working peer), others."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        sock.settimeout(timeout_s)
        start = time.perf_counter_ns()
        sock.connect(sockaddr)
        elapsed = time.perf_counter_ns() - start
    finally:
        sock.close()
    return elapsed / 1e9


def handshake_rtt(host: str, port: int, timeout_s: float = 1.0) -> float:
    """One probe of host:port: the TCP handshake's duration in seconds (see :func:`connect_rtt`)."""
    family, sockaddr = resolve(host, port)
    return connect_rtt(family, sockaddr, timeout_s)


def _reason(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, socket.gaierror):
        return "unresolved"
    return type(exc).__name__


# ---- metrics -----------------------------------------------------------------------------------------------


class RttMetrics:
    """``ftd_agent_peer_rtt_seconds{peer}`` (histogram) and ``ftd_agent_peer_probe_failures_total{peer}``.

    Registered on the agent's registry next to :class:`ftd.agent.metrics.AgentMetrics`. Only the peers
    being probed have label sets (:meth:`retain`), created at zero so that the first failure is an
    increase."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.rtt = Histogram("ftd_agent_peer_rtt_seconds",
                             "Network round-trip time to a peer: the TCP handshake of connect() to its gRPC port "
                             "(peer = a node id, or coordinator)", ["peer"], buckets=RTT_BUCKETS,
                             registry=self.registry)
        self.failures = Counter("ftd_agent_peer_probe_failures_total",
                                "RTT probes lost: timed out, refused or failed otherwise (peer as in "
                                "ftd_agent_peer_rtt_seconds)", ["peer"], registry=self.registry)
        self._peers: set[str] = set()
        self._lock = threading.Lock()

    @property
    def peers(self) -> set[str]:
        with self._lock:
            return set(self._peers)

    def retain(self, peers: Iterable[str]) -> None:
        """Exactly these peers have label sets from now on: new ones start at zero, the others are removed."""
        keep = set(peers)
        with self._lock:
            for gone in self._peers - keep:
                self.rtt.remove(gone)
                self.failures.remove(gone)
            for new in keep - self._peers:
                self.rtt.labels(new)
                self.failures.labels(new)
            self._peers = keep

    def observe(self, peer: str, seconds: float) -> None:
        with self._lock:
            self._peers.add(peer)
            self.rtt.labels(peer).observe(seconds)
            self.failures.labels(peer)

    def failed(self, peer: str) -> None:
        with self._lock:
            self._peers.add(peer)
            self.rtt.labels(peer)
            self.failures.labels(peer).inc()


# ---- the prober thread -------------------------------------------------------------------------------------


@dataclass
class PeerStats:
    """One target's probes of the last complete round (seconds), and its lost probes."""

    target: Target
    rtts: list[float]
    failures: int
    last_error: str = ""


Probe = Callable[[socket.AddressFamily, tuple[object, ...], float], float]


class RttProber:
    """Probes its targets every ``interval_s``: ``probes`` handshakes per target per round, spread over
    the round (a sweep over all targets every ``interval_s / probes``) so that one short burst of
    traffic does not decide a whole round. Targets are set from outside (:meth:`set_targets`) and taken
    at the start of each round, when the metrics' label sets follow them.

    Each measured handshake is preceded by ``warmup`` handshakes to the same target whose times are
    discarded: a probe that runs after a pause finds the CPU's caches and the kernel's TCP path cold, and
    on loopback that alone turned a ~15 us handshake into ~80 us (p50, probes 200 ms apart; see
    docs/operations.md#ftdnetworklatencyhigh). The warm-up makes the figure the network's, not the host's;
    it doubles the handshakes (4 targets x 5 probes x 2 per 5 s).

    Bounded: at most :data:`MAX_TARGETS` targets, each probe at most ``timeout_s`` (a warm-up that fails
    loses the probe at once), and :meth:`stop` returns within about one probe's timeout."""

    def __init__(self, metrics: RttMetrics, *, interval_s: float = 5.0, probes: int = 5, timeout_s: float = 0.5,
                 warmup: int = 1, probe: Probe = connect_rtt) -> None:
        if interval_s <= 0 or probes < 1 or timeout_s <= 0 or warmup < 0:
            raise ValueError(f"interval_s > 0, probes >= 1, timeout_s > 0, warmup >= 0 needed, got {interval_s}, "
                             f"{probes}, {timeout_s}, {warmup}")
        self.metrics = metrics
        self.interval_s = interval_s
        self.probes = probes
        self.timeout_s = timeout_s
        self.warmup = warmup
        self.probe = probe
        self.rounds = 0  # complete rounds so far
        self.last_round: dict[str, PeerStats] = {}
        self._targets: list[Target] = []
        self._targets_lock = threading.Lock()
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def targets(self) -> list[Target]:
        with self._targets_lock:
            return list(self._targets)

    def set_targets(self, targets: Sequence[Target]) -> None:
        """Whom to probe from the next round on (:func:`targets` / :func:`plan`); at most MAX_TARGETS
        are kept, the first of each name."""
        unique: list[Target] = []
        for t in targets:
            if t.name not in {u.name for u in unique} and len(unique) < MAX_TARGETS:
                unique.append(t)
        with self._targets_lock:
            if unique != self._targets:
                log.info("rtt probes: %s", ", ".join(f"{t.name} ({t.address})" for t in unique) or "none")
            self._targets = unique

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the prober was already started")
        self._thread = threading.Thread(target=self._run, name="ftd-rtt", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stops probing; True when the thread ended within ``timeout_s`` (its label sets are then removed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        self.metrics.retain(())
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.probe_round()
            except Exception:  # a bug must not end the probing for the node's lifetime
                log.exception("rtt probe round failed")
                self._stop.wait(self.interval_s)

    def probe_round(self) -> dict[str, PeerStats]:
        """One round (about ``interval_s`` long): the thread's loop; call it directly only when no thread
        runs. Returns the round's figures per peer (also kept as :attr:`last_round` when it completed)."""
        started = time.monotonic()
        targets = self.targets
        self.metrics.retain(t.name for t in targets)
        self._failing &= {t.name for t in targets}
        stats = {t.name: PeerStats(t, [], 0) for t in targets}
        addresses = {t.name: self._resolve(t) for t in targets}  # once a round, out of the timed part
        gap = self.interval_s / self.probes
        for sweep in range(self.probes):
            for t in targets:
                if self._stop.is_set():
                    return stats
                resolved = addresses[t.name]
                if isinstance(resolved, OSError):  # no address: every probe of the round is lost
                    self._lost(t, stats[t.name], resolved)
                else:
                    self._probe_one(t, resolved, stats[t.name])
            if self._stop.wait(max(0.0, started + (sweep + 1) * gap - time.monotonic())):
                return stats
        self.last_round = stats
        self.rounds += 1
        return stats

    @staticmethod
    def _resolve(target: Target) -> tuple[socket.AddressFamily, tuple[object, ...]] | OSError:
        try:
            return resolve(target.host, target.port)
        except OSError as exc:
            return exc

    def _probe_one(self, target: Target, resolved: tuple[socket.AddressFamily, tuple[object, ...]],
                   stats: PeerStats) -> None:
        try:
            for _ in range(self.warmup):
                self.probe(resolved[0], resolved[1], self.timeout_s)
            seconds = self.probe(resolved[0], resolved[1], self.timeout_s)
        except OSError as exc:
            self._lost(target, stats, exc)
            return
        stats.rtts.append(seconds)
        self.metrics.observe(target.name, seconds)
        if target.name in self._failing:
            self._failing.discard(target.name)
            log.info("rtt probes of %s (%s) answer again", target.name, target.address)

    def _lost(self, target: Target, stats: PeerStats, exc: OSError) -> None:
        stats.failures += 1
        stats.last_error = _reason(exc)
        self.metrics.failed(target.name)
        if target.name not in self._failing:  # once per outage, not once per probe
            self._failing.add(target.name)
            log.warning("rtt probe of %s (%s) lost: %s (%s); counted in ftd_agent_peer_probe_failures_total",
                        target.name, target.address, stats.last_error, exc)
