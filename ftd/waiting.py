"""Waiting on real processes with a deadline, never a bare sleep-and-hope: used by ``ftctl demo`` and
``ftctl drill`` as much as by the tests, benchmarks and the chaos matrix, so it stays in the runtime
package (the tests' own doubles live in ``tests/doubles.py``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

T = TypeVar("T")


class Timeout(AssertionError):
    pass


# What a condition may raise while the thing it waits for is still coming up: a socket not yet
# listening, a gRPC call to a server still starting, a file not yet (completely) written. Anything else
# is a bug in the code under test and fails at once instead of being waited out.
NOT_YET: tuple[type[BaseException], ...] = (OSError, grpc.RpcError, json.JSONDecodeError)


def wait_for(condition: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.02,
             not_yet: tuple[type[BaseException], ...] = NOT_YET) -> T:
    """Polls ``condition`` until it returns a truthy value (returned) or ``timeout_s`` passes.
    Exceptions of the ``not_yet`` kinds count as "not yet" and the last one is reported on timeout;
    any other exception propagates immediately."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except not_yet as exc:
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last!r})" if last is not None else ""
            raise Timeout(f"timed out after {timeout_s:g}s waiting for {what}{detail}")
        time.sleep(interval_s)
