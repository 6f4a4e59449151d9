"""A folder being written to an S3 tier (:class:`S3Staging`), and the pending object that marks it.

Objects go straight under the folder's final prefix; :meth:`S3Staging.publish` uploads what was
written into :meth:`S3Staging.local_dir`, then writes the marker, create-only, as the commit point
(see :mod:`.s3` for why). The staging reaches its store only through :class:`StagingStore`: the
operations of :class:`.s3.S3Backend` it needs, so this module does not import the backend.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from .atomic_files import os_error
from .base import AlreadyPublished, ChecksumMismatch, ObjectInfo, Progress, StorageError, check_key, crc32c_file
from .s3_multipart import MultipartUploader

log = logging.getLogger("ftd.storage_backends.s3")
PENDING = ".ftd-staging"


class StagingStore(Protocol):
    """What a staging uses of its :class:`.s3.S3Backend`."""

    name: str
    _uploads: MultipartUploader

    def put_stream(self, key: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo: ...

    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> ObjectInfo: ...

    def _spool_dir(self, key: str, prefix: str) -> Path: ...

    def _head(self, key: str, full: str) -> dict[str, Any] | None: ...

    def _put_bytes(self, key: str, full: str, data: bytes) -> str: ...

    def _put_create_only(self, key: str, full: str, data: bytes) -> bool: ...

    def _delete_keys(self, key: str, fulls: list[str]) -> None: ...

    def _list_raw(self, full_prefix: str, key: str) -> Iterator[dict[str, Any]]: ...

    def _list_uploads(self, full_prefix: str, key: str) -> Iterator[dict[str, Any]]: ...


def writer_info() -> dict[str, Any]:
    """Who wrote a pending object, for whoever finds it abandoned."""
    return {"at_unix_s": time.time(), "host": socket.gethostname(), "pid": os.getpid()}


class S3Staging:
    """A folder whose objects go straight under the final prefix; :meth:`publish` uploads what was
    written into :meth:`local_dir`, then writes the marker, create-only, as the commit point."""

    def __init__(self, backend: StagingStore, prefix: str, folder: str) -> None:
        self.backend = backend
        self.prefix = prefix
        self._folder = folder
        self._state = "open"  # -> "published" | "aborted" | "lost" (someone else published it)
        self._put: dict[str, ObjectInfo] = {}  # name -> what went to the store
        self._spool: Path | None = None  # local_dir(), made on first use
        self._sealed: dict[str, ObjectInfo] = {}  # local_dir files as objects() reported them

    def _check_open(self) -> None:
        if self._state in ("published", "lost"):
            raise AlreadyPublished(self.backend.name, self.prefix, "this folder was already published")
        if self._state == "aborted":
            raise StorageError(self.backend.name, self.prefix, "this staging was aborted")

    def _key(self, name: str) -> str:
        self._check_open()
        check_key(self.backend.name, name, obj=True)
        return f"{self.prefix}/{name}"

    def _record(self, name: str, info: ObjectInfo) -> ObjectInfo:
        self._put[name] = info
        return info

    def put_stream(self, name: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        return self._record(name, self.backend.put_stream(self._key(name), src, progress))

    def put_file(self, name: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        return self._record(name, self.backend.put_file(self._key(name), path, progress))

    def local_dir(self) -> Path:
        """A private spool dir (in the tier's ``spool_dir``, else the system's temp dir) whose files
        are uploaded, resumably, by :meth:`publish`."""
        self._check_open()
        if self._spool is None:
            self._spool = self.backend._spool_dir(self.prefix, ".ftd-stage-")
        return self._spool

    def _spooled(self) -> list[tuple[str, Path]]:
        """(name, path) of every file written into :meth:`local_dir`, sorted."""
        if self._spool is None:
            return []
        out: list[tuple[str, Path]] = []
        for dirpath, _, filenames in os.walk(self._spool):
            for f in filenames:
                path = Path(dirpath) / f
                if path.is_file():
                    out.append((path.relative_to(self._spool).as_posix(), path))
        return sorted(out)

    def objects(self) -> list[ObjectInfo]:
        self._check_open()
        found = {name: ObjectInfo(name, i.size, i.mtime, i.crc32c) for name, i in self._put.items()}
        for name, path in self._spooled():
            check_key(self.backend.name, name, obj=True)
            try:
                st = path.stat()
                found[name] = self._sealed[name] = ObjectInfo(name, st.st_size, st.st_mtime, crc32c_file(path))
            except OSError as exc:
                raise os_error(self.backend.name, f"{self.prefix}/{name}", path, exc, "read") from exc
        return [found[n] for n in sorted(found)]

    def _upload_spool(self) -> None:
        """Uploads the files of :meth:`local_dir` (resumable: a retried publish skips stored parts)."""
        for name, path in self._spooled():
            info = self.put_file(name, path)
            sealed = self._sealed.get(name)
            if sealed is not None and (sealed.size, sealed.crc32c) != (info.size, info.crc32c):
                raise ChecksumMismatch(self.backend.name, f"{self.prefix}/{name}",
                                       f"changed after objects() reported it: crc32c {sealed.crc32c} size "
                                       f"{sealed.size}, uploaded crc32c {info.crc32c} size {info.size}")

    def _drop_spool(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None

    def publish(self, marker_name: str, marker: bytes) -> None:
        key = self._key(marker_name)
        b = self.backend
        full = self._folder + marker_name
        if b._head(key, full) is not None:
            self._state = "lost"
            self._drop_spool()
            raise AlreadyPublished(b.name, self.prefix, f"marker {marker_name} already exists")
        self._upload_spool()
        # Name the marker in the pending object first: then a crash right after the marker is
        # written leaves a folder that stage() and cleanup() still recognise as published.
        b._put_bytes(self.prefix, self._folder + PENDING, json.dumps({"marker": marker_name, **writer_info()}).encode())
        if not b._put_create_only(key, full, marker):
            self._state = "lost"
            self._drop_spool()
            raise AlreadyPublished(b.name, self.prefix, f"marker {marker_name} was written by another writer")
        self._state = "published"
        self._drop_spool()
        try:
            b._delete_keys(self.prefix, [self._folder + PENDING])
        except StorageError as exc:  # harmless: cleanup() removes a pending object next to a marker
            log.warning("%s: published %s but could not remove its pending object: %s", b.name, self.prefix, exc)

    def abort(self) -> None:
        """Deletes what was staged (and aborts uploads in flight under the folder). After losing a
        publish race the folder is someone else's and nothing is deleted."""
        if self._state != "open":
            return
        self._drop_spool()
        b = self.backend
        for up in b._list_uploads(self._folder, self.prefix):
            b._uploads.abort(self.prefix, up["Key"], up["UploadId"])
        pending = self._folder + PENDING
        keys = [o["Key"] for o in b._list_raw(self._folder, self.prefix) if o["Key"] != pending]
        b._delete_keys(self.prefix, keys)
        b._delete_keys(self.prefix, [pending])
        self._state = "aborted"


__all__ = ["PENDING", "S3Staging", "StagingStore", "writer_info"]
