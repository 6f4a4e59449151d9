"""Helpers for tests, benchmarks and drills that wait on real processes: conditions with deadlines,
never a bare sleep-and-hope."""

from __future__ import annotations

import json
import socket
import threading
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


class ManualClock:
    """A clock that moves only when a test sets ``now``: timing decisions tested without sleeping."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def flipping_proxy(target: int, flip_at: int) -> tuple[socket.socket, threading.Thread]:
    """A loopback proxy to ``target`` that inverts the byte at offset ``flip_at`` of the holder's stream."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn, socket.create_connection(("127.0.0.1", target)) as up:
            up.sendall(conn.recv(16))  # the transfer id
            seen = 0
            while data := bytearray(up.recv(1 << 16)):
                if seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0xFF
                seen += len(data)
                try:
                    conn.sendall(data)
                except OSError:
                    return  # the receiver gave up: expected once the altered record fails

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return listener, worker
