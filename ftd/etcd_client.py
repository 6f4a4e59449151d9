"""The one place an etcd v3 client is built (``etcd-sdk-python``, module ``pyetcd``): endpoint
parsing, channel options, transport security, and moving to the next member after a connectivity
failure.

TLS (:class:`EtcdTls`): the CA that signed etcd's certificates and, for an etcd started with
``--client-cert-auth``, a client certificate and key of the cluster PKI. With etcd's auth on, etcd
takes the client certificate's CN as the user (``ftd-coordinator``, ``ftd-rendezvous``: see
``docs/security.md``), so no password is involved. A client reads its files when it is made: a rotated
certificate is used from the next client on (the old one stays valid until it expires).

``next_member`` is the only code in ftd that touches a private attribute of pyetcd
(``_current_endpoint_label``); ``tests/test_etcd_client.py`` fails if pyetcd renames it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pyetcd

from ftd.identity import IdentityFiles, PkiError
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

# With TLS a connection attempt gets this long (gRPC reads "min reconnect backoff" as the least time
# an attempt is given: 100 ms can cut a TLS handshake with a busy member short). Calls keep their
# own deadlines, so a dead member still fails them as quickly.
TLS_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *((k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.min_reconnect_backoff_ms"),
    ("grpc.min_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class EtcdTls:
    """TLS towards etcd: ``ca_file`` verifies the members; ``cert_file``/``key_file`` (both or neither)
    are the client certificate an etcd with ``--client-cert-auth`` requires (its CN is the etcd user)."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd TLS: give both a client certificate and its key, or neither")

    @classmethod
    def of_identity(cls, files: IdentityFiles) -> EtcdTls:
        """The files of an identity of the cluster PKI (``ca.crt`` and its certificate and key)."""
        return cls(files.ca_path, files.cert_path, files.key_path)

    def credentials(self) -> grpc.ChannelCredentials:
        """Reads the files now; a missing or unreadable one is a :class:`~ftd.identity.PkiError` naming it."""
        def read(path: Path, what: str) -> bytes:
            try:
                return path.read_bytes()
            except OSError as exc:
                raise PkiError(f"etcd {what} {path} is unreadable: {exc.strerror or exc}") from None

        ca = read(self.ca_file, "CA certificate")
        cert = read(self.cert_file, "client certificate") if self.cert_file is not None else None
        key = read(self.key_file, "client key") if self.key_file is not None else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# What make_client uses when it is given no ``tls``: set for a block with :func:`using_tls` (for code
# that builds its clients deep inside, e.g. :class:`ftd.coordinator.etcd_store.EtcdStore`).
_DEFAULT_TLS: ContextVar[EtcdTls | None] = ContextVar("ftd_etcd_tls", default=None)


@contextlib.contextmanager
def using_tls(tls: EtcdTls | None) -> Iterator[None]:
    """Within the block (this thread or task), :func:`make_client` without ``tls`` uses ``tls``."""
    token = _DEFAULT_TLS.set(tls)
    try:
        yield
    finally:
        _DEFAULT_TLS.reset(token)


def parse_endpoints(text: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` (an ``http://`` prefix is tolerated) → ``[(host, port), ...]``."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    out = [parse_hostport(p, "etcd endpoint") for p in parts if p.strip()]
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def make_client(endpoints: str | Sequence[str], timeout_s: float = 10.0, tls: EtcdTls | None = None) -> Any:
    """A failover client over every member in ``endpoints``; each call has ``timeout_s``. With ``tls``
    (or inside :func:`using_tls`) the channels use TLS and present the client certificate."""
    tls = tls if tls is not None else _DEFAULT_TLS.get()
    creds = tls.credentials() if tls is not None else None
    eps = [
        pyetcd.Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=RETRY_FAILED_MEMBER_S,
                        opts=TLS_CHANNEL_OPTIONS if creds is not None else CHANNEL_OPTIONS)
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
