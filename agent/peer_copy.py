"""The peer copy path: one agent streams a published shard copy from one of its tiers to another
agent, which writes it into its spool and verifies it before anybody loads it.

A spare that inherits a dead rank's shard, on a cluster whose slower tiers are node-local, can only
find that shard on a surviving node (a replica in its memory tier, a copy on its SSD). Streaming
through the agents keeps the training process out of the network path and lets the agents'
identities (mTLS) authorise it. Every file carries its CRC32C, computed by the sender while reading
and checked by the receiver while writing; the catalog's checksums are checked on top when known.
The receiver writes through :func:`ftd.checkpoints.copy.copy_shard` (whichever transport: the gRPC
stream, :class:`ChunkSource`, or the fast path of :mod:`.bulk_copy`), so a pulled copy lands in the
spool laid out as on any tier (``<spool>/<job>/step-…/rank-…/``) and appears only once complete and
checked; a buddy's replica (:mod:`.replica_intake`: pulled over the holder's bulk port through
:class:`BulkSource`, or pushed on the ``WriteShard`` stream through :class:`ChunkSource`) arrives
the same way.

Failures keep their meaning, because restore depends on it (:mod:`.errors` holds the classes and
the status codes they travel as): a peer that cannot be reached is :class:`PeerUnreachable` (the
copy is skipped, never recorded corrupt); bytes that arrive wrong are :class:`CopyCorrupt`; a copy
the peer does not hold is :class:`CopyMissing`.
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
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from ftd.checkpoints.copy import CopyMismatch, Expected, Landed, copy_shard
from ftd.checkpoints.layout import (
    MANIFEST,
    BadIdentifier,
    ManifestError,
    ShardManifest,
    check_file_name,
    check_job,
    check_rank,
    check_step,
    shard_prefix,
)
from ftd.rpc import describe, parse_hostport
from ftd.storage_backends.base import Crc32c, ObjectInfo, ObjectNotFound, Staging, StorageBackend, StorageError
from ftd.storage_backends.local import LocalBackend
from ftd.v1 import agent_pb2

from . import bulk_copy
from .errors import AgentError, CopyCorrupt, CopyMissing, PeerCopyError, PeerUnreachable, peer_error
from .landing import LandingReserve, Slot

log = logging.getLogger("ftd.agent.peer_copy")

CHUNK_BYTES = 1 << 20  # per message: well under gRPC's 4 MiB default, large enough for full speed
MAX_MANIFEST_BYTES = 1 << 20  # a manifest arriving on a chunk stream is read into memory: bounded


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


class ChunkSource:
    """A ``ShardChunk`` stream (``ReadShard``'s answer, ``WriteShard``'s body) as a
    :class:`~ftd.checkpoints.copy.ShardSource`: the files one after the other, each read as it
    arrives and closed by the CRC32C its sender read, the manifest last. A stream that breaks its
    framing is :class:`~.errors.CopyCorrupt`; a file name, a repeated file or a manifest that no
    sender may send is ``malformed`` (a pushed replica answers it as a bad request). ``budget`` is
    told every chunk's size (and may refuse it)."""

    def __init__(self, chunks: Iterable[agent_pb2.ShardChunk], where: str,
                 malformed: type[AgentError] = CopyCorrupt, budget: Callable[[int], None] | None = None) -> None:
        self.chunks = iter(chunks)
        self.where = where
        self.malformed = malformed
        self.budget = budget
        self.raw_manifest: bytes | None = None

    def write(self, staging: Staging, landed: Landed) -> None:
        seen: set[str] = set()
        for first in self.chunks:
            stream = _FileStream(first, self.chunks, self.budget)
            if first.name == MANIFEST:
                raw = b""
                while block := stream.read():
                    raw += block
                    if len(raw) > MAX_MANIFEST_BYTES:
                        raise self.malformed(f"the manifest from {self.where} is too large")
                self.raw_manifest = raw
                return  # the manifest comes last
            try:
                check_file_name(first.name)
            except BadIdentifier as exc:
                raise self.malformed(f"refusing the file name {first.name[:100]!r}") from exc
            if first.name in seen:
                raise self.malformed(f"{first.name}: sent twice")
            seen.add(first.name)
            landed(first.name, staging.put_stream(first.name, stream), stream.sent_crc)  # type: ignore[arg-type]

    def manifest(self, received: Expected) -> bytes:
        if self.raw_manifest is None:
            raise CopyCorrupt(f"the copy from {self.where} has no manifest")
        return self.raw_manifest



class _FileStream:
    """One file of a chunk stream, as a readable stream for :meth:`Staging.put_stream`."""

    def __init__(self, first: agent_pb2.ShardChunk, rest: Iterator[agent_pb2.ShardChunk],
                 budget: Callable[[int], None] | None) -> None:
        self.name = first.name
        self._next: agent_pb2.ShardChunk | None = first
        self._rest = rest
        self._budget = budget
        self.sent_crc = ""
        self.done = False

    def read(self, n: int = -1) -> bytes:
        while not self.done:
            chunk = self._next
            self._next = None
            if chunk is None:
                chunk = next(self._rest, None)
                if chunk is None:
                    raise CopyCorrupt(f"{self.name}: the stream ended inside the file")
            if chunk.name != self.name:
                raise CopyCorrupt(f"{self.name}: the stream moved to {chunk.name[:100]!r} before the file ended")
            if self._budget is not None:
                self._budget(len(chunk.data))
            if chunk.end_of_file:
                self.done, self.sent_crc = True, chunk.crc32c
            if chunk.data:
                return bytes(chunk.data)
        return b""


def receive_shard(chunks: Iterable[agent_pb2.ShardChunk], spool: LocalBackend, prefix: str,
                  expected: Mapping[str, tuple[int, str]] | None = None) -> int:
    """Writes a streamed copy into ``spool``'s folder ``prefix`` (:func:`~ftd.checkpoints.copy.copy_shard`:
    published only once every file matched what its sender read and ``expected``, name → (size,
    crc32c) from the catalog); returns the bytes received."""
    try:
        return copy_shard(ChunkSource(chunks, f"the stream of {prefix}"), spool, prefix, expected,
                          says="the catalog").bytes
    except CopyMismatch as exc:
        raise CopyCorrupt(str(exc)) from exc


def fetch_shard(read_shard: Callable[[agent_pb2.ReadShardRequest], Iterable[agent_pb2.ShardChunk]],
                request: agent_pb2.ReadShardRequest, spool: LocalBackend,
                expected: Mapping[str, tuple[int, str]] | None = None) -> Fetched:
    """Pulls one copy from a peer agent (``read_shard`` is its stub's ``ReadShard`` with a deadline
    bound in) into ``spool`` (:func:`~ftd.checkpoints.layout.shard_prefix`); on any failure nothing
    of it is left there and the error says which kind."""
    started = time.perf_counter()
    prefix = shard_prefix(request.job, request.step, request.rank)
    try:
        nbytes = receive_shard(read_shard(request), spool, prefix, expected)
    except grpc.RpcError as exc:
        err = peer_error(exc)
        raise (err if isinstance(err, PeerCopyError) else PeerCopyError(describe(exc))) from exc
    return Fetched(spool.folder_path(prefix), nbytes, time.perf_counter() - started)


class BulkSource:
    """The fast path's files (:func:`.bulk_copy.receive`: every file's CRC32C checked as it lands,
    against ``expected`` or else the holder's manifest) landed straight into the staging's
    directory, so that a prepared slot of the landing reserve is renamed into place, not copied."""

    def __init__(self, host: str, offer: agent_pb2.OpenShardResponse, expected: Mapping[str, tuple[int, str]] | None,
                 timeout_s: float, landing: Callable[[str, int], Slot | None] | None) -> None:
        self.host, self.offer, self.expected, self.timeout_s, self.landing = host, offer, expected, timeout_s, landing
        self.where = f"{host}:{offer.port}"
        self.bytes = 0
        self._dir: Path | None = None

    def write(self, staging: Staging, landed: Landed) -> None:
        self._dir = staging.local_dir()
        files = [(f.name, f.size, f.crc32c) for f in self.offer.files]
        self.bytes = bulk_copy.receive(self.host, self.offer.port, self.offer.transfer, self.offer.key, files,
                                       self._dir, self.expected, self.offer.chunk_bytes or bulk_copy.CHUNK_BYTES,
                                       self.timeout_s, self.landing)
        for name, size, holder_crc in files:
            if name != MANIFEST:
                checked = (self.expected or {}).get(name, (size, holder_crc))[1] or holder_crc
                landed(name, ObjectInfo(name, size, time.time(), checked or None), None)

    def manifest(self, received: Expected) -> bytes:
        if self._dir is None or not (self._dir / MANIFEST).is_file():
            raise bulk_copy.BulkError(f"the copy from {self.where} has no manifest")
        return (self._dir / MANIFEST).read_bytes()


class PeerFetcher:
    """The receiving side for this node's training processes: finds the agent of the node holding a
    copy (by the addresses in this node's assignment, :func:`.peers.address_of`), pulls the copy into
    ``spool`` and answers where."""

    def __init__(self, node_agent: Callable[[str], str], open_channel: Callable[[str], grpc.Channel], spool: Path,
                 timeout_s: float = 120.0, fast: bool = True,
                 landing: LandingReserve | None = None) -> None:
        self.node_agent = node_agent  # node id -> its agent's address ("" when unknown or gone)
        self.open_channel = open_channel
        self.spool = spool
        self.copies = LocalBackend(spool)  # pulled copies, laid out as on any tier (layout.shard_prefix)
        self.timeout_s = timeout_s
        self.fast = fast  # try the holder's fast path (OpenShard, ftd.agent.bulk_copy) before ReadShard
        self.landing = landing  # prepared room for the fast path (ftd.agent.landing)
        self._flights: dict[tuple[str, int, int, str, str], futures.Future[Fetched]] = {}
        self._flights_lock = threading.Lock()
        shutil.rmtree(spool / _TRASH, ignore_errors=True)  # what an earlier run left being freed
        with contextlib.suppress(StorageError):
            self.copies.cleanup("", older_than_s=0.0)  # pulls an earlier run left half-done

    def fetch(self, request: agent_pb2.FetchShardRequest) -> Fetched:
        """One copy pulled once: a request for a copy being pulled (the restore prefetch,
        :mod:`.restore_prefetch`, or another caller) waits for that pull; one for a copy pulled
        before that is still in the spool gets it at once; a failed pull is tried again next time."""
        key = (request.job, request.step, request.rank, request.tier, request.location)
        with self._flights_lock:
            flight = self._flights.get(key)
            if flight is not None and flight.done() and (flight.exception() is not None
                                                         or not (flight.result().path / MANIFEST).exists()):
                flight = None  # failed, or its copy was replaced since: pull again
            mine = flight is None
            if flight is None:
                flight = futures.Future()
                self._flights[key] = flight
        log.info("pull of job %s step %d rank %d from %s: %s", request.job, request.step, request.rank,
                 request.location, "pulling it now" if mine else "already pulled or in flight: waiting for that pull")
        if not mine:
            got = flight.result(timeout=self.timeout_s + 30.0)
            log.info("FetchShard of job %s step %d rank %d from %s: answered with the copy already pulled (%d bytes)",
                     request.job, request.step, request.rank, request.location, got.bytes)
            return got
        try:
            got = self._pull(request)
        except BaseException as exc:
            flight.set_exception(exc)
            raise
        with self._flights_lock:  # this pull replaced the rank's earlier copies in the spool (_forget)
            for other in [k for k in self._flights if k[0] == key[0] and k[2] == key[2] and k != key]:
                del self._flights[other]
        flight.set_result(got)
        return got

    def _pull(self, request: agent_pb2.FetchShardRequest) -> Fetched:
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
        read = agent_pb2.ReadShardRequest(job=request.job, step=request.step, rank=request.rank, tier=request.tier)
        expected = {f.name: (f.size, f.crc32c) for f in request.expected} or None
        with self.open_channel(address) as channel:
            from ftd.v1 import agent_pb2_grpc

            stub = agent_pb2_grpc.AgentStub(channel)
            if self.fast:
                try:
                    return self._fetch_fast(stub, address, read, expected)
                except bulk_copy.BulkError as exc:
                    log.warning("fast copy of %s step %d rank %d from %s failed, using the gRPC stream: %s",
                                request.job, request.step, request.rank, request.location, exc)
            got = fetch_shard(lambda req: stub.ReadShard(req, timeout=self.timeout_s), read, self.copies, expected)
            return replace(got, verified=expected is not None)

    def _fetch_fast(self, stub: Any, address: str, read: agent_pb2.ReadShardRequest,
                    expected: Mapping[str, tuple[int, str]] | None) -> Fetched:
        """``OpenShard`` (over mTLS), then the files on the holder's dedicated connection; a
        :class:`~.bulk_copy.BulkError` means: fall back to the gRPC stream."""
        started = time.perf_counter()
        try:
            offer = stub.OpenShard(read, timeout=30.0)
        except grpc.RpcError as exc:
            err = peer_error(exc)
            if isinstance(err, PeerCopyError):
                raise err from exc
            raise bulk_copy.BulkError(describe(exc)) from exc  # e.g. UNIMPLEMENTED: an older holder
        prefix = shard_prefix(read.job, read.step, read.rank)
        source = BulkSource(parse_hostport(address)[0], offer, expected, self.timeout_s,
                            self.landing.take if self.landing is not None else None)
        try:
            copy_shard(source, self.copies, prefix, expected, says="the catalog")
        except CopyMismatch as exc:  # checked by the receive already: only a bug gets here
            raise bulk_copy.BulkError(str(exc)) from exc
        return Fetched(self.copies.folder_path(prefix), source.bytes, time.perf_counter() - started,
                       verified=expected is not None)

    def _forget(self, job: str, rank: int, incoming: int | None) -> list[Path]:
        """Earlier copies of this rank in the spool go before a new one comes (the spool may be the
        memory tier: a restore must not leave a shard's worth of RAM behind each time). When the
        spool has room for the ``incoming`` bytes besides them, they are only moved aside here and
        returned, to be freed once the new copy is in (freeing a GiB of tmpfs costs a CPU about
        0.15 s, which a restore need not wait for); otherwise they are removed now."""
        old = list((self.spool / job).glob(f"step-*/rank-{rank:05d}"))
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
