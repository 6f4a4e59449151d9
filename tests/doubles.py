"""Test doubles shared by the test modules: a clock that moves only when told, a proxy that corrupts
one byte of a stream (the receiver's checks must catch it), and the catalog's answer to ``RecordCopy``
for fakes of the coordinator that keep records in a dict."""

from __future__ import annotations

import socket
import threading
from typing import Any

from ftd.checkpoints import catalog as rules
from ftd.v1 import checkpoint_pb2


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


def record_copy(records: dict[int, Any],
                request: checkpoint_pb2.RecordCopyRequest) -> checkpoint_pb2.RecordCopyResponse:
    """What the coordinator's catalog does with a ``RecordCopy``, on ``records`` (step -> record): a copy
    present and sound is added, any other is dropped (with its corrupt reason)."""
    rec = records[request.step]
    if request.present and not request.corrupt_reason:
        records[request.step] = rules.add_copy(rec, request.rank, request.tier, request.location)
    else:
        records[request.step] = rules.drop_copy(rec, request.rank, request.tier, request.location,
                                                request.corrupt_reason)
    return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(records[request.step]))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closed ``sock`` within ``seconds`` (EOF or reset): a server's idle deadline at work."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
