"""The fast path of the peer copy: a shard's files on a dedicated TCP connection, AES-GCM encrypted.

gRPC streams from Python move about 0.4-0.9 GB/s here, a third of what a plain socket moves on the
same loopback; a restore from a peer's memory is a network copy and should run near the network's
speed. So the holder's agent offers the copy (the ``OpenShard`` RPC, over mTLS, authorised like
``ReadShard``) and sends it on a plain TCP connection:

* the answer carries a port, a random 16-byte transfer id and a random AES-128 key, single use,
  valid for :data:`OFFER_TTL_S`; the receiver connects, sends the transfer id, and reads;
* the files follow in order, each in records of ``chunk_bytes`` (1 MiB; the last one shorter; an empty
  file is one empty record), every record sealed with AES-GCM: nonce = (file index, record index),
  the transfer id as associated data. The receiver knows every file's size from the answer, so a
  record that is missing, reordered, truncated, replayed from another transfer or altered fails its
  tag; the key never crossed the wire in clear (the answer came over mTLS), so the bytes are as
  private and as authenticated as on the gRPC path. AES-GCM runs at 8-9 GB/s a core here and
  releases the GIL. The copy is CPU-bound on loopback (the cipher on both ends, two socket copies,
  the landing): the holder seals and sends in one thread, straight from the file's pages; the
  receiver opens each record as it arrives straight into the slot of the landing reserve prepared
  for it (:mod:`.landing`), else into a buffer that a second thread writes into the file;
* the receiver checks every file's CRC32C (the catalog's, ``expected``, else the holder's manifest's)
  on the plaintext as it lands, still in cache, and a file appears under its name only once it
  matched. The holder does not hash what it sends (that pass cost the sender, the slower end, a
  tenth of its time): a copy corrupt at rest fails the receiver's check, and the caller's fallback,
  the ``ReadShard`` stream, checks the holder's copy there and has the holder record it corrupt.

Replication uses the same offers the other way round: the holder announces a memory snapshot to
its buddy with ``PullReplica`` (the offer in the mTLS call) and the buddy receives it
(:mod:`.replica_intake`); an offer nobody took is withdrawn, and ``pace`` lets the replicator's
bandwidth cap hold on this path too.

Any failure here is a :class:`BulkError`; the caller falls back to the gRPC stream (``ReadShard``,
``WriteShard``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c as _crc32c
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ftd.checkpoints.layout import MANIFEST, ManifestError, ShardManifest, shard_prefix
from ftd.storage_backends.base import InPlace, StorageBackend

from .landing import Slot

log = logging.getLogger("ftd.agent.bulk_copy")
CHUNK_BYTES = 1 << 20  # per record: measured a little faster than 4 MiB (the buffers stay in cache)
OFFER_TTL_S = 60.0
ID_TIMEOUT_S = 5.0  # a connection must present its transfer id this soon
MAX_UNIDENTIFIED = 64  # connections not yet past their transfer id; more are closed at once
SEND_IDLE_S = 30.0  # a receiver that takes no bytes this long is dropped (agent setting peer_idle_timeout_s)
TAG = 16
_ID_BYTES = 16
_DEPTH = 3  # opened records waiting for the receiver's writer thread


class BulkError(Exception):
    """The fast path failed (refused, unreachable, cut, or a record that does not open)."""


class NotADirectoryTier(BulkError):
    """The tier holds no local files to send (an object store): use the gRPC stream."""


class CopyNotHere(BulkError):
    """No published copy of the shard on this tier."""


@dataclass(frozen=True)
class OfferedFile:
    name: str
    path: Path
    size: int
    crc32c: str  # from the holder's manifest ("" for the manifest itself): what the receiver checks without a catalog


@dataclass(frozen=True)
class Offer:
    transfer: bytes
    key: bytes
    files: tuple[OfferedFile, ...]
    expires: float
    pace: Callable[[int], None] | None = None  # called before each record with its size (a rate cap)
    done: Callable[[], None] | None = None  # called once when the offer is sent, fails, expires or is withdrawn


def shard_files(backend: StorageBackend, job: str, step: int, rank: int) -> list[OfferedFile]:
    """The files of one published shard on a directory tier, manifest last, with the manifest's
    CRC32Cs (raises :class:`NotADirectoryTier`, :class:`CopyNotHere`)."""
    if not isinstance(backend, InPlace):
        raise NotADirectoryTier(f"{backend.name} is no directory tier")
    prefix = shard_prefix(job, step, rank)
    if not backend.is_published(prefix, MANIFEST):
        raise CopyNotHere(f"{backend.name}: no published copy of {prefix}")
    folder = backend.folder_path(prefix)
    try:
        raw = (folder / MANIFEST).read_bytes()
        crcs = {f.name: f.crc32c for f in ShardManifest.decode(prefix, raw).files}
    except ManifestError:
        crcs = {}  # the receiver checks against the catalog anyway
    except OSError as exc:
        raise CopyNotHere(f"{backend.name}: {prefix}: {exc}") from exc
    out = []
    for info in sorted(backend.list(prefix + "/"), key=lambda i: (i.key.endswith("/" + MANIFEST), i.key)):
        name = info.key.rsplit("/", 1)[-1]
        out.append(OfferedFile(name, folder / name, info.size, crcs.get(name, "")))
    return out


def _nonce(file_index: int, record: int) -> bytes:
    return file_index.to_bytes(4, "big") + record.to_bytes(8, "big")


def _records(size: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(index, length) of the records of a file of ``size`` bytes."""
    if size == 0:
        yield 0, 0
        return
    for i, offset in enumerate(range(0, size, chunk)):
        yield i, min(chunk, size - offset)


# ---- the holder ------------------------------------------------------------------------------------------


class BulkServer:
    """The holder's side: a TCP listener (started on the first offer) that sends each offered copy
    once, to whoever presents its transfer id first, within :data:`OFFER_TTL_S`."""

    def __init__(self, host: str, port: int = 0, chunk_bytes: int = CHUNK_BYTES,
                 clock: Callable[[], float] = time.monotonic, idle_s: float = SEND_IDLE_S) -> None:
        self.host = host
        self.port = port
        self.chunk_bytes = chunk_bytes
        self.clock = clock
        self.idle_s = idle_s
        self._unidentified = threading.BoundedSemaphore(MAX_UNIDENTIFIED)
        self._offers: dict[bytes, Offer] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False

    def offer(self, files: Sequence[OfferedFile], pace: Callable[[int], None] | None = None,
              done: Callable[[], None] | None = None) -> tuple[int, Offer]:
        """Registers one copy; returns the port and the offer (its transfer id and key for the answer).
        ``pace`` is called before each record is sent, with its size (a bandwidth cap sleeps there);
        ``done`` once the offer is over (sent, failed, expired or withdrawn: a peer's ticket released)."""
        try:
            port = self._listen()
        except BaseException:
            if done is not None:
                done()
            raise
        offer = Offer(secrets.token_bytes(_ID_BYTES), AESGCM.generate_key(bit_length=128), tuple(files),
                      self.clock() + OFFER_TTL_S, pace, done)
        self.purge()
        with self._lock:
            self._offers[offer.transfer] = offer
        return port, offer

    def purge(self) -> None:
        """Forgets the offers past their time (their ``done`` called)."""
        now = self.clock()
        with self._lock:
            gone = [self._offers.pop(t) for t, o in list(self._offers.items()) if o.expires < now]
        for offer in gone:
            _finished(offer)

    def withdraw(self, transfer: bytes) -> None:
        """Forgets an offer nobody took (a copy already in flight goes on)."""
        with self._lock:
            offer = self._offers.pop(transfer, None)
        if offer is not None:
            _finished(offer)

    def _listen(self) -> int:
        with self._lock:
            if self._closed:
                raise BulkError("the fast peer copy path is closed")
            if self._sock is None:
                sock = socket.create_server((self.host, self.port), family=_family(self.host), backlog=64)
                self._sock = sock
                threading.Thread(target=self._accept, args=(sock,), name="ftd-bulk-accept", daemon=True).start()
            return int(self._sock.getsockname()[1])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return  # closed
            if not self._unidentified.acquire(blocking=False):  # a flood of idle connections: not one thread each
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="ftd-bulk-send", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        offer: Offer | None = None
        with conn:
            try:
                try:
                    conn.settimeout(ID_TIMEOUT_S)
                    transfer = _recv_exact(conn, _ID_BYTES)
                finally:
                    self._unidentified.release()
                with self._lock:
                    offer = self._offers.pop(transfer, None)
                if offer is None or offer.expires < self.clock():
                    log.warning("fast peer copy: refused a connection from %s with an unknown or expired transfer id",
                                peer)
                    return
                conn.settimeout(self.idle_s)  # per record: a receiver that stops reading is dropped
                _send(conn, offer, self.chunk_bytes)
            except (OSError, BulkError) as exc:
                log.warning("fast peer copy to %s stopped: %s", peer, exc)
            finally:
                if offer is not None:
                    _finished(offer)


def _finished(offer: Offer) -> None:
    if offer.done is not None:
        offer.done()


def _send(conn: socket.socket, offer: Offer, chunk: int) -> None:
    """Seals each record straight from the file's pages into one reused buffer, then sends it: one
    thread (the copy is CPU-bound; handing records to a sending thread cost more CPU than it
    overlapped, measured with bench/checkpoint.py)."""
    out = bytearray(chunk + TAG)
    for index, f in enumerate(offer.files):
        with _mapped(f.path, f.size) as data:
            if len(data) != f.size:
                raise BulkError(f"{f.path}: {len(data)} bytes, not the {f.size} offered")
            for record, length in _records(f.size, chunk):
                if offer.pace is not None:
                    offer.pace(length)
                with data[record * chunk:record * chunk + length] as piece:
                    sealer = Cipher(algorithms.AES(offer.key), modes.GCM(_nonce(index, record))).encryptor()
                    sealer.authenticate_additional_data(offer.transfer)
                    n = sealer.update_into(piece, out)
                sealer.finalize()
                out[n:n + TAG] = sealer.tag
                conn.sendall(memoryview(out)[:n + TAG])


def _last(record: int, size: int, chunk: int) -> bool:
    return record == (max(0, size - 1) // chunk if size else 0)


@contextlib.contextmanager
def _mapped(path: Path, size: int) -> Iterator[memoryview]:
    """A file's bytes without a copy (its pages: on tmpfs, the memory tier itself)."""
    with open(path, "rb") as f:
        if size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                yield view
            finally:
                view.release()


# ---- the receiver ----------------------------------------------------------------------------------------


def receive(host: str, port: int, transfer: bytes, key: bytes, files: Sequence[tuple[str, int, str]], dest: Path,
            expected: Mapping[str, tuple[int, str]] | None = None, chunk: int = CHUNK_BYTES,
            timeout_s: float = 120.0, landing: Callable[[str, int], Slot | None] | None = None) -> int:
    """Receives an offered copy into ``dest`` (a fresh directory): ``files`` are (name, size,
    holder's crc32c) in the offer's order. Every record's tag is checked, and every file's CRC32C
    against ``expected`` (the catalog's; the holder's when the catalog names no sum for the file).
    A file is renamed into place only once it matched. Returns the bytes received; raises
    :class:`BulkError`.

    Two threads, each about half the work (this is CPU-bound: on loopback the copies, the cipher
    and the landing cost more than the wire): this one receives a record and opens it into a free
    buffer (the cipher releases the GIL); a writer copies the plaintext into the file
    (``pwrite`` into tmpfs: the bytes land in the memory tier's pages, which whoever loads the
    copy maps) and hands the buffer back.

    ``landing`` (the agent's :class:`~.landing.LandingReserve`) may offer a prepared slot for a
    file: its records are then opened straight into the slot's mapped pages (one copy fewer, no
    page allocated or faulted in on the way), and the slot is renamed into
    place once the file matched."""
    dest.mkdir(parents=True, exist_ok=True)
    if expected is not None:
        sizes = {name: size for name, size, _ in files}
        for name, (size, _) in expected.items():
            if sizes.get(name) != size:
                raise BulkError(f"{name}: the holder offers {sizes.get(name)} bytes, the catalog says {size}")
    for name, _, _ in files:
        _Landing.check_name(name)
    stop = threading.Event()
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(_DEPTH + 2):
        free.put(bytearray(chunk + TAG))
    opened: queue.Queue[tuple[_Landing, int, bytearray, int, bool] | None] = queue.Queue()
    landings: list[_Landing] = []
    errors: list[BaseException] = []

    def write() -> None:  # copies opened records into their files while this thread receives the next ones
        try:
            while (item := _get(opened, stop)) is not None:
                out, offset, buf, length, last = item
                out.write(offset, memoryview(buf)[:length])
                free.put(buf)
                if last:
                    out.commit()
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    writer = threading.Thread(target=write, name="ftd-bulk-land", daemon=True)
    writer.start()
    sealed = memoryview(bytearray(chunk + TAG))  # each record as it came off the wire
    total = 0
    try:
        with socket.create_connection((host, port), timeout=10.0) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(transfer)
            for index, (name, size, holder_crc) in enumerate(files):
                want = (expected or {}).get(name, (size, holder_crc))[1] or holder_crc
                check = bool(want)
                slot = landing(name, size) if landing is not None else None
                if slot is not None:
                    try:
                        total += _receive_into_slot(conn, slot, sealed, key, transfer, index, name, size, chunk,
                                                   want if check else "")
                        slot.finish(dest / name, size)
                    except BaseException:
                        slot.discard()
                        raise
                    continue
                out = _Landing(dest, name, size)
                landings.append(out)
                crc = 0
                for record, length in _records(size, chunk):
                    buf = _get(free, stop)
                    if buf is None:
                        break
                    view = memoryview(buf)
                    _recv_into(conn, sealed[:length + TAG])
                    opener = Cipher(algorithms.AES(key), modes.GCM(_nonce(index, record),
                                                                   bytes(sealed[length:length + TAG]))).decryptor()
                    opener.authenticate_additional_data(transfer)
                    opener.update_into(sealed[:length], view)
                    try:
                        opener.finalize()
                    except InvalidTag as exc:
                        raise BulkError(f"{name}: record {record} does not open (altered, reordered or cut)") from exc
                    if check:
                        crc = _crc32c.crc32c(view[:length], crc)
                    view.release()
                    last = _last(record, size, chunk)
                    if last and check and f"{crc:08x}" != want:
                        raise BulkError(f"{name}: crc32c {crc:08x} received, expected {want}")
                    total += length
                    opened.put((out, record * chunk, buf, length, last))
                if stop.is_set():
                    break
    except OSError as exc:
        errors.append(BulkError(f"fast peer copy from {host}:{port} failed: {exc}"))
    except BaseException as exc:
        errors.append(exc)
    finally:
        opened.put(None)  # the writer lands what was opened before any error (each file of it matched) and ends
        writer.join(timeout_s)
        if writer.is_alive():  # stuck writing into the spool: nothing of this copy may be used
            stop.set()
            errors.append(BulkError(f"writing the copy into {dest} did not finish in {timeout_s:.0f} s"))
        for out in landings:
            if not out.done:
                out.abort()
    if errors:
        err = errors[0]
        raise err if isinstance(err, BulkError) else BulkError(f"{type(err).__name__}: {err}")
    return total


def _receive_into_slot(conn: socket.socket, slot: Slot, sealed: memoryview, key: bytes, transfer: bytes, index: int,
                      name: str, size: int, chunk: int, want: str) -> int:
    """One file's records received into ``sealed`` and opened straight into ``slot``'s mapping
    (``want``: the CRC32C the plaintext must have, "" for none).

    Not opened in place: cryptography 51 refuses overlapping input and output buffers ("data and
    buf must not overlap"), and a record read into a reused 1 MiB buffer costs the same."""
    crc = 0
    with memoryview(slot.map) as mapped:
        for record, length in _records(size, chunk):
            start = record * chunk
            with mapped[start:start + length] as piece, mapped[start:start + length + TAG] as room:
                _recv_into(conn, sealed[:length + TAG])
                opener = Cipher(algorithms.AES(key), modes.GCM(_nonce(index, record),
                                                               bytes(sealed[length:length + TAG]))).decryptor()
                opener.authenticate_additional_data(transfer)
                opener.update_into(sealed[:length], room)  # the cipher wants a block of room past the bytes
                try:
                    opener.finalize()
                except InvalidTag as exc:
                    raise BulkError(f"{name}: record {record} does not open (altered, reordered or cut)") from exc
                if want:
                    crc = _crc32c.crc32c(piece, crc)
    if want and f"{crc:08x}" != want:
        raise BulkError(f"{name}: crc32c {crc:08x} received, expected {want}")
    return size


def _get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    """The next item of ``q``, or ``None`` once ``stop`` is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            continue
    return None


class _Landing:
    """A file being received under a hidden name (``pwrite`` from a reused buffer: on tmpfs twice
    as fast as faulting in a fresh mapping), renamed into place by :meth:`commit` once complete and
    checked."""

    def __init__(self, dest: Path, name: str, size: int) -> None:
        self.check_name(name)
        self.part, self.final = dest / f".{name}.part", dest / name
        self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.done = False

    @staticmethod
    def check_name(name: str) -> None:
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise BulkError(f"refusing the file name {name!r}")

    def write(self, offset: int, data: memoryview) -> None:
        while data:
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def commit(self) -> None:
        os.close(self.fd)
        os.replace(self.part, self.final)
        self.done = True

    def abort(self) -> None:
        self.done = True
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            self.part.unlink()


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise BulkError(f"the holder closed the connection {len(view) - got} bytes early")
        got += n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


__all__ = ["CHUNK_BYTES", "BulkError", "BulkServer", "CopyNotHere", "NotADirectoryTier", "Offer", "OfferedFile",
           "Slot", "receive", "shard_files"]
