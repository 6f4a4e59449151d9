"""The leader's UDP beacon port: liveness without a gRPC message per heartbeat.

Each heartbeat stream gets a fresh key and key id on its first answer (:class:`BeaconBook`); a beacon
(:mod:`ftd.beacons`) that names a key the leader gave, the node of that key's stream, verifies under the
key and carries a seq above the last one accepted refreshes that node's liveness exactly as a stream
heartbeat does (:func:`admit`, pure). Everything else is dropped and counted by a bounded reason. The
handler runs on the event loop (no locks: the stream code runs there too) and stays tiny: a decode, a
dict lookup, one HMAC.

When a beaconing node falls silent the leader asks instead of guessing (:func:`probe_due`): one
``HeartbeatResponse(probe=true)`` on its stream, which a live agent answers at once on the stream.

Every :data:`ECHO_EVERY_S` of a stream's accepted beacons the leader sends one echo back to where the
beacon came from (:func:`echo_due`, ``ftd.beacons.encode_echo``): the agent's proof that the leader lives,
so its stream goes quiet both ways and the leader answers a quiet stream's messages only with news.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from ftd import beacons
from ftd.v1 import coordinator_pb2

log = logging.getLogger("ftd.coordinator")

DROP_REASONS = ("malformed", "unknown_key", "wrong_node", "bad_mac", "replay", "not_leader")
RECEIVE_BUFFER_BYTES = 4 << 20  # beacons that arrive while the event loop runs a tick or a burst of messages
SMALL_BUFFER_BYTES = 1 << 20  # below this (net.core.rmem_max) a busy loop loses beacons: said at start
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux: past rmem_max, with CAP_NET_ADMIN
MAX_BATCH = 512  # datagrams read per wake-up of the event loop
# A stream's beacons are echoed about this often: the agent gives the leader up after ~7 s without an
# answer or an echo (coordinator_timeout_s + beacon_keepalive_s), so two echoes may be lost before it does.
ECHO_EVERY_S = 2.0
DRAIN_LIMIT = 100_000  # datagrams read before a tick judges (a 4 MiB buffer holds a few thousand)
SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)  # Linux: the socket's memory counters, drops the ninth
SK_MEMINFO_VARS = 9


@dataclass(slots=True)
class BeaconKey:
    """One stream's key: who it speaks for, and the newest seq accepted under it."""

    node_id: str
    key_id: int
    key: bytes
    seq_seen: int = 0
    echoed: int = 0  # the seq_seen of the last echo sent (0: none yet)


class BeaconBook:
    """The leader's beacon keys by key id, one per open heartbeat stream. Ids start at a random
    point, so a beacon for a previous leader's key id finds no key (or one whose MAC it fails)."""

    def __init__(self, port: int, interval_s: float, host: str = "", answer_interval_s: float = 0.0) -> None:
        self.port = port
        self.interval_s = interval_s
        self.answer_interval_s = answer_interval_s  # a quiet stream's answers, at least this often
        self.host = host  # the leader's advertised host ("" : agents use the host they dialed)
        self.keys: dict[int, BeaconKey] = {}
        self._next = secrets.randbelow(beacons.MAX_KEY_ID + 1)

    def issue(self, node_id: str) -> BeaconKey:
        while True:
            self._next = (self._next + 1) & beacons.MAX_KEY_ID
            if self._next not in self.keys:
                break
        entry = BeaconKey(node_id, self._next, beacons.new_key())
        self.keys[entry.key_id] = entry
        return entry

    def revoke(self, entry: BeaconKey | None) -> None:
        if entry is not None and self.keys.get(entry.key_id) is entry:
            del self.keys[entry.key_id]

    def clear(self) -> None:
        self.keys.clear()

    def target(self, entry: BeaconKey) -> coordinator_pb2.BeaconTarget:
        return coordinator_pb2.BeaconTarget(port=self.port, key=entry.key, key_id=entry.key_id,
                                            interval_s=self.interval_s, host=self.host,
                                            answer_interval_s=self.answer_interval_s)


def admit(beacon: beacons.Beacon, entry: BeaconKey | None) -> str | None:
    """Why a decoded beacon is dropped (one of :data:`DROP_REASONS`), or None: it proves its stream's
    node alive. The caller records ``beacon.seq`` as seen only when it is admitted."""
    if entry is None:
        return "unknown_key"
    if beacon.node_id != entry.node_id:
        return "wrong_node"
    if not beacons.verify(beacon, entry.key):
        return "bad_mac"
    if beacon.seq <= entry.seq_seen:
        return "replay"
    return None


def echo_due(seq_seen: int, echoed: int, beacon_interval_s: float) -> bool:
    """Whether the beacon just accepted (``seq_seen``) gets an echo: the stream's first, then one per
    :data:`ECHO_EVERY_S` of beacons (``echoed``: the seq of the last echo)."""
    every = max(1, round(ECHO_EVERY_S / beacon_interval_s)) if beacon_interval_s > 0 else 1
    return echoed == 0 or seq_seen - echoed >= every


def probe_due(now: float, last_seen: float, beaconing: bool, probed_at: float | None,
              suspect_after_s: float) -> str | None:
    """Whether to push a probe on a node's stream, with why: it beacons (its stream is quiet by design),
    its silence passed ``suspect_after_s`` and it was not probed since it was last seen (one probe per
    silence). A node that does not beacon is judged on its stream heartbeats as always."""
    if not beaconing:
        return None
    silent = now - last_seen
    if silent < suspect_after_s or (probed_at is not None and probed_at >= last_seen):
        return None
    return f"no beacon for {silent:.2f}s (suspect_after_s={suspect_after_s:g}): probing on the stream"


def judged_on_beacons(now: float, last_judged: float | None, stall_after_s: float, lost: bool,
                      beaconing: Callable[[], Iterable[str]]) -> frozenset[str]:
    """The nodes judged on their own evidence though the leader did not judge for longer than
    ``stall_after_s`` (detector.judge's ``watched``): those beaconing on an open stream (``beaconing``,
    asked only then), provided the beacon port ``lost`` no datagram since the last judgement: whatever
    they sent waited in the socket and was read before this judgement. Their deaths are then declared
    on time instead of after a grace of ``dead_after_s`` granted to all; a full buffer, a port that
    cannot say, or a node judged on its stream keep the grace."""
    if lost or last_judged is None or now - last_judged <= stall_after_s:
        return frozenset()
    return frozenset(beaconing())


def answer_due(now: float, last_write: float, quiet: bool, ack_interval_s: float, quiet_interval_s: float) -> bool:
    """Whether a stream's message is answered (news aside): at most every ``ack_interval_s``; a quiet
    stream's (``quiet_interval_s`` > 0) at most every ``quiet_interval_s``."""
    interval = quiet_interval_s if quiet and quiet_interval_s > 0 else ack_interval_s
    return now - last_write >= interval


class BeaconProtocol:
    """Decodes every datagram and hands beacons to ``on_beacon`` (the membership's), which returns a
    drop reason or None; counts both. :meth:`drain` reads every datagram waiting on the socket per
    wake-up of the event loop (asyncio's datagram transport takes one per wake-up)."""

    def __init__(self, on_beacon: Callable[[beacons.Beacon], str | None], accepted: Counter,
                 dropped: Counter, echo: Callable[[beacons.Beacon], bytes | None] = lambda beacon: None,
                 echoes: Counter | None = None) -> None:
        self.on_beacon = on_beacon
        self.echo = echo  # the echo owed to an accepted beacon, if any (the membership's)
        self.accepted = accepted
        self.echoes = echoes
        self.dropped = {reason: dropped.labels(reason) for reason in DROP_REASONS}

    def datagram_received(self, data: bytes, addr: Any, sock: socket.socket | None = None) -> None:
        beacon = beacons.decode(data)
        reason = "malformed" if isinstance(beacon, str) else self.on_beacon(beacon)
        if reason is not None:
            self.dropped[reason].inc()
            return
        self.accepted.inc()
        assert not isinstance(beacon, str)
        echo = self.echo(beacon) if sock is not None and addr else None
        if echo is not None and sock is not None:
            try:
                sock.sendto(echo, addr)
            except OSError as exc:  # a full send buffer, an unreachable agent: the stream's answers cover it
                log.debug("beacon echo to %s: %s", addr, exc)
                return
            if self.echoes is not None:
                self.echoes.inc()

    def drain(self, sock: socket.socket, limit: int = 0) -> None:
        """Everything waiting, up to ``limit`` datagrams (0: :data:`MAX_BATCH`; the loop runs other work
        and comes back)."""
        for _ in range(limit or MAX_BATCH):
            try:
                data, addr = sock.recvfrom(beacons.MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error of some earlier send: nothing to do
                log.debug("beacon socket: %s", exc)
                return
            self.datagram_received(data, addr, sock)


class BeaconPort:
    """The bound beacon socket, read on the event loop."""

    def __init__(self, sock: socket.socket, protocol: BeaconProtocol) -> None:
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), protocol.drain, sock)
        self.protocol = protocol
        self._drops = socket_drops(sock)

    def drain(self) -> None:
        """Every beacon waiting now (before a tick judges silences), bounded."""
        self.protocol.drain(self.sock, DRAIN_LIMIT)

    def lost(self) -> bool:
        """Whether the kernel dropped datagrams on this port since the last call (a full receive buffer),
        or cannot say: then a gap of the leader's may have lost beacons (:func:`judged_on_beacons`)."""
        before, self._drops = self._drops, socket_drops(self.sock)
        return before is None or self._drops is None or self._drops != before

    def close(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


def socket_drops(sock: socket.socket) -> int | None:
    """Datagrams the kernel dropped at ``sock`` since it was opened (``SO_MEMINFO``), or None where the
    option is missing (not Linux, a kernel before 3.19)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * SK_MEMINFO_VARS)
    except OSError:
        return None
    return struct.unpack_from("=I", raw, 4 * (SK_MEMINFO_VARS - 1))[0] if len(raw) >= 4 * SK_MEMINFO_VARS else None


async def listen(host: str, port: int, protocol: BeaconProtocol) -> tuple[BeaconPort, int]:
    """Binds the beacon port (``port`` 0: a free one) on the running loop; returns the transport and
    the bound port. The receive buffer is asked large: each datagram takes ~1 KiB of it in the kernel,
    and 20,000 beacons a second arrive while a tick runs; a small one (net.core.rmem_max) is logged."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER_BYTES)
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < RECEIVE_BUFFER_BYTES:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        if size < SMALL_BUFFER_BYTES:
            log.warning("the beacon port's receive buffer is %d KiB (net.core.rmem_max): beacons that arrive "
                        "while the leader is busy may be lost (probes then ask on the stream); raise it to "
                        "%d MiB", size >> 10, RECEIVE_BUFFER_BYTES >> 20)
        sock.bind((host.strip("[]"), port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    bound = BeaconPort(sock, protocol)
    return bound, bound.port
