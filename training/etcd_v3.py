"""torch elastic's own ``DynamicRendezvousHandler`` on etcd's **v3** API: ``--rdzv-backend=etcd-v3``.

torch's ``etcd`` and ``etcd-v2`` backends need the v2 API, which etcd 3.6 removed (pytorch issues
158326, 170707). This module gives the same handler a v3 home:

* :class:`EtcdV3RendezvousBackend` — the three-member ``RendezvousBackend`` (``name``,
  ``get_state``, ``set_state``) with the fencing token being the key's ``mod_revision`` and every
  case of ``set_state``'s contract done in one transaction (create-if-absent, or compare the
  revision, and read back);
* :class:`EtcdV3Store` — the c10d ``Store`` the handler hands to torch's agent, a port of torch's
  ``EtcdStore`` to v3 (blocking ``get``/``wait`` through watches, ``add``/``compare_set`` by
  compare-and-swap).

    torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=ETCD1:2379[,ETCD2:2379] --rdzv-id=JOB --nnodes=2 ...

TLS to etcd (:func:`etcd_tls`), as torch's own etcd backend takes it: ``--rdzv-conf ca_cert=CA,
ssl_cert=CRT,ssl_cert_key=KEY``; or ``--rdzv-conf pki_dir=DIR,node_id=NODE`` (``$FTD_PKI_DIR`` and
``$FTD_NODE_ID`` by default) for the node's ``rendezvous/<node_id>`` certificate of the cluster PKI,
whose CN ``ftd-rendezvous`` is the etcd user that may use ``/torch/elastic/`` and nothing else. etcd
admits that certificate only where the cluster opted in (``ftctl up --etcd-v3-rendezvous``, ``ftctl certs
issue|rotate rendezvous NODE --etcd-client``): by default no certificate a node holds reaches etcd, and
:func:`etcd_tls` says so instead of failing in the TLS handshake (docs/security.md).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pyetcd
import pyetcd.exceptions
from pyetcd import transactions as tx
from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from ftd.ca import ETCD_CLIENT_HOST, has_etcd_client_name
from ftd.etcd_client import EtcdTls, make_client, next_member
from ftd.identity import IdentityFiles, PkiError, load_certs

T = TypeVar("T")
BACKEND = "etcd-v3"

def _etcd(what: str, fn: Callable[[], T], client: Any = None) -> T:
    """The one translation of etcd client errors into torch's rendezvous errors; after a failure the
    client moves to the next member."""
    try:
        return fn()
    except (pyetcd.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as exc:
        if client is not None:
            next_member(client)
        raise RendezvousConnectionError(f"etcd v3 {what} failed: {exc!r}") from exc


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The rendezvous state of one run under ``<key_prefix>/<run_id>``; token = ``mod_revision``."""

    def __init__(self, client: Any, run_id: str, key_prefix: str = "/torch/elastic/rendezvous") -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = f"{key_prefix}/{run_id}"

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        return _etcd(what, fn, self._client)

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self._do("get_state", lambda: self._client.get(self._key))
        if value is None:
            return None
        return bytes(value), int(meta.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """Exactly torch's contract:

        * ``token`` matches the stored revision → the state is written; it and its new token come
          back with ``True``;
        * ``token`` does not match (or is not a revision at all) → nothing is written; the stored
          state and its token come back with ``False`` (``None`` when there is no stored state);
        * ``token`` is ``None`` → written only if no state exists; either the new state (``True``)
          or the existing one (``False``) comes back with its token.
        """
        if token is None:
            compare = [tx.Create(self._key) == 0]
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                return self._current()
            compare = [tx.Mod(self._key) == revision]
        ok, responses = self._do("set_state", lambda: self._client.transaction(
            compare=compare, success=[tx.Put(self._key, state), tx.Get(self._key)], failure=[tx.Get(self._key)]))
        kvs = responses[-1]
        if not kvs:
            return None  # a token for a state that no longer exists
        value, meta = kvs[0]
        return bytes(value), int(meta.mod_revision), bool(ok)

    def _current(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        return (current[0], current[1], False) if current is not None else None


class EtcdV3Store(Store):
    """A c10d ``Store`` on etcd v3 for the rendezvous agents (not a data path)."""

    def __init__(self, client: Any, prefix: str, timeout: datetime.timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.client = client
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout or datetime.timedelta(seconds=300)
        if timeout is not None:
            self.set_timeout(timeout)

    def _do(self, what: str, fn: Callable[[], T]) -> T:
        return _etcd(what, fn, self.client)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def _key(self, key: str | bytes) -> str:
        return self.prefix + (key.decode() if isinstance(key, bytes) else key)

    @staticmethod
    def _bytes(value: str | bytes | Sequence[int]) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._do("set", lambda: self.client.put(self._key(key), self._bytes(value)))

    def get(self, key: str) -> bytes:
        return self._wait_get([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_get(keys, self._timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ops = [tx.Put(self._key(k), self._bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._do("multi_set", lambda: self.client.transaction(compare=[], success=ops, failure=[]))

    def add(self, key: str, num: int) -> int:
        """Atomic increment by compare-and-swap on the key's revision (retried on contention)."""
        full = self._key(key)
        while True:
            value, meta = self._do("add", lambda: self.client.get(full))
            if value is None:
                ok, _ = self._do("add", lambda: self.client.transaction(
                    compare=[tx.Create(full) == 0], success=[tx.Put(full, str(num))], failure=[]))
                if ok:
                    return num
                continue
            new = int(value) + num
            ok, _ = self._do("add", lambda: self.client.transaction(
                compare=[tx.Mod(full) == meta.mod_revision], success=[tx.Put(full, str(new))], failure=[]))  # noqa: B023
            if ok:
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        full, want, new = self._key(key), self._bytes(expected), self._bytes(desired)
        compare = [tx.Create(full) == 0] if want == b"" else [tx.Value(full) == want]
        ok, responses = self._do("compare_set", lambda: self.client.transaction(
            compare=compare, success=[tx.Put(full, new)], failure=[tx.Get(full)]))
        if ok:
            return new
        kvs = responses[-1]
        return bytes(kvs[0][0]) if kvs else want

    def _get(self, key: str) -> bytes | None:
        value, _ = self._do("get", lambda: self.client.get(self._key(key)))
        return None if value is None else bytes(value)

    def check(self, keys: list[str]) -> bool:
        return all(self._get(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_get(keys, timeout or self._timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._do("delete_key", lambda: self.client.delete(self._key(key))))

    def num_keys(self) -> int:
        return len(list(self._do("num_keys", lambda: self.client.get_prefix(self.prefix, keys_only=True))))

    def _wait_get(self, keys: Sequence[str], timeout: datetime.timedelta) -> list[bytes]:
        """Blocks until every key exists (watching the prefix), or raises ``LookupError`` like c10d."""
        deadline = time.monotonic() + timeout.total_seconds()
        changed = threading.Event()
        watch_id = self._do("watch", lambda: self.client.add_watch_prefix_callback(
            self.prefix, lambda _: changed.set()))
        try:
            while True:
                values = [self._get(k) for k in keys]
                found = [v for v in values if v is not None]
                if len(found) == len(values):
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                    raise LookupError(f"timed out after {timeout.total_seconds():g}s waiting for keys {missing} "
                                      f"in etcd store {self.prefix}")
                changed.wait(min(remaining, 1.0))
                changed.clear()
        finally:
            with contextlib.suppress(Exception):  # the watch dies with the channel anyway
                self.client.cancel_watch(watch_id)


def etcd_tls(params: RendezvousParameters) -> EtcdTls | None:
    """TLS to etcd from ``--rdzv-conf`` (torch's ``ca_cert``/``ssl_cert``/``ssl_cert_key``, or
    ``pki_dir`` with ``node_id``) or ``$FTD_PKI_DIR``/``$FTD_NODE_ID``; ``None``: plaintext. Raises
    ``ValueError`` naming what is missing."""
    ca, cert, key = params.get("ca_cert"), params.get("ssl_cert"), params.get("ssl_cert_key")
    if ca or cert or key:
        if not ca:
            raise ValueError("ca_cert is required with ssl_cert/ssl_cert_key")
        return EtcdTls(Path(ca), Path(cert) if cert else None, Path(key) if key else None)
    pki_dir = params.get("pki_dir") or os.environ.get("FTD_PKI_DIR")
    if not pki_dir:
        return None
    node_id = params.get("node_id") or os.environ.get("FTD_NODE_ID")
    if not node_id:
        raise ValueError("pki_dir needs node_id (--rdzv-conf node_id=... or $FTD_NODE_ID): the rendezvous "
                         "certificate is rendezvous/<node_id>")
    try:
        files = IdentityFiles(Path(pki_dir), "rendezvous", str(node_id))
        files.load()
        admitted = has_etcd_client_name(load_certs(files.cert_path, "rendezvous certificate")[0])
    except PkiError as exc:
        raise ValueError(str(exc)) from exc
    if not admitted:
        raise ValueError(not_an_etcd_client(files.cert_path, str(node_id)))
    return EtcdTls.of_identity(files)


def not_an_etcd_client(cert_path: Path, node_id: str) -> str:
    """Why etcd would refuse ``cert_path`` in the handshake, and how to issue one it admits."""
    return (f"the rendezvous certificate {cert_path} does not carry etcd's client name {ETCD_CLIENT_HOST}, so "
            "etcd refuses it in the TLS handshake (by default no certificate a node holds reaches etcd: "
            "docs/security.md); for --rdzv-backend=etcd-v3 re-issue it with 'ftctl certs rotate rendezvous "
            f"{node_id} --etcd-client' (a local cluster: 'ftctl up --etcd-v3-rendezvous'), or use "
            "--rdzv-backend=ftd, which needs no etcd")


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    client = make_client(params.endpoint, float(params.get_as_int("read_timeout", 60) or 60), etcd_tls(params))
    backend = EtcdV3RendezvousBackend(client, params.run_id, params.get("key_prefix", "/torch/elastic/rendezvous"))
    store = EtcdV3Store(client, f"/torch/elastic/store/{params.run_id}")
    return backend, store


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    try:
        backend, store = create_backend(params)
    except (ValueError, PkiError) as exc:
        raise RendezvousStateError(f"bad etcd-v3 rendezvous parameters: {exc}") from exc
    return dynamic_rendezvous.create_handler(store, backend, params)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point ``etcd-v3``."""
    return create_handler
