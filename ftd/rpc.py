"""gRPC plumbing shared by every ftd process: endpoint parsing, channel and server options, channel
construction, and reading a failed call's status. One place, so that transport security (TLS) and
tuning change once for the coordinator, the agents, the training side and ``ftctl``."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc import aio

# Clients reconnect quickly after an outage (gRPC's default backoff grows to two minutes) and notice a
# dead peer through keepalive pings within ~15 s even on an idle channel.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

# Servers accept the clients' keepalive pings (without this they answer too-frequent pings with
# GOAWAY) and hold one heartbeat stream per agent.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 100_000),
]


def parse_hostport(text: str, what: str = "endpoint") -> tuple[str, int]:
    """``"HOST:PORT"`` or ``"[v6]:PORT"`` (an ``http://`` prefix is tolerated) → ``(host, port)``
    with the brackets removed. Raises ``ValueError`` naming ``what`` and the text."""
    part = text.strip().removeprefix("http://")
    host, sep, port = part.rpartition(":")
    host = host.strip()
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad {what} {text.strip()!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def parse_endpoints(text: str | Sequence[str], what: str = "endpoint") -> list[str]:
    """A comma-separated list (or a sequence) of ``HOST:PORT`` → the list, validated, as written."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out = [p.strip() for p in parts if p.strip()]
    for p in out:
        parse_hostport(p, what)
    if not out:
        raise ValueError(f"no {what} given")
    return out


def dial_target(host: str, port: int) -> str:
    """The gRPC target for ``host``/``port``; IPv6 literals get their brackets back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def channel(target: str, options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A blocking-API client channel to ``target`` (``HOST:PORT`` or ``unix:PATH``)."""
    return grpc.insecure_channel(target, options=[*CHANNEL_OPTIONS, *options])


def aio_channel(target: str, options: Sequence[tuple[str, int]] = ()) -> aio.Channel:
    """An asyncio client channel to ``target``."""
    return aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, *options])


def add_port(server: grpc.Server | aio.Server, address: str) -> int:
    """Binds ``address`` on ``server``; returns the bound port (0 when binding failed)."""
    return server.add_insecure_port(address)


def rpc_code(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a failed call (gRPC's errors are also ``grpc.Call`` objects), or ``None``
    for an exception that is not a gRPC status."""
    code = getattr(exc, "code", None)
    if not callable(code):
        return None
    value = code()
    return value if isinstance(value, grpc.StatusCode) else None


def rpc_details(exc: BaseException) -> str:
    """The status message of a failed call, or ``str(exc)`` for anything else."""
    details = getattr(exc, "details", None)
    return str(details()) if callable(details) else str(exc)


def describe(exc: BaseException) -> str:
    """``"CODE: details"`` for logs and operator messages."""
    code = rpc_code(exc)
    return f"{code.name if code else '?'}: {rpc_details(exc)}"
