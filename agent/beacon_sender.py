"""The agent's side of liveness beacons: a thread that sends them, and the pure rule of when the
heartbeat stream still needs a message.

The leader gives each stream a key (``BeaconTarget``); from then on this node's liveness rides on UDP
beacons (:mod:`ftd.beacons`) sent every ``interval_s`` by :class:`BeaconSender`'s own thread (no gRPC
call, health probe or training report can hold it up), and the stream carries only what changed
(:func:`stream_due`). A probe from the leader (its beacons stopped arriving) is answered on the stream
at once, and the stream heartbeats at full rate until an answer's ``beacon_seq_seen`` shows beacons
arriving again: a blocked UDP path costs stream messages, never a false death.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ftd import beacons
from ftd.v1 import cluster_pb2, coordinator_pb2

log = logging.getLogger("ftd.agent")


@dataclass(frozen=True)
class StreamPolicy:
    interval_s: float  # the heartbeat period: the stream's rate without beacons, or until they are confirmed
    keepalive_s: float  # with beacons, a stream message at least this often (its answer: the leader lives)
    progress_interval_s: float  # with beacons, a new step or memory report on the stream at most this often


@dataclass
class StreamState:
    """What this stream's messages said last, and where its beacons stand (one per stream)."""

    sent_at: float | None = None  # monotonic time of the last message (None: none yet)
    progress_at: float = -1e18  # of the last message carrying a new progress or memory report
    epoch: int = -1
    verdict: tuple[bool, str] | None = None
    progress: object = None  # the Progress object last sent (a new report is a new object)
    events: tuple[object, ...] = ()  # :func:`progress_events` of the last message
    confirmed: bool = False  # the leader has accepted a beacon sent after ``mark``
    mark: int = 0  # beacon seq the leader's beacon_seq_seen must pass to confirm them
    probed: bool = False  # a probe waits for its answer
    answer_interval_s: float = 0.0  # the leader answers a quiet stream at least this often (BeaconTarget's)
    sent_quiet: bool = False  # the last message said the stream is quiet (:func:`quiet`)


def confirmed(state: StreamState, beaconing: bool) -> bool:
    """Beacons carry this node's liveness and the leader has confirmed them; no probe waits for an answer."""
    return beaconing and state.confirmed and not state.probed


def quiet(state: StreamState, beaconing: bool, now: float, echo_at: float | None, policy: StreamPolicy) -> bool:
    """The stream is quiet: beacons carry this node's liveness, the leader confirmed them (no probe waits)
    and its echoes say it lives (one came within a keepalive's period). Its messages are news the leader
    answers only every ``state.answer_interval_s`` (0: a leader that answers everything)."""
    return (confirmed(state, beaconing) and state.answer_interval_s > 0
            and echo_at is not None and now - echo_at <= policy.keepalive_s)


def confirm_echo(state: StreamState, seen: int) -> None:
    """An echo of the leader (``seen``: the newest beacon it accepted) confirms beacons as an answer does."""
    if not state.probed and seen > state.mark:
        state.confirmed = True


def leader_silent(now: float, last_answer: float, echo_at: float | None, state: StreamState, beaconing: bool,
                  timeout_s: float, policy: StreamPolicy) -> str | None:
    """Why this agent gives its leader up (None: it lives). No answer and no echo for ``timeout_s``, or
    with confirmed beacons (the stream quiet by design) a keepalive's period more; and on a quiet stream no
    answer at all for the leader's answer interval more than that (echoes arrive, the stream does not)."""
    calm = confirmed(state, beaconing)
    limit = timeout_s + (policy.keepalive_s if calm else 0.0)
    heard = max(last_answer, echo_at) if echo_at is not None and calm else last_answer
    if now - heard > limit:
        return f"no answer{' or echo' if calm else ''} for {now - heard:.1f}s"
    if calm and state.answer_interval_s > 0 and now - last_answer > limit + state.answer_interval_s:
        return f"echoes but no answer on the stream for {now - last_answer:.1f}s"
    return None


def progress_events(progress: cluster_pb2.Progress) -> tuple[object, ...]:
    """What in a progress report is news the leader acts on at once, not a step's routine: a step
    anomaly (a rollback gathers them), a parked step (a hand-over waits for it), a restore."""
    return (progress.anomaly.SerializeToString() if progress.HasField("anomaly") else b"",
            progress.parked_step if progress.HasField("parked_step") else None,
            progress.restored.SerializeToString() if progress.HasField("restored") else b"")


def stream_due(now: float, beaconing: bool, state: StreamState, epoch: int, verdict: tuple[bool, str] | None,
               progress: object, memory_changed: bool, policy: StreamPolicy,
               events: tuple[object, ...] = (), calm: bool = False) -> str | None:
    """Why the stream needs a message now (None: the beacons say enough). Called every ``interval_s``;
    ``events``: :func:`progress_events` of ``progress``; ``calm``: :func:`quiet` now."""
    if state.sent_at is None:
        return "first message of the stream"
    if not beaconing:
        return "heartbeat"  # no beacons on this stream: every beat is a stream message
    if state.probed:
        return "probed by the leader"
    if not state.confirmed:
        return "beacons not confirmed by the leader yet"
    if state.sent_quiet and not calm:
        return "the leader's echoes stopped: its answer is wanted"
    if epoch != state.epoch:
        return "epoch changed"
    if verdict != state.verdict:
        return "health verdict changed"
    if events != state.events:
        return "training event (a step anomaly, a parked step or a restore)"
    if (memory_changed or progress is not state.progress) and now - state.progress_at >= policy.progress_interval_s:
        return "memory report changed" if memory_changed else "training progress"  # (a step's news, rate-limited)
    if now - state.sent_at >= policy.keepalive_s:
        return "keepalive"
    return None


def confirm(state: StreamState, response: coordinator_pb2.HeartbeatResponse, sent_seq: int) -> None:
    """An answer of the leader: a probe (answer on the stream now, and until beacons are seen again)
    or the newest beacon it accepted (``sent_seq``: the last one this node sent)."""
    if response.probe:
        state.probed, state.confirmed, state.mark = True, False, sent_seq
    elif response.beacon_seq_seen > state.mark:
        state.confirmed = True


class BeaconSender:
    """Sends this node's beacons to the leader's beacon port from a thread of its own, while a stream
    has given it a target (:meth:`aim`); :meth:`disarm` when the stream ends (the key dies with it)."""

    def __init__(self, node_id: str, interval_s: float, port_override: int = 0,
                 on_sent: Callable[[], None] = lambda: None) -> None:
        self.node_id = node_id
        self.on_sent = on_sent
        self.interval_s = interval_s
        self.port_override = port_override  # 0: the port the leader names
        self._lock = threading.Lock()
        self._target: tuple[str, int, int, bytes] | None = None  # host, port, key_id, key
        self._period = interval_s
        self._seq = 0
        self._echo: tuple[int, float | None] = (0, None)  # the leader's newest echo: (seen, monotonic time)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.sent = 0
        self.errors = 0

    def aim(self, host: str, target: coordinator_pb2.BeaconTarget) -> None:
        """A stream's target: beacons go to ``host`` (where this agent reached the leader) at its port,
        under its key, seqs from 1."""
        port = self.port_override or target.port
        with self._lock:
            self._target = (host, port, target.key_id, bytes(target.key))
            self._seq = 0
            self._echo = (0, None)
            self._period = min(self.interval_s, target.interval_s) if target.interval_s > 0 else self.interval_s
        self._wake.set()

    def disarm(self) -> None:
        with self._lock:
            self._target = None
            self._echo = (0, None)

    @property
    def aimed(self) -> bool:
        return self._target is not None

    @property
    def echo(self) -> tuple[int, float | None]:
        """The newest echo of the leader under the current key: (seen, when; None: none yet)."""
        return self._echo

    def _take_echoes(self, sock: socket.socket, key_id: int, key: bytes) -> None:
        """Reads the echoes waiting on the socket (the leader's answers to beacons, a few µs each for it)."""
        for _ in range(64):  # bounded: one every ECHO_EVERY_S is expected
            try:
                data = sock.recv(beacons.ECHO_BYTES + 1)
            except OSError:  # nothing waiting (or an ICMP error of an earlier send)
                return
            seen = beacons.decode_echo(data, key_id, key)
            if isinstance(seen, str):
                log.debug("datagram on the beacon socket dropped: %s", seen)
                continue
            with self._lock:
                if self._target is not None and self._target[2] == key_id and self._echo[0] < seen <= self._seq:
                    self._echo = (seen, time.monotonic())

    @property
    def seq(self) -> int:
        """The seq of the last beacon sent under the current key (0: none)."""
        return self._seq

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Blocks until :meth:`stop`: a beacon every period while aimed."""
        sock: socket.socket | None = None
        resolved: tuple[tuple[str, int], tuple[object, ...]] | None = None
        try:
            while not self._stop.is_set():
                with self._lock:
                    target, period = self._target, self._period
                    if target is not None:
                        self._seq += 1
                        seq = self._seq
                if target is not None:
                    host, port, key_id, key = target
                    try:
                        if resolved is None or resolved[0] != (host, port):
                            family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
                            if sock is not None:
                                sock.close()
                            sock = socket.socket(family, socket.SOCK_DGRAM)
                            sock.setblocking(False)
                            resolved = ((host, port), addr)
                        assert sock is not None
                        self._take_echoes(sock, key_id, key)
                        sock.sendto(beacons.encode(self.node_id, key_id, seq, key), resolved[1])
                        self.sent += 1
                        self.on_sent()
                    except (OSError, ValueError) as exc:  # unreachable, a full buffer: the probe covers it
                        self.errors += 1
                        if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                            log.warning("beacon to %s:%d not sent (%d so far): %s", host, port, self.errors, exc)
                self._wake.wait(period)
                self._wake.clear()
        finally:
            if sock is not None:
                sock.close()
