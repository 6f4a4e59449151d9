"""Helpers for tests, benchmarks and drills that wait on real processes: conditions with deadlines,
never a bare sleep-and-hope."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Timeout(AssertionError):
    pass


def wait_for(condition: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    """Polls ``condition`` until it returns a truthy value (returned) or ``timeout_s`` passes.
    Exceptions from the condition count as "not yet" and the last one is reported on timeout."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last!r})" if last is not None else ""
            raise Timeout(f"timed out after {timeout_s:g}s waiting for {what}{detail}")
        time.sleep(interval_s)
