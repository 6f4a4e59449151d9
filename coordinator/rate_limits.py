"""Per-node write rate limits: one node cannot starve the others nor fill etcd.

Writes are rate limited per node (:class:`WriteLimiter`): a token bucket per (method, node) refills
``WRITE_RATE_PER_S`` tokens a second up to ``WRITE_BURST``; an empty bucket is ``RESOURCE_EXHAUSTED``
with the reason. The bucket is :class:`ftd.throttle.TokenBucket`; error logs that a client can
trigger go through :class:`ftd.throttle.LogThrottle`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from ftd.throttle import TokenBucket

from . import errors
from .validation import SHARED_LOCATIONS

WRITE_RATE_PER_S = 10.0
WRITE_BURST = 60.0
MAX_BUCKETS = 20_000
RATE_LIMITED_METHODS = ("Register", "CommitShard", "RecordCopy", "ReportHang", "JoinRound", "CommitShard/mem",
                        "RecordCopy/mem")


class WriteLimiter:
    """A token bucket per (method, key): ``rate`` tokens a second up to ``burst``. Keys are node ids
    (for a shared location, location and rank), so one node cannot starve the others nor fill etcd.
    At most ``max_buckets`` are kept; the least recently used full one goes first."""

    def __init__(self, rate: float = WRITE_RATE_PER_S, burst: float = WRITE_BURST,
                 clock: Callable[[], float] = time.monotonic, max_buckets: int = MAX_BUCKETS,
                 on_limited: Callable[[str], None] | None = None) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_buckets = max_buckets
        self.on_limited = on_limited
        self._buckets: OrderedDict[tuple[str, str], TokenBucket] = OrderedDict()

    def check(self, method: str, key: str, scale: float = 1.0) -> None:
        """Takes a token or raises :class:`~.errors.RateLimited` (nothing else changes). ``scale``
        multiplies rate and burst for a class of writes that is legitimately frequent (memory-tier
        snapshots: one per rank and step) and gets a bucket of its own."""
        if self.rate <= 0:
            return
        bucket = self._buckets.get((method, key))
        if bucket is None:
            self._make_room()
            bucket = self._buckets[(method, key)] = TokenBucket(self.rate * scale, self.burst * scale)
        else:
            self._buckets.move_to_end((method, key))
        wait = bucket.take(1.0, self.clock())
        if wait > 0:
            if self.on_limited is not None:
                self.on_limited(method)
            raise errors.RateLimited(f"{method} from {key!r} is over its write rate limit "
                                     f"({bucket.rate:g}/s, burst {bucket.burst:g}); retry in {wait:.1f}s")

    def _make_room(self) -> None:
        while len(self._buckets) >= self.max_buckets:
            self._buckets.popitem(last=False)


# Memory-tier snapshots are committed every step by every rank: their own buckets, 20 times wider.
MEMORY_TIER_SCALE = 20.0


def shard_writer(location: str, rank: int) -> str:
    """The rate-limit key of a catalog write: the node for a node-local copy; for a shared location
    (any node may write there) the location and rank, so each rank's writer has its own bucket."""
    return f"{location}/rank-{rank}" if location in SHARED_LOCATIONS else location
