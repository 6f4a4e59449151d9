"""gRPC plumbing shared by every ftd process: endpoint parsing, channel and server options, channel
construction, transport security, and reading a failed call's status. One place, so that TLS and
tuning change once for the coordinator, the agents, the training side and ``ftctl``. Who called and
whether the authorization table lets them is :mod:`ftd.authz_interceptors`.

Transport security (``tls=``): mutual TLS against the cluster CA (:mod:`ftd.identity`) on every TCP
listener and client; a TLS listener refuses plaintext and clients without a certificate of that CA.
``unix:`` addresses stay plaintext: the agent's socket is protected by its 0600 file mode, and a peer
on it is the :data:`~ftd.identity.LOCAL_IDENTITY`. Rotation: a listener given :class:`~ftd.identity.IdentityFiles`
re-reads them when they change (before the next handshake), so a rotated certificate reaches new
connections without a restart; a client reads its files when a channel is made, so a client that wants
its rotated certificate re-creates its channels (:meth:`~ftd.identity.IdentityFiles.stamp` tells when).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TypeAlias

import grpc
from grpc import aio

from ftd.identity import IdentityFiles, PkiError, TlsMaterial, server_name

log = logging.getLogger("ftd.rpc")

# What ``tls=`` takes: fixed PEM bytes, or the files of an identity (re-read on rotation).
Tls: TypeAlias = "TlsMaterial | IdentityFiles"
Option: TypeAlias = "tuple[str, int | str]"

# Clients reconnect quickly after an outage (gRPC's default backoff grows to two minutes) and notice a
# dead peer through keepalive pings within ~15 s even on an idle channel.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A coordinator answer may carry a page of up to 2 MiB, a whole checkpoint record more: accept up
    # to 16 MiB (the coordinator caps what it sends there; requests it accepts stay under 1 MiB).
    ("grpc.max_receive_message_length", 16 << 20),
]

# With TLS, one connection attempt may take this long (gRPC reads its "min reconnect backoff" as the
# least time a connection attempt is given; the 100 ms above would abort TLS handshakes that queue
# behind others, e.g. a thousand agents reconnecting to a new leader, and retry them forever). The
# pause between attempts stays CHANNEL_OPTIONS' backoff: a refused connection is retried as quickly.
TLS_CONNECT_TIMEOUT_MS = 5_000

# Servers accept the clients' keepalive pings (without this they answer too-frequent pings with
# GOAWAY) and hold one heartbeat stream per agent.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 100_000),
    # A connection that has not finished its TLS handshake after 5 s is closed (gRPC core's default, 120 s,
    # let idle connections that never start TLS pin descriptors).
    ("grpc.server_handshake_timeout_ms", 5_000),
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


def is_local(address: str) -> bool:
    """A ``unix:`` socket path (plaintext by design: its file mode is its access control)."""
    return address.startswith("unix:")


def _material(tls: Tls) -> TlsMaterial:
    return tls.load() if isinstance(tls, IdentityFiles) else tls


def client_credentials(tls: Tls) -> grpc.ChannelCredentials:
    """mTLS client credentials: trust the cluster CA, present the own certificate. Also what an etcd
    client takes (``pyetcd.Endpoint(host, port, secure=True, creds=...)``)."""
    m = _material(tls)
    return grpc.ssl_channel_credentials(root_certificates=m.ca_pem, private_key=m.key_pem, certificate_chain=m.cert_pem)


def _client_options(options: Sequence[Option], server_name: str | None) -> list[Option]:
    out: list[Option] = [*((k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.min_reconnect_backoff_ms"),
                         ("grpc.min_reconnect_backoff_ms", TLS_CONNECT_TIMEOUT_MS), *options]
    if server_name:
        # Verify the server's certificate for this name rather than the dialled host: the name only the
        # CA gives a server of the expected kind (ftd.identity.server_name), or, for a server reached at
        # an address its certificate does not name (a NAT, a load balancer), that name.
        out.append(("grpc.ssl_target_name_override", server_name))
    return out


def channel(target: str, options: Sequence[Option] = (), tls: Tls | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """A blocking-API client channel to ``target`` (``HOST:PORT`` or ``unix:PATH``); mTLS with ``tls``
    except to a ``unix:`` target."""
    if tls is None or is_local(target):
        return grpc.insecure_channel(target, options=[*CHANNEL_OPTIONS, *options])
    return grpc.secure_channel(target, client_credentials(tls), options=_client_options(options, server_name))


# A channel kept connected without calls (a coordinator standby's): gRPC drops an idle channel's
# connection after 30 min by default; this one is kept (keepalive pings still find a dead peer).
NEVER_IDLE: list[Option] = [("grpc.client_idle_timeout_ms", 2**31 - 1)]


def connect_now(ch: grpc.Channel) -> None:
    """Starts ``ch``'s connection (and TLS handshake) now, without a call: gRPC connects lazily, on the
    first one. Returns at once; the watch ends with the first settled state."""
    def seen(state: grpc.ChannelConnectivity) -> None:
        if state not in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
            ch.unsubscribe(seen)
    ch.subscribe(seen, try_to_connect=True)


def agent_channel(address: str, node_id: str, tls: Tls | None = None) -> grpc.Channel:
    """A channel to the agent of ``node_id`` at ``address`` that over TLS accepts only that node's agent
    certificate (its :func:`~ftd.identity.server_name`), not any certificate naming the address."""
    return channel(address, tls=tls, server_name=server_name("node", node_id) if tls is not None else None)


def aio_channel(target: str, options: Sequence[Option] = (), tls: Tls | None = None,
                server_name: str | None = None) -> aio.Channel:
    """An asyncio client channel to ``target``; mTLS with ``tls`` except to a ``unix:`` target."""
    if tls is None or is_local(target):
        return aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, *options])
    return aio.secure_channel(target, client_credentials(tls), options=_client_options(options, server_name))


def _server_config(m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(m.key_pem, m.cert_pem)], root_certificates=m.ca_pem)


class CertificateReloader:
    """The certificate fetcher of a rotating listener: gRPC calls it before every handshake; it
    answers a new configuration when the identity's files changed on disk and check out (issued by
    the CA, in validity, key matching), else ``None`` (keep serving the current one)."""

    def __init__(self, files: IdentityFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._stamp = files.stamp()
        self.material = files.load()  # a bad identity at startup fails loudly here
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        self.reloads = 0

    def initial(self) -> grpc.ServerCertificateConfiguration:
        return _server_config(self.material)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self.files.stamp()
        if stamp in (self._stamp, self._refused):
            return None
        with self._lock:
            if stamp == self._stamp:
                return None
            try:
                material = self.files.load(attempts=3)
            except PkiError as exc:
                if stamp != self._refused:
                    log.warning("keeping the current certificate of %s/%s: %s", self.files.kind, self.files.name,
                                exc)
                self._refused = stamp
                return None
            except Exception:  # never fail a handshake for a bug here: keep the current certificate
                log.exception("reloading the certificate of %s/%s failed", self.files.kind, self.files.name)
                return None
            self._stamp, self.material, self.reloads = self.files.stamp(), material, self.reloads + 1
        log.info("serving the rotated certificate of %s/%s (%s)", self.files.kind, self.files.name,
                 self.files.cert_path)
        return _server_config(material)


def server_credentials(tls: Tls) -> grpc.ServerCredentials:
    """mTLS server credentials that require a client certificate of the cluster CA; with
    :class:`~ftd.identity.IdentityFiles`, rotated files are served to new connections without a restart."""
    if isinstance(tls, TlsMaterial):
        return grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)], root_certificates=tls.ca_pem,
                                           require_client_auth=True)
    reloader = CertificateReloader(tls)
    return grpc.dynamic_ssl_server_credentials(reloader.initial(), reloader,  # type: ignore[arg-type]
                                               require_client_authentication=True)


def add_port(server: grpc.Server | aio.Server, address: str, tls: Tls | None = None) -> int:
    """Binds ``address`` on ``server``, with mTLS when ``tls`` is given (a ``unix:`` address is always
    plaintext); returns the bound port (0 when binding failed)."""
    if tls is None or is_local(address):
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls))


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
