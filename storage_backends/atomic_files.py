"""Atomic files on a local filesystem, shared by every tier: the local tier stores its objects with
them and the S3 tier downloads with them (``get_file``, ``local_folder``).

* **A file appears whole or not at all.** Bytes go to a hidden temp file in the destination's own
  directory (``.<name>.ftd-tmp-<hex>``, same filesystem, so the rename is atomic), the file is
  fsynced, ``os.replace``-d into place and the directory fsynced: after a crash or power cut a reader
  sees the old file or the new one, never a torn one.
* **The CRC32C is computed while the bytes stream through**, so nothing is read twice to checksum.
* **OS errors are translated once**, by :func:`os_error`: ENOSPC/EDQUOT → :class:`StorageFull`,
  anything else → :class:`StorageError`, the cause chained. On any failure the temp file is removed,
  so a full disk leaves no partial files.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeVar

from .base import CHUNK, Crc32c, Progress, StorageError, StorageFull

T = TypeVar("T")

XATTR_CRC32C = "user.ftd.crc32c"  # where the local tier keeps an object's CRC32C

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def leftover_name(final: Path, kind: str) -> Path:
    """The hidden sibling ``.<name>.ftd-<kind>-<12 hex>`` that becomes ``final`` (or is cleaned)."""
    return final.parent / f".{final.name}.ftd-{kind}-{secrets.token_hex(6)}"


def os_error(backend: str, key: str, path: Path | str, exc: OSError, op: str) -> StorageError:
    """The one table from OS errors to storage errors (callers map ENOENT on reads themselves)."""
    if exc.errno in _FULL_ERRNOS:
        return StorageFull(backend, key, f"no space left on the device holding {path} ({op}: {exc.strerror})")
    return StorageError(backend, key, f"{op} {path}: {exc.strerror or exc}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def in_folder(folder: Path, create: Callable[[], T], tries: int = 3) -> T:
    """``create()`` (a file or folder made in ``folder``) after :func:`make_dirs`; made again when a
    concurrent delete of the folder's last entry removed the emptied folder in between (ENOENT)."""
    for attempt in range(tries):
        make_dirs(folder)
        try:
            return create()
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates, so that a durable object
    is not lost with a directory entry that was never written out."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        fsync_dir(d.parent)


def read_crc_xattr(path: Path | int) -> str | None:
    try:
        value = os.getxattr(path, XATTR_CRC32C).decode("ascii", "replace")
    except OSError:  # no attribute, or a filesystem without user xattrs
        return None
    return value if _CRC_RE.match(value) else None


class AtomicFile(AbstractContextManager["AtomicFile"]):
    """A hidden temp file next to ``dest`` that becomes ``dest`` on :meth:`commit` (fsync, rename,
    fsync of the dir), or disappears when the block exits without a commit. Counts bytes and
    computes the CRC32C of what is written; every OS error is translated (ENOSPC → StorageFull)."""

    def __init__(self, dest: Path, *, backend: str, key: str) -> None:
        self.dest = dest
        self.backend = backend
        self.key = key
        self.tmp = leftover_name(dest, "tmp")
        self.size = 0
        self._crc = Crc32c()
        self._fd: int | None = None
        self._committed = False

    def _fail(self, exc: OSError, op: str) -> StorageError:
        return os_error(self.backend, self.key, self.dest, exc, op)

    def __enter__(self) -> AtomicFile:
        try:
            self._fd = in_folder(self.dest.parent, lambda: os.open(
                self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            raise self._fail(exc, "create") from exc
        return self

    def write(self, data: bytes) -> None:
        assert self._fd is not None, "AtomicFile used outside its with-block"
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise self._fail(exc, "write") from exc
        self._crc.update(data)
        self.size += len(data)

    def crc32c(self) -> str:
        return self._crc.hexdigest()

    def commit(self, *, crc_xattr: str | None = None) -> None:
        assert self._fd is not None, "AtomicFile used outside its with-block"
        try:
            if crc_xattr is not None:
                with suppress(OSError):  # a filesystem without user xattrs: crc32c is unknown later
                    os.setxattr(self._fd, XATTR_CRC32C, crc_xattr.encode("ascii"))
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp, self.dest)
            self._committed = True
            fsync_dir(self.dest.parent)
        except OSError as exc:
            raise self._fail(exc, "commit") from exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            with suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if not self._committed:
            with suppress(OSError):
                os.unlink(self.tmp)


def copy_into(out: AtomicFile, src: BinaryIO, progress: Progress | None) -> None:
    """Streams ``src`` into ``out`` in :data:`CHUNK` pieces. Errors reading ``src`` are the caller's
    (its own stream) and pass through untranslated."""
    while block := src.read(CHUNK):
        out.write(block)
        if progress is not None:
            progress(len(block))


__all__ = [
    "XATTR_CRC32C",
    "AtomicFile",
    "copy_into",
    "fsync_dir",
    "fsync_file",
    "in_folder",
    "leftover_name",
    "make_dirs",
    "os_error",
    "read_crc_xattr",
]
