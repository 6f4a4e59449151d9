"""The one place an etcd v3 client is built (``etcd-sdk-python``, module ``pyetcd``): endpoint
parsing, channel options, and moving to the next member after a connectivity failure.

``next_member`` is the only code in ftd that touches a private attribute of pyetcd
(``_current_endpoint_label``); ``tests/test_etcd_client.py`` fails if pyetcd renames it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyetcd

from ftd.rpc import parse_hostport

# Reconnect quickly after an outage and notice a dead member through keepalive within ~4 s: a lease
# confirmed through a dead member would otherwise wait out gRPC's backoff (up to two minutes).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
]

# How long pyetcd keeps a failed member out of rotation (its own default is much longer).
RETRY_FAILED_MEMBER_S = 0.2


def parse_endpoints(text: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (an ``http://`` prefix is tolerated) → ``[(host, port), ...]``."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out = [parse_hostport(p, "etcd endpoint") for p in parts if p.strip()]
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def make_client(endpoints: str | Sequence[str], timeout_s: float = 10.0) -> Any:
    """A failover client over every member in ``endpoints``; each call has ``timeout_s``."""
    eps = [
        pyetcd.Endpoint(host, port, secure=False, time_retry=RETRY_FAILED_MEMBER_S, opts=CHANNEL_OPTIONS)
        for host, port in parse_endpoints(endpoints)
    ]
    return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)


def current_member(client: Any) -> str:
    """The label (``host:port``) of the member the next call goes to."""
    return str(client._current_endpoint_label)


def next_member(client: Any) -> None:
    """After a connectivity failure, send the next call to the next member. pyetcd marks a member
    failed for ``time_retry`` only and then goes back to it: with a member down for good that is
    every call (it kept a leader unconfirmed through the death of one member of three)."""
    labels = list(client.endpoints)
    if len(labels) > 1:
        current = current_member(client)
        index = labels.index(current) if current in labels else -1
        client._current_endpoint_label = labels[(index + 1) % len(labels)]
