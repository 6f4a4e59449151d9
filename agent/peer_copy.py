"""The peer copy path: one agent streams a published shard copy from one of its tiers to another
agent, which writes it into a local directory and verifies it before anybody loads it.

A spare that inherits a dead rank's shard, on a cluster whose slower tiers are node-local, can only
find that shard on a surviving node (a replica in its memory tier, a copy on its SSD). Streaming
through the agents keeps the training process out of the network path and lets the agents'
identities (mTLS) authorise it. Every file carries its CRC32C, computed by the sender while reading
and checked by the receiver while writing; the catalog's checksums are checked on top when known.

Failures keep their meaning, because restore depends on it: a peer that cannot be reached is
:class:`PeerUnreachable` (the copy is skipped, never recorded corrupt); bytes that arrive wrong are
:class:`CopyCorrupt`; a copy the peer does not hold is :class:`CopyMissing`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from ftd.checkpoints.layout import (
    MANIFEST,
    BadIdentifier,
    ManifestError,
    ShardManifest,
    check_job,
    check_rank,
    check_step,
    shard_prefix,
)
from ftd.rpc import describe, parse_hostport, rpc_code
from ftd.storage_backends.base import Crc32c, ObjectNotFound, StorageBackend, StorageError
from ftd.v1 import agent_pb2

from . import bulk_copy
from .landing import LandingReserve

log = logging.getLogger("ftd.agent.peer_copy")

CHUNK_BYTES = 1 << 20  # per message: well under gRPC's 4 MiB default, large enough for full speed
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.UNAUTHENTICATED)


class PeerCopyError(Exception):
    pass


class PeerUnreachable(PeerCopyError):
    """The node holding the copy did not answer: skip the copy, it may well be intact."""


class CopyMissing(PeerCopyError):
    """The node answered that it does not hold the copy (retention removed it, or it never did)."""


class CopyCorrupt(PeerCopyError):
    """The copy arrived, and its bytes do not match their checksum."""


@dataclass(frozen=True)
class Fetched:
    path: Path
    bytes: int
    seconds: float
    verified: bool = False  # every expected file arrived with the catalog's size and CRC32C


def serve_shard(backend: StorageBackend, job: str, step: int, rank: int,
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[agent_pb2.ShardChunk]:
    """The chunks of one published shard on ``backend``, manifest last (a receiver that stops early
    never holds a manifest without its files). Raises :class:`CopyMissing` before the first chunk.

    The holder checks what it sends against its own manifest (when it parses): a file whose CRC32C
    read here differs from the manifest's raises :class:`CopyCorrupt` instead of its last chunk (the holder's copy is
    corrupt at rest, which only the holder may record; the receiver never gets a complete file)."""
    prefix = shard_prefix(job, step, rank)
    if not backend.is_published(prefix, MANIFEST):
        raise CopyMissing(f"{backend.name}: no published copy of {prefix}")
    expected: dict[str, str] = {}
    try:
        with backend.open_read(f"{prefix}/{MANIFEST}") as f:
            expected = {e.name: e.crc32c for e in ShardManifest.decode(prefix, f.read()).files}
    except ObjectNotFound as exc:
        raise CopyMissing(str(exc)) from exc
    except ManifestError:
        pass  # the files are checked against the catalog by whoever loads them
    names = sorted((info.key.rsplit("/", 1)[-1] for info in backend.list(prefix + "/")),
                   key=lambda n: (n == MANIFEST, n))
    for name in names:
        yield from _file_chunks(backend, f"{prefix}/{name}", name, chunk_bytes, expected.get(name))


def _file_chunks(backend: StorageBackend, key: str, name: str, chunk_bytes: int,
                 expected_crc: str | None = None) -> Iterator[agent_pb2.ShardChunk]:
    info = backend.stat(key)
    size = info.size if info is not None else 0
    crc = Crc32c()
    first = True
    try:
        with backend.open_read(key) as src:
            while True:
                data = src.read(chunk_bytes)  # b"" after a file of whole chunks: its (empty) last chunk
                crc.update(data)
                last = len(data) < chunk_bytes
                if last and expected_crc is not None and crc.hexdigest() != expected_crc:
                    raise CopyCorrupt(f"{backend.name}/{key}: crc32c {crc.hexdigest()} read, the manifest says "
                                      f"{expected_crc}")
                yield agent_pb2.ShardChunk(name=name, size=size if first else 0, data=data, end_of_file=last,
                                           crc32c=crc.hexdigest() if last else "")
                first = False
                if last:
                    break
    except ObjectNotFound as exc:
        raise CopyMissing(str(exc)) from exc


def receive_shard(chunks: Iterable[agent_pb2.ShardChunk], dest: Path,
                  expected: Mapping[str, tuple[int, str]] | None = None) -> int:
    """Writes the streamed files into ``dest`` (a fresh directory), each to a temporary name renamed
    once its CRC32C matched; returns the bytes received. ``expected`` (name → (size, crc32c) from the
    catalog) must be met too."""
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    out = None
    crc = Crc32c()
    name = ""
    try:
        for chunk in chunks:
            if out is None:
                name = _safe_name(chunk.name)
                out = open(dest / f".{name}.part", "wb")  # noqa: SIM115 - closed at the file's last chunk
                crc = Crc32c()
            elif chunk.name != name:
                raise CopyCorrupt(f"{name}: the stream moved to {chunk.name!r} before the file ended")
            out.write(chunk.data)
            crc.update(chunk.data)
            total += len(chunk.data)
            if chunk.end_of_file:
                out.flush()
                os.fsync(out.fileno())
                out.close()
                out = None
                got = crc.hexdigest()
                if got != chunk.crc32c:
                    raise CopyCorrupt(f"{name}: received crc32c {got}, the sender read {chunk.crc32c}")
                if expected is not None and name in expected and expected[name][1] != got:
                    raise CopyCorrupt(f"{name}: crc32c {got}, the catalog says {expected[name][1]}")
                os.replace(dest / f".{name}.part", dest / name)
    finally:
        if out is not None:
            out.close()
    if out is None and name and expected is not None:
        missing = sorted(set(expected) - {p.name for p in dest.iterdir()})
        if missing:
            raise CopyCorrupt(f"the copy lacks {', '.join(missing)}")
    return total


def _safe_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise CopyCorrupt(f"refusing the file name {name!r}")
    return name


def fetch_shard(read_shard: Callable[[agent_pb2.ReadShardRequest], Iterable[agent_pb2.ShardChunk]],
                request: agent_pb2.ReadShardRequest, dest: Path,
                expected: Mapping[str, tuple[int, str]] | None = None) -> Fetched:
    """Pulls one copy from a peer agent (``read_shard`` is its stub's ``ReadShard`` with a deadline
    bound in) into ``dest``; on any failure ``dest`` is removed and the error says which kind."""
    started = time.perf_counter()
    if dest.exists():
        shutil.rmtree(dest)
    try:
        nbytes = receive_shard(read_shard(request), dest, expected)
    except grpc.RpcError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        code = rpc_code(exc)
        if code in _UNREACHABLE:
            raise PeerUnreachable(describe(exc)) from exc
        if code is grpc.StatusCode.NOT_FOUND:
            raise CopyMissing(describe(exc)) from exc
        if code is grpc.StatusCode.DATA_LOSS:
            raise CopyCorrupt(describe(exc)) from exc
        raise PeerCopyError(describe(exc)) from exc
    except (PeerCopyError, OSError, StorageError):
        shutil.rmtree(dest, ignore_errors=True)
        raise
    if not (dest / MANIFEST).exists():
        shutil.rmtree(dest, ignore_errors=True)
        raise CopyCorrupt(f"the copy of {request.job} step {request.step} rank {request.rank} has no manifest")
    return Fetched(dest, nbytes, time.perf_counter() - started)


class PeerFetcher:
    """The receiving side for this node's training processes: finds the agent of the node holding a
    copy (through the coordinator's node list), pulls the copy into ``spool`` and answers where."""

    def __init__(self, node_agent: Callable[[str], str], open_channel: Callable[[str], grpc.Channel], spool: Path,
                 timeout_s: float = 120.0, fast: bool = True,
                 landing: LandingReserve | None = None) -> None:
        self.node_agent = node_agent  # node id -> its agent's address ("" when unknown or gone)
        self.open_channel = open_channel
        self.spool = spool
        self.timeout_s = timeout_s
        self.fast = fast  # try the holder's fast path (OpenShard, ftd.agent.bulk_copy) before ReadShard
        self.landing = landing  # prepared room for the fast path (ftd.agent.landing)
        shutil.rmtree(spool / _TRASH, ignore_errors=True)  # what an earlier run left being freed

    def fetch(self, request: agent_pb2.FetchShardRequest) -> Fetched:
        try:
            job, _, rank = check_job(request.job), check_step(request.step), check_rank(request.rank)
            check_job(request.location)  # a node id: the same alphabet
        except BadIdentifier as exc:
            raise PeerCopyError(f"bad FetchShard request: {exc}") from exc
        address = self.node_agent(request.location)
        if not address:
            raise PeerUnreachable(f"node {request.location} has no reachable agent")
        stale = self._forget(job, rank, sum(f.size for f in request.expected) if request.expected else None)
        try:
            with self.landing.pulling() if self.landing is not None else contextlib.nullcontext():
                return self._fetch(request, address)
        finally:
            if stale:  # freed once the new copy is in: the restore does not wait for it
                threading.Thread(target=_remove_all, args=(stale,), name="ftd-peer-copy-free", daemon=True).start()

    def _fetch(self, request: agent_pb2.FetchShardRequest, address: str) -> Fetched:
        dest = self.spool / request.job / f"step-{request.step}" / f"rank-{request.rank}-{request.location}"
        read = agent_pb2.ReadShardRequest(job=request.job, step=request.step, rank=request.rank, tier=request.tier)
        expected = {f.name: (f.size, f.crc32c) for f in request.expected} or None
        with self.open_channel(address) as channel:
            from ftd.v1 import agent_pb2_grpc

            stub = agent_pb2_grpc.AgentStub(channel)
            if self.fast:
                try:
                    return self._fetch_fast(stub, address, read, dest, expected)
                except bulk_copy.BulkError as exc:
                    log.warning("fast copy of %s step %d rank %d from %s failed, using the gRPC stream: %s",
                                request.job, request.step, request.rank, request.location, exc)
            got = fetch_shard(lambda req: stub.ReadShard(req, timeout=self.timeout_s), read, dest, expected)
            return replace(got, verified=expected is not None)

    def _fetch_fast(self, stub: Any, address: str, read: agent_pb2.ReadShardRequest, dest: Path,
                    expected: Mapping[str, tuple[int, str]] | None) -> Fetched:
        """``OpenShard`` (over mTLS), then the files on the holder's dedicated connection; a
        :class:`~.bulk_copy.BulkError` means: fall back to the gRPC stream."""
        started = time.perf_counter()
        try:
            offer = stub.OpenShard(read, timeout=30.0)
        except grpc.RpcError as exc:
            code = rpc_code(exc)
            if code in _UNREACHABLE:
                raise PeerUnreachable(describe(exc)) from exc
            if code is grpc.StatusCode.NOT_FOUND:
                raise CopyMissing(describe(exc)) from exc
            if code is grpc.StatusCode.DATA_LOSS:
                raise CopyCorrupt(describe(exc)) from exc
            raise bulk_copy.BulkError(describe(exc)) from exc  # e.g. UNIMPLEMENTED: an older holder
        if dest.exists():
            shutil.rmtree(dest)
        try:
            nbytes = bulk_copy.receive(parse_hostport(address)[0], offer.port, offer.transfer, offer.key,
                                       [(f.name, f.size, f.crc32c) for f in offer.files], dest, expected,
                                       offer.chunk_bytes or bulk_copy.CHUNK_BYTES, self.timeout_s,
                                       self.landing.take if self.landing is not None else None)
            if not (dest / MANIFEST).exists():
                raise bulk_copy.BulkError(f"the copy of {read.job} step {read.step} rank {read.rank} has no manifest")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return Fetched(dest, nbytes, time.perf_counter() - started, verified=expected is not None)

    def _forget(self, job: str, rank: int, incoming: int | None) -> list[Path]:
        """Earlier copies of this rank in the spool go before a new one comes (the spool may be the
        memory tier: a restore must not leave a shard's worth of RAM behind each time). When the
        spool has room for the ``incoming`` bytes besides them, they are only moved aside here and
        returned, to be freed once the new copy is in (freeing a GiB of tmpfs costs a CPU about
        0.15 s, which a restore need not wait for); otherwise they are removed now."""
        old = list((self.spool / job).glob(f"step-*/rank-{rank}-*"))
        if not old:
            return []
        trash = self.spool / _TRASH
        if incoming is None or not _room(self.spool, incoming):
            _remove_all(old)
            return []
        moved: list[Path] = []
        for path in old:
            target = trash / f"{path.name}-{secrets.token_hex(4)}"
            try:
                trash.mkdir(parents=True, exist_ok=True)
                path.rename(target)
                moved.append(target)
            except OSError:
                shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        return moved


_TRASH = ".stale"  # under the spool: earlier copies moved aside, being freed (and any a crash left there)


def _room(spool: Path, incoming: int) -> bool:
    """Whether the spool's file system has room for ``incoming`` bytes (and a margin) while the old
    copies still hold theirs."""
    try:
        st = os.statvfs(spool if spool.exists() else spool.parent)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= incoming + incoming // 8 + (64 << 20)


def _remove_all(paths: Iterable[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()
