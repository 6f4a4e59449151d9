"""Per-peer limits on the agent's data plane: concurrent shard streams and bytes in flight per peer
identity, and a per-chunk deadline on every stream.

Eight idle ``WriteShard`` streams from one node used to hold every worker thread of an agent, and its
own training's calls on the Unix socket then timed out. Now every peer call that moves a shard
(``ReadShard``, ``WriteShard``, ``OpenShard`` and the bulk send of its offer, ``PullReplica``) holds a
:class:`Ticket` of its peer: at most ``max_streams`` at once and ``max_bytes`` of shards in flight
per peer (:func:`admission`: ``RESOURCE_EXHAUSTED`` naming the peer and the limit), and a stream that
moves no chunk for ``idle_timeout_s`` is cancelled (:meth:`PeerLimiter.reap`, run by a watchdog
thread). Calls on the Unix socket (the training's own) never take a ticket, and are served by their
own server and threads (agent/daemon.py), so no peer can starve them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import PeerBusy

log = logging.getLogger("ftd.agent.peer_limits")


@dataclass(frozen=True)
class Limits:
    max_streams: int  # concurrent streams per peer
    max_bytes: int  # bytes of shards in flight per peer
    idle_timeout_s: float  # a stream moving no chunk this long is cancelled


def admission(peer: str, streams: int, held_bytes: int, more_bytes: int, limits: Limits,
              new_stream: bool) -> str | None:
    """Why ``peer`` (holding ``streams`` streams and ``held_bytes``) may not open one more stream
    (``new_stream``) or add ``more_bytes`` to one; None when it may."""
    if new_stream and streams >= limits.max_streams:
        return (f"peer {peer} has {streams} shard streams open on this node: the limit is {limits.max_streams} "
                "(peer_max_streams)")
    if more_bytes > 0 and held_bytes + more_bytes > limits.max_bytes:
        return (f"peer {peer} would have {held_bytes + more_bytes} bytes of shards in flight on this node: the limit "
                f"is {limits.max_bytes} (peer_max_inflight_mb)")
    return None


def idle(tickets: list[Ticket], now: float, timeout_s: float) -> list[Ticket]:
    """The tickets whose stream moved no chunk for ``timeout_s`` (and that can be cancelled)."""
    return [t for t in tickets if t.cancel is not None and now - t.last_active > timeout_s]


@dataclass(eq=False)
class Ticket:
    """One stream of ``peer``: its bytes in flight, its last chunk's time, how to cancel it."""

    limiter: PeerLimiter
    peer: str
    what: str
    last_active: float
    cancel: Callable[[], None] | None = None
    bytes: int = 0
    released: bool = field(default=False)

    def touch(self) -> None:
        """A chunk moved: the stream is alive."""
        self.last_active = self.limiter.clock()

    def reserve(self, n: int) -> None:
        """Adds ``n`` bytes to the peer's bytes in flight; :class:`~.errors.PeerBusy` over the limit."""
        self.limiter.reserve(self, n)

    def release(self) -> None:
        self.limiter.release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PeerLimiter:
    """The tickets of every peer, and the watchdog cancelling idle streams."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._tickets: dict[str, list[Ticket]] = {}
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.refused = 0
        self.cancelled = 0

    def admit(self, peer: str, what: str, cancel: Callable[[], None] | None = None) -> Ticket:
        """A new stream of ``peer``; :class:`~.errors.PeerBusy` naming the peer and the limit."""
        with self._lock:
            held = self._tickets.get(peer, [])
            why = admission(peer, len(held), sum(t.bytes for t in held), 0, self.limits, True)
            if why is not None:
                self.refused += 1
                raise PeerBusy(f"{what}: {why}")
            ticket = Ticket(self, peer, what, self.clock(), cancel)
            self._tickets.setdefault(peer, []).append(ticket)
        if cancel is not None:
            self._start_watchdog()
        return ticket

    def reserve(self, ticket: Ticket, n: int) -> None:
        with self._lock:
            held = self._tickets.get(ticket.peer, [])
            why = admission(ticket.peer, len(held), sum(t.bytes for t in held), n, self.limits, False)
            if why is not None:
                self.refused += 1
                raise PeerBusy(f"{ticket.what}: {why}")
            ticket.bytes += n

    def release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            held = self._tickets.get(ticket.peer, [])
            if ticket in held:
                held.remove(ticket)
            if not held:
                self._tickets.pop(ticket.peer, None)

    def streams(self, peer: str) -> int:
        with self._lock:
            return len(self._tickets.get(peer, []))

    def reap(self) -> list[Ticket]:
        """Cancels the streams idle past the deadline (each is released by its own handler's exit)."""
        with self._lock:
            found = idle([t for held in self._tickets.values() for t in held], self.clock(),
                         self.limits.idle_timeout_s)
        for ticket in found:
            log.warning("%s: peer %s moved no chunk for %.0f s: cancelled", ticket.what, ticket.peer,
                        self.limits.idle_timeout_s)
            self.cancelled += 1
            assert ticket.cancel is not None
            ticket.cancel()
            ticket.cancel = None  # once
        return found

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None:
                return
            self._watchdog = threading.Thread(target=self._watch, name="ftd-peer-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        period = max(0.05, min(1.0, self.limits.idle_timeout_s / 4))
        while not self._stop.wait(period):
            self.reap()

    def close(self) -> None:
        self._stop.set()


__all__ = ["Limits", "PeerLimiter", "Ticket", "admission", "idle"]
