"""The cluster's deny list: identities and certificates revoked by an operator (``ftctl certs revoke``)
or by a rotation (``ftctl certs rotate`` revokes the old certificate's serial), checked on every call
by :class:`ftd.authz_interceptors.Guard` on the coordinator and on every agent.

The list lives in etcd (the coordinator's ``access/`` records, :mod:`ftd.coordinator.revocations`); the
leader coordinator decides from its view, agents from a copy they fetch from the coordinator
(``GetDenyList``) at most every ``ttl_s`` and whenever the version changes. An agent that cannot reach
the coordinator keeps the last list it had (a revocation is never forgotten for want of a network).

Pure parts here: :class:`DenyList` (the decision), :class:`DenyListCache` (when to fetch, as a
function of ``now``), :func:`serial_of_pem` (the peer certificate's serial, cached per certificate).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509

from ftd.authz import REVOKED
from ftd.identity import Identity
from ftd.throttle import LogThrottle
from ftd.v1 import coordinator_pb2

log = logging.getLogger("ftd.rpc")
_throttle = LogThrottle(log, 60.0)

REVOKED_RULE = REVOKED.name
DEFAULT_TTL_S = 5.0  # how stale an agent's copy may be: a revocation reaches every agent within this


@dataclass(frozen=True)
class DenyList:
    """Revoked identities (``kind/name`` → reason) and certificate serials (lower-case hex → reason)."""

    identities: Mapping[str, str] = field(default_factory=dict)
    serials: Mapping[str, str] = field(default_factory=dict)

    @property
    def version(self) -> int:
        """Changes whenever an entry is added or removed (an agent fetches the list only then)."""
        text = "\n".join([*(f"i {k}" for k in sorted(self.identities)), *(f"s {k}" for k in sorted(self.serials))])
        return zlib.crc32(text.encode()) | (len(self.identities) + len(self.serials)) << 32

    def refusal(self, identity: Identity, serial: str | None) -> str | None:
        """Why ``identity`` (presenting the certificate with ``serial``) is refused, or ``None``."""
        reason = self.identities.get(f"{identity.kind}/{identity.name}")
        if reason is not None:
            return f"identity {identity} is revoked ({reason}) (rule revoked)"
        if serial is not None:
            reason = self.serials.get(serial)
            if reason is not None:
                return f"certificate serial {serial} of {identity} is revoked ({reason}) (rule revoked)"
        return None

    @classmethod
    def of(cls, identities: Iterable[tuple[str, str]], serials: Iterable[tuple[str, str]]) -> DenyList:
        return cls(dict(identities), {s.lower(): r for s, r in serials})


EMPTY = DenyList()


@dataclass
class DenyListCache:
    """The last list fetched and when; :meth:`due` says when to fetch again: ``ttl_s`` after the last
    success, ``retry_s`` after a failure (the old list stays in force meanwhile)."""

    ttl_s: float = DEFAULT_TTL_S
    retry_s: float = 1.0
    current: DenyList = EMPTY
    fetched_at: float = -math.inf
    failed_at: float = -math.inf

    def due(self, now: float) -> bool:
        if self.failed_at > self.fetched_at:
            return now - self.failed_at >= self.retry_s
        return now - self.fetched_at >= self.ttl_s

    def fetched(self, deny: DenyList, now: float) -> bool:
        """Records a fetched list; returns whether it differs from the one in force."""
        changed = deny.version != self.current.version
        self.current, self.fetched_at = deny, now
        return changed

    def failed(self, now: float) -> None:
        self.failed_at = now


@functools.lru_cache(maxsize=4096)
def serial_of_pem(pem: bytes) -> str | None:
    """The serial (lower-case hex) of the first certificate of ``pem``; ``None`` if it does not parse.
    Cached: a peer presents the same certificate on every call of its connection."""
    try:
        return f"{x509.load_pem_x509_certificate(pem).serial_number:x}"
    except ValueError:
        return None


def from_response(resp: coordinator_pb2.DenyListResponse) -> DenyList:
    """The list a ``GetDenyList`` answer carries (not for an ``unchanged`` one)."""
    return DenyList.of(((e.key, e.reason) for e in resp.identities), ((e.key, e.reason) for e in resp.serials))


class DenyListFollower:
    """An agent's copy of the coordinator's deny list: :meth:`run` (its own thread) fetches it when
    :meth:`DenyListCache.due`; :meth:`current` is what the agent's guard reads on every call (never a
    network wait on the serving path). ``call`` is a ``CoordinatorClient.call``."""

    def __init__(self, call: Callable[..., Any], ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.call = call
        self.cache = DenyListCache(ttl_s)
        self.clock = clock

    def current(self) -> DenyList:
        return self.cache.current

    def refresh(self, now: float) -> None:
        """One fetch; a failure keeps the list in force (logged at most once a minute)."""
        known = self.cache.current.version if self.cache.fetched_at > -math.inf else 0
        try:
            resp = self.call("GetDenyList", coordinator_pb2.GetDenyListRequest(known_version=known),
                             idempotent=True, deadline_s=max(1.0, self.cache.ttl_s))
        except Exception as exc:  # unreachable, a standby, a bug: keep the old list and retry soon
            self.cache.failed(now)
            _throttle.log(logging.INFO, "deny-list", "deny list not refreshed (the last one stays in force): %s", exc,
                          now=now)
            return
        deny = self.cache.current if resp.unchanged else from_response(resp)
        if self.cache.fetched(deny, now):
            log.warning("deny list changed: %d identities, %d certificate serials revoked", len(deny.identities),
                        len(deny.serials))

    def run(self, stop: threading.Event, poll_s: float = 0.25) -> None:
        while not stop.is_set():
            now = self.clock()
            if self.cache.due(now):
                self.refresh(now)
            stop.wait(poll_s)
