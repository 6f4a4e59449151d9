"""Rate limits of two kinds, each a pure function of the time it is given: a token bucket (the
coordinator's per-node write limits, the agent's copy bandwidth) and a log throttle (error lines a
client or a flapping source can trigger).

Both take ``now`` from the caller, so a test moves time by passing a number rather than waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full (``burst`` goes at once). 0 disables it.

    Two ways to spend: :meth:`take` refuses what is not there (a request limit: nothing is consumed
    and the caller learns how long to wait), :meth:`delay` always consumes and says how long to wait
    for the debt to be paid (a bandwidth limit: the bytes are sent, then the sender sleeps)."""

    rate: float
    burst: float
    tokens: float = 0.0
    last: float | None = None

    def _refill(self, now: float) -> None:
        if self.last is None:
            self.tokens, self.last = self.burst, now
        # a clock that went back refills nothing (and takes nothing away)
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = now

    def take(self, n: float, now: float) -> float:
        """Consumes ``n`` tokens at ``now`` and returns 0.0, or, when fewer are there, consumes
        nothing and returns the seconds until there would be."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        if self.tokens < n:
            return (n - self.tokens) / self.rate
        self.tokens -= n
        return 0.0

    def delay(self, n: float, now: float) -> float:
        """Consumes ``n`` tokens at ``now``, going into debt if need be; returns the seconds to wait
        until the debt is paid (0.0 when there is none)."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


class LogThrottle:
    """Lets a line of a kind through at most once per ``period_s``; the next one that goes through
    says how many were suppressed. Kinds are fixed strings from the code (or bounded ones: a source's
    name), never request data; past ``max_kinds`` the memory starts over."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_kinds: int = 256) -> None:
        self.logger = logger
        self.period_s = period_s
        self.clock = clock  # for :meth:`log` without ``now``
        self.max_kinds = max_kinds
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, kind: str, now: float) -> int | None:
        """``None``: stay quiet (counted); otherwise the number of lines of ``kind`` suppressed
        since the last one that went through. A clock that went back lets the line through."""
        last = self._last.get(kind)
        if last is not None and 0.0 <= now - last < self.period_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return None
        if last is None and len(self._last) >= self.max_kinds:
            self._last.clear()
            self._suppressed.clear()
        self._last[kind] = now
        return self._suppressed.pop(kind, 0)

    def log(self, level: int, kind: str, msg: str, *args: object, now: float | None = None,
            exc_info: bool = False) -> bool:
        """Logs ``msg % args`` unless :meth:`allow` says to stay quiet; returns whether it did."""
        suppressed = self.allow(kind, self.clock() if now is None else now)
        if suppressed is None:
            return False
        if suppressed:
            msg += f" ({suppressed} similar message(s) suppressed in the last {self.period_s:g}s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
