"""A storage tier on S3-compatible object storage, with boto3.

This module is the backend: keys, objects, folders and their atomic publish. A folder being written
is :mod:`.s3_staging`'s :class:`~.s3_staging.S3Staging`, resumable multipart uploads are
:mod:`.s3_multipart`'s, retries and error translation :mod:`.s3_errors`' (every call goes through
:meth:`.s3_errors.S3Caller.call`).

Why it is written this way:

* **Objects up to ``part_size`` go in one PutObject**, larger ones as a resumable multipart upload
  (:class:`.s3_multipart.MultipartUploader`). The whole-object CRC32C is stored as user metadata
  ``ftd-crc32c`` and sent as the checksum S3 verifies; ``get_file`` recomputes it and compares.
  ``put_stream`` spools a stream larger than one part to a temp file, since the metadata must be
  known before the upload starts. botocore's own request/response checksums are switched off
  (``when_required``) so nothing is computed twice.
* **Atomic publish by a marker object written last**, create-only (``If-None-Match: *``), so two
  writers can never both publish a folder. Objects are staged straight under the final prefix;
  :meth:`S3Staging.publish` is the commit point, and readers trust a folder only when
  :meth:`S3Backend.is_published` says so (listing shows staged objects before that).
* **A pending object** (``<folder>/.ftd-staging``) is written when a folder is staged (or deleted) and
  removed after publish; before the marker is written it records the marker's name. It is what lets
  :meth:`S3Backend.cleanup` remove abandoned folders without ever touching objects written outside a
  staging, and lets a restarted writer stage the same folder again to resume its uploads.
* **Files for path-based writers and readers are spooled in ``spool_dir``** (default ``state_dir``,
  else the system's temp dir; the agent points it at the node's SSD tier, the disk sized for
  checkpoints): :meth:`S3Staging.local_dir` is uploaded at publish, :meth:`S3Backend.local_folder`
  downloads there, each object verified against its CRC32C.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

from .atomic_files import AtomicFile, os_error
from .base import (
    CHUNK,
    AlreadyPublished,
    ChecksumMismatch,
    ObjectInfo,
    Progress,
    StorageError,
    check_key,
    crc32c_hex,
    folder_of,
    is_reserved,
    validate_key,
)
from .s3_errors import NOT_FOUND, PRECONDITION, S3Caller, error_code, http_status, is_transient, or_none
from .s3_multipart import (
    META_CRC32C,
    MIN_PART,
    PART_CHECKSUMS,
    MiB,
    MultipartUploader,
    checksum_args,
    crc_b64,
    meta_crc,
)
from .s3_staging import PENDING, S3Staging, writer_info

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MARKER = "MANIFEST.json"
META_PUBLISH_ID = "ftd-publish-id"
_DELETE_BATCH = 1000  # DeleteObjects limit


def _read_upto(src: BinaryIO, limit: int) -> bytes:
    buf = bytearray()
    while len(buf) < limit:
        block = src.read(min(CHUNK, limit - len(buf)))
        if not block:
            break
        buf += block
    return bytes(buf)


class _BodyReader(io.RawIOBase):
    """A GetObject body as a raw stream whose network errors arrive as :class:`StorageUnavailable`."""

    def __init__(self, calls: S3Caller, key: str, body: Any) -> None:
        super().__init__()
        self._calls = calls
        self._key = key
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._body.read(len(view))
        except BotoCoreError as exc:
            raise self._calls.translate("GetObject", self._key, exc, 1) from exc
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with suppress(Exception):
            self._body.close()
        super().close()


def make_client(
    endpoint_url: str | None,
    region: str,
    *,
    concurrency: int = 4,
    connect_timeout_s: float = 2.0,
    read_timeout_s: float = 10.0,
    aws_access_key_id: str | None = None,
    aws_secret_access_key: str | None = None,
    session: Any = None,
) -> Any:
    """A boto3 S3 client with short timeouts and botocore's own retries and checksums off.
    ``session``: a ``boto3.session.Session`` to make it from (reusing one saves ~0.15 s a client)."""
    kwargs: dict[str, Any] = {
        "connect_timeout": connect_timeout_s,
        "read_timeout": read_timeout_s,
        "retries": {"max_attempts": 0},  # ours are the only retries
        "max_pool_connections": max(10, concurrency + 2),
    }
    try:
        config = Config(**kwargs, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
    except TypeError:  # botocore < 1.36 has no default request checksums to switch off
        config = Config(**kwargs)
    return (session or boto3.session.Session()).client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=aws_access_key_id,
        aws_secret_access_key=aws_secret_access_key,
        config=config,
    )


class S3Backend:
    """:class:`~.base.StorageBackend` on one bucket (and key prefix) of an S3-compatible store.

    ``part_size``: bytes per multipart part (≥ 5 MiB; raised for objects that would need more than
    10,000 parts); objects up to ``part_size`` go in one PutObject. ``concurrency``: parts in flight
    (memory: ``concurrency * part_size``). ``state_dir``: upload journals. ``spool_dir``: local copies
    (large streams, :meth:`S3Staging.local_dir`, :meth:`local_folder`; default ``state_dir``, else the
    system's temp dir). ``max_attempts``: tries of each idempotent call. ``client``:
    a ready boto3 client (its retries should be off); else one is made by :func:`make_client`.
    Application code opens tiers with :func:`.tiers.open_backend` instead of calling this.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        part_size: int = 64 * MiB,
        concurrency: int = 4,
        state_dir: Path | None = None,
        max_attempts: int = 5,
        client: Any = None,
        *,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        part_checksum: str = "crc32c",
        spool_dir: Path | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("the bucket name must not be empty")
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be at least 5 MiB (S3's smallest part), got {part_size}")
        if concurrency < 1 or max_attempts < 1:
            raise ValueError("concurrency and max_attempts must be at least 1")
        if part_checksum not in PART_CHECKSUMS:
            raise ValueError(f"part_checksum must be 'crc32c' or 'md5', got {part_checksum!r}")
        if prefix:
            validate_key(f"s3://{bucket}/", prefix)
            prefix = prefix.rstrip("/") + "/"
        self.bucket = bucket
        self.prefix = prefix
        self.name = f"s3://{bucket}/{prefix}"
        self.part_size = part_size
        self.concurrency = concurrency
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.spool_dir = Path(spool_dir) if spool_dir is not None else self.state_dir
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.part_checksum = part_checksum
        self.client = client if client is not None else make_client(
            endpoint_url, region, concurrency=concurrency, connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s, aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
        )
        self.endpoint = endpoint_url or str(self.client.meta.endpoint_url)
        self._calls = S3Caller(self.name, self.endpoint, bucket, max_attempts=max_attempts, backoff_s=backoff_s,
                               max_backoff_s=max_backoff_s)
        self._uploads = MultipartUploader(self.client, self._calls, part_size=part_size, concurrency=concurrency,
                                          state_dir=self.state_dir, part_checksum=part_checksum)
        self._conditional_put: bool | None = None  # does the store honour If-None-Match? (None: not tried)

    def _call(self, op: str, key: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        return self._calls.call(op, key, fn, retry=retry)

    # ---- keys ----

    def _full(self, key: str) -> str:
        return self.prefix + check_key(self.name, key, obj=True)

    def _folder(self, prefix: str) -> tuple[str, str]:
        """(folder key, full folder prefix ending in '/')."""
        key = folder_of(prefix)
        check_key(self.name, key)
        return key, f"{self.prefix}{key}/"

    def _rel(self, full: str) -> str:
        return full[len(self.prefix):]

    # ---- small calls ----

    def _head(self, key: str, full: str) -> dict[str, Any] | None:
        fn = or_none(NOT_FOUND, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        result: dict[str, Any] | None = self._call("HeadObject", key, fn)
        return result

    def _put_bytes(self, key: str, full: str, data: bytes) -> str:
        crc = crc32c_hex(data)
        meta = {META_CRC32C: crc}
        args = checksum_args(self.part_checksum, data, crc)
        # PutObject of a whole object is idempotent: retried.
        self._call("PutObject", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=full, Body=data, Metadata=meta, **args))
        return crc

    def _delete_keys(self, key: str, fulls: list[str]) -> None:
        for i in range(0, len(fulls), _DELETE_BATCH):
            batch = [{"Key": k} for k in fulls[i:i + _DELETE_BATCH]]
            resp = self._call("DeleteObjects", key, lambda b=batch: self.client.delete_objects(  # type: ignore[misc]
                Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}))
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(self.name, key, f"DeleteObjects: {len(errors)} not deleted, first "
                                   f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}")

    def _list_raw(self, full_prefix: str, key: str) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
            if token:
                args["ContinuationToken"] = token
            page = self._call("ListObjectsV2", key, lambda a=args: self.client.list_objects_v2(**a))  # type: ignore[misc]
            yield from page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _list_uploads(self, full_prefix: str, key: str) -> Iterator[dict[str, Any]]:
        markers: dict[str, str] = {}
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix, **markers}
            page = self._call("ListMultipartUploads", key,
                              lambda a=args: self.client.list_multipart_uploads(**a))  # type: ignore[misc]
            yield from page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return
            markers = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    # ---- objects ----

    def put_stream(self, key: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        """One PutObject up to ``part_size``; a longer stream is spooled to a temp file (in
        ``spool_dir``, else the system's) so its CRC32C is known before the multipart upload starts.
        Prefer :meth:`put_file` for large objects: no spool, and resumable."""
        full = self._full(key)
        head = _read_upto(src, self.part_size + 1)
        if len(head) <= self.part_size:
            if progress is not None and head:
                progress(len(head))  # before the PUT, so a raising callback aborts it
            crc = self._put_bytes(key, full, head)
            return ObjectInfo(key, len(head), time.time(), crc)
        spool_dir = self.spool_dir
        try:
            if spool_dir is not None:
                spool_dir.mkdir(parents=True, exist_ok=True)
            spool = tempfile.TemporaryFile(dir=spool_dir, prefix=".ftd-spool-")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise os_error(self.name, key, spool_dir or tempfile.gettempdir(), exc, "spool") from exc
        with spool:
            block = head
            while block:
                try:
                    spool.write(block)
                except OSError as exc:
                    raise os_error(self.name, key, spool_dir or tempfile.gettempdir(), exc, "spool") from exc
                block = src.read(CHUNK)
            size = spool.tell()
            spool.flush()
            return self._uploads.upload(key, full, spool.fileno(), size, progress, None, None)

    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        """One PutObject up to ``part_size``, else a resumable multipart upload (see the module doc)."""
        full = self._full(key)
        with open(path, "rb") as f:  # a missing source is the caller's error, raised as is
            st = os.fstat(f.fileno())
            if st.st_size <= self.part_size:
                data = f.read()
                if progress is not None and data:
                    progress(len(data))
                crc = self._put_bytes(key, full, data)
                return ObjectInfo(key, len(data), time.time(), crc)
            return self._uploads.upload(key, full, f.fileno(), st.st_size, progress, Path(path), st)

    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """Streams the object (not verified: use :meth:`get_file`, or compare with ``stat().crc32c``)."""
        full = self._full(key)
        resp = self._call("GetObject", key, lambda: self.client.get_object(Bucket=self.bucket, Key=full))
        return io.BufferedReader(_BodyReader(self._calls, key, resp["Body"]), buffer_size=MiB)

    def get_file(self, key: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        """Downloads to a temp file next to ``path`` and renames it into place. A retried GET resumes
        at the byte where the last one stopped (``Range``, ``If-Match`` on the ETag)."""
        full = self._full(key)
        meta: dict[str, Any] = {}
        with AtomicFile(Path(path), backend=self.name, key=key) as out:

            def attempt() -> None:
                args: dict[str, Any] = {}
                if meta:
                    if out.size >= meta["size"]:
                        return
                    args = {"IfMatch": meta["etag"], "Range": f"bytes={out.size}-"}
                resp = self.client.get_object(Bucket=self.bucket, Key=full, **args)
                if not meta:
                    meta.update(etag=resp["ETag"], size=int(resp["ContentLength"]), crc=meta_crc(resp),
                                mtime=resp["LastModified"].timestamp())
                # A store that ignores Range sends the whole object again: skip what we have.
                skip = out.size if args and not resp.get("ContentRange") else 0
                body = resp["Body"]
                try:
                    for chunk in body.iter_chunks(CHUNK):
                        block = chunk[skip:]
                        skip = max(0, skip - len(chunk))
                        if block:
                            out.write(block)
                            if progress is not None:
                                progress(len(block))
                finally:
                    body.close()

            self._call("GetObject", key, attempt)
            if out.size != meta["size"]:
                raise StorageError(self.name, key, f"short read: {out.size} of {meta['size']} bytes")
            actual = out.crc32c()
            if meta["crc"] is not None and actual != meta["crc"]:
                raise ChecksumMismatch(self.name, key, f"CRC32C mismatch: expected {meta['crc']}, got {actual}")
            out.commit()
        return ObjectInfo(key, out.size, float(meta["mtime"]), actual)

    @contextmanager
    def local_folder(self, prefix: str, names: Iterable[str]) -> Iterator[Path]:
        """Downloads the objects ``names`` of folder ``prefix`` (each verified against its CRC32C)
        into a temporary directory in ``spool_dir`` (else the system's temp dir), removed on exit."""
        key, _ = self._folder(prefix)
        wanted = [check_key(self.name, name, obj=True) for name in names]
        tmp = self._spool_dir(key, ".ftd-restore-")
        try:
            for name in wanted:
                self.get_file(f"{key}/{name}", tmp / name)
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _spool_dir(self, key: str, prefix: str) -> Path:
        """A fresh private directory for local copies of objects (``spool_dir``, else the system's)."""
        where = self.spool_dir
        try:
            if where is not None:
                where.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=prefix, dir=where))
        except OSError as exc:
            raise os_error(self.name, key, where or tempfile.gettempdir(), exc, "spool") from exc

    def stat(self, key: str) -> ObjectInfo | None:
        head = self._head(key, self._full(key))
        if head is None:
            return None
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp(), meta_crc(head))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects under ``prefix`` in key order (S3's), ftd's own objects skipped. ``crc32c`` is
        ``None`` here (it lives in each object's metadata): use :meth:`stat`."""
        check_key(self.name, prefix, allow_empty=True)
        for obj in self._list_raw(self.prefix + prefix, prefix):
            rel = self._rel(obj["Key"])
            if rel and not any(is_reserved(seg) for seg in rel.split("/")):
                yield ObjectInfo(rel, int(obj["Size"]), obj["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        full = self._full(key)
        self._call("DeleteObject", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=full))

    def delete_prefix(self, prefix: str, *, marker_name: str = DEFAULT_MARKER) -> int:
        """Deletes the folder: first a pending object (so that an interrupted delete is an abandoned
        folder that :meth:`cleanup` finishes), then every ``marker_name`` object, then the rest, the
        pending object last. Returns the number of objects deleted (ftd's own not counted)."""
        check_key(self.name, marker_name, obj=True)
        key, folder = self._folder(prefix)
        keys = [o["Key"] for o in self._list_raw(folder, key)]
        if not keys:
            return 0
        pending = folder + PENDING
        self._put_bytes(key, pending, json.dumps({"deleting": True, **writer_info()}).encode())
        markers = [k for k in keys if k.rsplit("/", 1)[-1] == marker_name]
        rest = [k for k in keys if k.rsplit("/", 1)[-1] != marker_name and k != pending]
        self._delete_keys(key, markers)
        self._delete_keys(key, rest)
        self._delete_keys(key, [pending])
        return sum(1 for k in [*markers, *rest] if not any(is_reserved(s) for s in self._rel(k).split("/")))

    # ---- folders ----

    def _read_pending(self, key: str, folder: str) -> dict[str, Any] | None:
        def get() -> bytes:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=folder + PENDING)["Body"].read())

        raw = self._call("GetObject", key, or_none(NOT_FOUND, get))
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def stage(self, prefix: str) -> S3Staging:
        """A staging of the empty folder ``prefix``, or of one that an unpublished staging left
        (to resume its uploads); :class:`AlreadyPublished` for a folder holding anything else."""
        key, folder = self._folder(prefix)
        record = self._read_pending(key, folder)
        if record is None:
            probe = self._call("ListObjectsV2", key, lambda: self.client.list_objects_v2(
                Bucket=self.bucket, Prefix=folder, MaxKeys=1))
            if probe.get("Contents"):
                raise AlreadyPublished(self.name, key, "the folder already holds objects; a folder is never reused")
        else:
            marker = record.get("marker")
            if isinstance(marker, str) and self._head(key, folder + marker) is not None:
                raise AlreadyPublished(self.name, key, f"the folder is published (marker {marker})")
            log.info("%s: staging %s again over an unpublished staging", self.name, key)
        self._put_bytes(key, folder + PENDING, json.dumps(writer_info()).encode())
        return S3Staging(self, key, folder)

    def is_published(self, prefix: str, marker_name: str) -> bool:
        check_key(self.name, marker_name, obj=True)
        key, folder = self._folder(prefix)
        return self._head(key, folder + marker_name) is not None

    def _put_create_only(self, key: str, full: str, data: bytes) -> bool:
        """Writes ``data`` if ``full`` does not exist; False if it does. ``If-None-Match: *`` where the
        store honours it, else a HEAD before the PUT (racy, but the stores without conditional
        writes offer nothing better)."""
        token = uuid.uuid4().hex
        crc = crc32c_hex(data)
        meta = {META_CRC32C: crc, META_PUBLISH_ID: token}
        args = checksum_args(self.part_checksum, data, crc)
        if self._conditional_put is not False:

            def put() -> bool | None:
                try:
                    self.client.put_object(
                        Bucket=self.bucket, Key=full, Body=data, Metadata=meta, IfNoneMatch="*", **args)
                    return True
                except ParamValidationError:  # a botocore without IfNoneMatch
                    return None
                except ClientError as exc:
                    if error_code(exc) in PRECONDITION or http_status(exc) == 412:
                        return False
                    if error_code(exc) == "NotImplemented" or http_status(exc) == 501:
                        return None
                    raise

            created = self._call("PutObject", key, put)
            if created is not None:
                self._conditional_put = True
                if created:
                    return True
                # 412: someone's marker, or our own from an attempt whose reply was lost.
                head = self._head(key, full)
                return head is not None and head.get("Metadata", {}).get(META_PUBLISH_ID) == token
            log.warning("%s: the store does not support If-None-Match; markers are checked with HEAD", self.name)
            self._conditional_put = False
        if self._head(key, full) is not None:
            return False
        self._call("PutObject", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=full, Body=data, Metadata=meta, **args))
        return True

    def cleanup(
        self, prefix: str = "", older_than_s: float = 0.0, *, marker_name: str = DEFAULT_MARKER,
        select: Callable[[str], bool] | None = None,
    ) -> builtins.list[str]:
        """Aborts multipart uploads under ``prefix`` initiated more than ``older_than_s`` ago, and
        deletes abandoned staged folders: those with a pending object, no marker (``marker_name``, or
        the one the pending object names) and no object newer than ``older_than_s``. Objects under a
        published folder, and objects never staged, are never deleted. Returns the keys removed."""
        check_key(self.name, prefix, allow_empty=True)
        check_key(self.name, marker_name, obj=True)
        cutoff = time.time() - older_than_s
        full_prefix = self.prefix + prefix
        removed: list[str] = []
        for up in self._list_uploads(full_prefix, prefix):
            if select is not None and not select(self._rel(up["Key"])):
                continue
            if up["Initiated"].timestamp() <= cutoff:
                self._uploads.abort(self._rel(up["Key"]), up["Key"], up["UploadId"])
                removed.append(self._rel(up["Key"]))
        objs = list(self._list_raw(full_prefix, prefix))
        pendings = {o["Key"][: -len(PENDING)]: o for o in objs if o["Key"].endswith("/" + PENDING)}
        published = {o["Key"].rsplit("/", 1)[0] + "/" for o in objs if o["Key"].rsplit("/", 1)[-1] == marker_name}
        for folder in pendings:
            record = self._read_pending(self._rel(folder), folder) or {}
            recorded = record.get("marker")
            names = {marker_name, *([recorded] if isinstance(recorded, str) and recorded else [])}
            if any(self._head(self._rel(folder), folder + m) is not None for m in names):
                published.add(folder)

        def owner(k: str) -> str | None:
            return max((f for f in pendings if k.startswith(f)), key=len, default=None)

        for folder, pending in sorted(pendings.items()):
            if select is not None and not select(folder_of(self._rel(folder))):
                continue
            if folder in published:  # a publish or delete interrupted after its marker step
                if pending["LastModified"].timestamp() <= cutoff:
                    self._delete_keys(self._rel(folder), [pending["Key"]])
                    removed.append(self._rel(pending["Key"]))
                continue
            members = [o for o in objs if owner(o["Key"]) == folder
                       and not any(o["Key"].startswith(p) for p in published)]
            if max((o["LastModified"].timestamp() for o in members), default=0.0) > cutoff:
                continue
            doomed = [o["Key"] for o in members if o["Key"] != pending["Key"]]
            self._delete_keys(self._rel(folder), doomed)
            self._delete_keys(self._rel(folder), [pending["Key"]])  # last: an interrupted cleanup is retried
            removed += [self._rel(k) for k in [*doomed, pending["Key"]]]
            log.info("%s: removed abandoned staging %s (%d objects)", self.name, self._rel(folder), len(doomed))
        return sorted(removed)


__all__ = ["DEFAULT_MARKER", "MIN_PART", "PENDING", "S3Backend", "S3Staging", "crc_b64", "is_transient", "make_client"]
