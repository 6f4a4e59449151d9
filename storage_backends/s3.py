"""A storage tier on S3-compatible object storage, with boto3.

Why it is written this way:

* **Our own multipart loop for uploads, not s3transfer.** s3transfer cannot resume from a saved
  UploadId, so an interrupted upload of a 100 GB shard would start over. :meth:`S3Backend.put_file`
  keeps a small JSON journal per (bucket, key, source file) in ``state_dir`` (default: ``.ftd-uploads/``
  next to the source) with the UploadId and the parts done; a new ``put_file`` of the same unchanged
  file asks ``ListParts`` what the store really holds, uploads only the missing parts and completes.
* **CRC32C computed here**, with the ``crc32c`` package (botocore would need the AWS CRT for CRC32C). Each part
  goes out with ``x-amz-checksum-crc32c`` (``ChecksumCRC32C``), so the store verifies it server side;
  the upload is created with ``ChecksumAlgorithm=CRC32C`` as S3 requires for per-part checksums. The
  whole-object CRC32C is stored as user metadata ``ftd-crc32c``; metadata can only be given at
  ``CreateMultipartUpload``, so ``put_file`` reads the file once for the checksums before uploading,
  and ``put_stream`` spools a stream larger than one part to a temp file. ``get_file`` recomputes the
  CRC32C and compares. botocore's own request/response checksums are switched off (``when_required``)
  so nothing is computed twice. ``part_checksum="md5"`` sends ``Content-MD5`` instead, for stores
  without the flexible-checksum headers.
* **Retries only of idempotent calls** (tenacity; exponential backoff with jitter, ``max_attempts``
  in all; connection errors, timeouts, 5xx, throttling). ``CreateMultipartUpload`` is never retried
  blindly: a lost reply would leave a second upload behind. botocore's own retries are disabled, so
  this policy is the only one. Errors are translated once, in :meth:`S3Backend._call`.
* **Atomic publish by a marker object written last**, create-only (``If-None-Match: *``), so two
  writers can never both publish a folder. Objects are staged straight under the final prefix;
  :meth:`S3Staging.publish` is the commit point, and readers trust a folder only when
  :meth:`S3Backend.is_published` says so (listing shows staged objects before that).
* **A pending object** (``<folder>/.ftd-staging``) is written when a folder is staged (or deleted) and
  removed after publish; before the marker is written it records the marker's name. It is what lets
  :meth:`S3Backend.cleanup` remove abandoned folders without ever touching objects written outside a
  staging, and lets a restarted writer stage the same folder again to resume its uploads.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import io
import json
import logging
import os
import re
import secrets
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, ParamValidationError
from botocore.exceptions import ConnectionError as BotoConnectionError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from .base import (
    AlreadyPublished,
    ChecksumMismatch,
    Crc32c,
    ObjectInfo,
    ObjectNotFound,
    Progress,
    StorageError,
    StorageFull,
    StorageUnavailable,
    crc32c_hex,
    validate_key,
)
from .local import CHUNK, AtomicFile, check_key, folder_of, is_reserved, os_error

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MARKER = "MANIFEST.json"
PENDING = ".ftd-staging"
META_CRC32C = "ftd-crc32c"  # sent as x-amz-meta-ftd-crc32c
META_PUBLISH_ID = "ftd-publish-id"
MiB = 1 << 20
MIN_PART = 5 * MiB  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # DeleteObjects limit

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
_FULL = frozenset({"QuotaExceeded", "EntityTooLarge", "InsufficientStorage", "StorageFull", "XMinioStorageFull"})
_THROTTLED = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "ConditionalRequestConflict",
})
_NO_UPLOAD = frozenset({"NoSuchUpload"})
_PRECONDITION = frozenset({"PreconditionFailed", "412"})


def crc_b64(crc_hex: str) -> str:
    """S3's form of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: the network, a timeout, a 5xx, throttling."""
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        code, status = _code(exc), _status(exc)
        if code in _FULL or status in (501, 507):
            return False
        return code in _THROTTLED or status == 429 or status >= 500
    return False


def _or_none(codes: frozenset[str], fn: Callable[[], T]) -> Callable[[], T | None]:
    """``fn`` with the given error codes turned into ``None`` (an expected answer, not a failure)."""

    def run() -> T | None:
        try:
            return fn()
        except ClientError as exc:
            if _code(exc) in codes:
                return None
            raise

    return run


def _meta_crc(head: dict[str, Any]) -> str | None:
    value = head.get("Metadata", {}).get(META_CRC32C)
    return value if isinstance(value, str) and _CRC_RE.match(value) else None


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        block = os.pread(fd, size - got, offset + got)
        if not block:
            break
        chunks.append(block)
        got += len(block)
    return b"".join(chunks)


def _read_upto(src: BinaryIO, limit: int) -> bytes:
    buf = bytearray()
    while len(buf) < limit:
        block = src.read(min(CHUNK, limit - len(buf)))
        if not block:
            break
        buf += block
    return bytes(buf)


@dataclass(frozen=True)
class _Part:
    number: int
    offset: int
    size: int
    crc32c: str


def _scan(fd: int, size: int, part_size: int) -> tuple[str, list[_Part]]:
    """One read of the source: the whole-object CRC32C and each part's."""
    whole = Crc32c()
    parts: list[_Part] = []
    offset = 0
    while offset < size:
        length = min(part_size, size - offset)
        crc = Crc32c()
        done = 0
        while done < length:
            block = os.pread(fd, min(CHUNK, length - done), offset + done)
            if not block:
                raise OSError(f"source ended at byte {offset + done} of {size}: it shrank while being read")
            crc.update(block)
            whole.update(block)
            done += len(block)
        parts.append(_Part(len(parts) + 1, offset, length, crc.hexdigest()))
        offset += length
    return whole.hexdigest(), parts


class _Journal:
    """The resume record of one multipart upload of a file. Rewritten (temp + rename, not fsynced:
    losing it only costs a restart, and every part it names is checked against ``ListParts``) as
    parts complete. If it cannot be written, the upload goes on without resume."""

    def __init__(self, path: Path, identity: dict[str, Any]) -> None:
        self.path = path
        self.identity = identity
        self.enabled = True
        self.upload_id = ""
        self.parts: dict[int, tuple[str, str]] = {}  # part number -> (etag, crc32c)

    def load(self) -> tuple[str, str, dict[int, tuple[str, str]], bool] | None:
        """(upload id, key, parts, same source) of a previous attempt, if any."""
        try:
            data = json.loads(self.path.read_text())
            parts = {int(n): (str(p["etag"]), str(p["crc32c"])) for n, p in data["parts"].items()}
            same = all(data.get(k) == v for k, v in self.identity.items())
            return str(data["upload_id"]), str(data["key"]), parts, same
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring unreadable upload journal %s: %s", self.path, exc)
            return None

    def save(self) -> None:
        if not self.enabled:
            return
        record = {
            **self.identity,
            "upload_id": self.upload_id,
            "parts": {str(n): {"etag": e, "crc32c": c} for n, (e, c) in sorted(self.parts.items())},
        }
        tmp = self.path.with_name(f".{self.path.name}.ftd-tmp-{secrets.token_hex(6)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError as exc:
            with suppress(OSError):
                tmp.unlink()
            log.warning("upload journal %s cannot be written (%s): this upload cannot be resumed", self.path, exc)
            self.enabled = False

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove upload journal %s: %s", self.path, exc)


class _BodyReader(io.RawIOBase):
    """A GetObject body as a raw stream whose network errors arrive as :class:`StorageUnavailable`."""

    def __init__(self, backend: S3Backend, key: str, body: Any) -> None:
        super().__init__()
        self._backend = backend
        self._key = key
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._body.read(len(view))
        except BotoCoreError as exc:
            raise self._backend._translate("GetObject", self._key, exc, 1) from exc
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
    (memory: ``concurrency * part_size``). ``state_dir``: upload journals and the spool of large
    streams. ``max_attempts``: tries of each idempotent call. ``client``: a ready boto3 client (its
    retries should be off); else one is made by :func:`make_client`.
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
    ) -> None:
        if not bucket:
            raise ValueError("the bucket name must not be empty")
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be at least 5 MiB (S3's smallest part), got {part_size}")
        if concurrency < 1 or max_attempts < 1:
            raise ValueError("concurrency and max_attempts must be at least 1")
        if part_checksum not in ("crc32c", "md5"):
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
        self._conditional_put: bool | None = None  # does the store honour If-None-Match? (None: not tried)

    # ---- the one place where errors are retried and translated -----------------------------

    def _call(self, op: str, key: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        """Runs one S3 call: retried on transient errors when ``retry`` (idempotent calls only),
        every botocore error translated. Other exceptions (a progress callback's) pass through."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return fn()

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.warning("%s: %s %s failed (attempt %d of %d), retrying: %s",
                        self.name, op, key, state.attempt_number, self.max_attempts, exc)

        retrying = Retrying(
            stop=stop_after_attempt(self.max_attempts if retry else 1),
            wait=wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),  # "full jitter"
            retry=retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(op, key, exc, attempts) from exc

    def _translate(self, op: str, key: str, exc: Exception, attempts: int) -> StorageError:
        where = f"{self.endpoint} (bucket {self.bucket})"
        tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            msg = exc.response.get("Error", {}).get("Message", "")
            if code in _NOT_FOUND:
                return ObjectNotFound(self.name, key, f"no such object ({op}: {code})")
            if code in _FULL or status == 507:
                return StorageFull(self.name, key, f"{op} on {where}: storage full or quota exceeded ({code}: {msg})")
            if is_transient(exc):
                why = f"{op} on {where} failed {tries}: {code} (HTTP {status}) {msg}"
                return StorageUnavailable(self.name, key, why)
            return StorageError(self.name, key, f"{op} refused by {where}: {code} (HTTP {status}) {msg}")
        if is_transient(exc):
            return StorageUnavailable(self.name, key, f"{op}: {where} unreachable {tries}: {exc}")
        return StorageError(self.name, key, f"{op} on {where}: {exc}")

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
        fn = _or_none(_NOT_FOUND, lambda: self.client.head_object(Bucket=self.bucket, Key=full))
        result: dict[str, Any] | None = self._call("HeadObject", key, fn)
        return result

    def _checksum_args(self, data: bytes, crc: str) -> dict[str, str]:
        if self.part_checksum == "crc32c":
            return {"ChecksumCRC32C": crc_b64(crc)}
        return {"ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode("ascii")}

    def _put_bytes(self, key: str, full: str, data: bytes) -> str:
        crc = crc32c_hex(data)
        meta = {META_CRC32C: crc}
        args = self._checksum_args(data, crc)
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

    def _abort_upload(self, key: str, full: str, upload_id: str) -> None:
        def abort() -> Any:
            return self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

        self._call("AbortMultipartUpload", key, _or_none(_NO_UPLOAD, abort))

    def _abort_quietly(self, key: str, full: str, upload_id: str) -> None:
        try:
            self._abort_upload(key, full, upload_id)
        except StorageError as exc:  # cleanup() aborts it later
            log.warning("%s: could not abort multipart upload %s of %s: %s", self.name, upload_id, key, exc)

    # ---- multipart ----

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        if -(-size // part) > MAX_PARTS:
            part = -(-size // (MAX_PARTS * MiB)) * MiB
        return part

    def _journal_for(self, full: str, source: Path, st: os.stat_result, part_size: int, crc: str) -> _Journal:
        real = os.path.realpath(source)
        folder = self.state_dir if self.state_dir is not None else Path(real).parent / ".ftd-uploads"
        digest = hashlib.sha256(f"{self.endpoint}\n{self.bucket}\n{full}\n{real}".encode()).hexdigest()[:32]
        identity = {"bucket": self.bucket, "key": full, "source": real, "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns, "part_size": part_size, "crc32c": crc}
        return _Journal(folder / f"{digest}.json", identity)

    def _reusable(self, key: str, full: str, upload_id: str, plan: dict[int, _Part],
                  recorded: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str]] | None:
        """The recorded parts that the store still holds with the same size, ETag and checksum,
        and whose source bytes are unchanged; ``None`` if the upload is gone."""
        listed: dict[int, dict[str, Any]] = {}
        marker = 0
        for _ in range(MAX_PARTS // 1000 + 1):
            args = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id, "PartNumberMarker": marker,
                    "MaxParts": 1000}
            page = self._call("ListParts", key, _or_none(_NO_UPLOAD, lambda a=args: self.client.list_parts(**a)))  # type: ignore[misc]
            if page is None:
                return None
            listed.update({int(p["PartNumber"]): p for p in page.get("Parts", [])})
            if not page.get("IsTruncated"):
                break
            marker = int(page["NextPartNumberMarker"])
        keep: dict[int, tuple[str, str]] = {}
        for n, (etag, crc) in recorded.items():
            have, want = listed.get(n), plan.get(n)
            if have is None or want is None or crc != want.crc32c or int(have["Size"]) != want.size:
                continue
            if have.get("ETag") != etag or have.get("ChecksumCRC32C") not in (None, crc_b64(crc)):
                continue
            keep[n] = (etag, crc)
        return keep

    def _send_part(self, key: str, full: str, upload_id: str, fd: int, part: _Part, source: str) -> str:
        data = _pread_exact(fd, part.size, part.offset)
        if len(data) != part.size or crc32c_hex(data) != part.crc32c:
            raise StorageError(self.name, key, f"{source} changed during the upload (part {part.number})")
        args = self._checksum_args(data, part.crc32c)
        # UploadPart of a given part number is idempotent (the last copy wins): retried.
        resp = self._call("UploadPart", key, lambda: self.client.upload_part(
            Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=part.number, Body=data, **args))
        return str(resp["ETag"])

    def _send_parts(
        self, key: str, full: str, upload_id: str, fd: int, todo: builtins.list[_Part],
        done: dict[int, tuple[str, str]], journal: _Journal | None, progress: Progress | None, source: str,
    ) -> None:
        """Uploads ``todo`` on ``concurrency`` threads; progress and the journal are updated here, in
        the caller's thread, as parts complete. On any failure (a progress callback raising included)
        the parts not started are cancelled, and those that finished anyway are still recorded."""

        def record(part: _Part, etag: str) -> None:
            done[part.number] = (etag, part.crc32c)
            if journal is not None:
                journal.parts[part.number] = (etag, part.crc32c)
                journal.save()

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="ftd-s3-part") as pool:
            futures: dict[Future[str], _Part] = {
                pool.submit(self._send_part, key, full, upload_id, fd, part, source): part for part in todo
            }
            try:
                for fut in as_completed(futures):
                    part = futures[fut]
                    record(part, fut.result())
                    if progress is not None:
                        progress(part.size)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                wait(futures)
                for fut, part in futures.items():
                    if part.number not in done and fut.done() and not fut.cancelled() and fut.exception() is None:
                        record(part, fut.result())
                raise

    def _complete(
        self, key: str, full: str, upload_id: str, done: dict[int, tuple[str, str]], crc: str, size: int
    ) -> None:
        with_crc = self.part_checksum == "crc32c"
        parts = [
            {"PartNumber": n, "ETag": etag, **({"ChecksumCRC32C": crc_b64(c)} if with_crc else {})}
            for n, (etag, c) in sorted(done.items())
        ]

        def complete() -> None:
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts})
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":
                    raise
                # An attempt whose reply was lost may have completed it: then the object is there.
                head = self.client.head_object(Bucket=self.bucket, Key=full)
                if _meta_crc(head) != crc or int(head["ContentLength"]) != size:
                    raise

        # CompleteMultipartUpload is idempotent for the same part list (a repeat after success finds
        # NoSuchUpload and the finished object, handled above): retried.
        self._call("CompleteMultipartUpload", key, complete)

    def _put_large(self, key: str, full: str, fd: int, size: int, progress: Progress | None,
                   source: Path | None, st: os.stat_result | None) -> ObjectInfo:
        part_size = self._part_size_for(size)
        what = str(source) if source is not None else "the spooled stream"
        try:
            crc, plan = _scan(fd, size, part_size)
        except OSError as exc:
            raise os_error(self.name, key, what, exc, "read") from exc
        journal = self._journal_for(full, source, st, part_size, crc) if source is not None and st is not None else None
        upload_id, done = "", {}
        previous = journal.load() if journal is not None else None
        if previous is not None:
            old_id, old_key, parts, same = previous
            reused = self._reusable(key, full, old_id, {p.number: p for p in plan}, parts) if same else None
            if reused is not None:
                upload_id, done = old_id, reused
                log.info("%s: resuming upload of %s: %d of %d parts already stored",
                         self.name, key, len(done), len(plan))
            elif not same:
                self._abort_quietly(key, old_key, old_id)
        if not upload_id:
            # Not retried: a retry after a lost reply would leave a second upload; this one fails
            # as StorageUnavailable and the next put starts clean.
            extra = {"ChecksumAlgorithm": "CRC32C"} if self.part_checksum == "crc32c" else {}
            resp = self._call("CreateMultipartUpload", key, lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full, Metadata={META_CRC32C: crc}, **extra), retry=False)
            upload_id = str(resp["UploadId"])
        if journal is not None:
            journal.upload_id, journal.parts = upload_id, dict(done)
            journal.save()
        try:
            todo = [p for p in plan if p.number not in done]
            self._send_parts(key, full, upload_id, fd, todo, done, journal, progress, what)
            self._complete(key, full, upload_id, done, crc, size)
        except BaseException:
            if journal is None or not journal.enabled:  # nobody can resume it
                self._abort_quietly(key, full, upload_id)
            raise
        if journal is not None:
            journal.remove()
        return ObjectInfo(key, size, time.time(), crc)

    # ---- objects ----

    def put_stream(self, key: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        """One PutObject up to ``part_size``; a longer stream is spooled to a temp file (in
        ``state_dir``, else the system's) so its CRC32C is known before the multipart upload starts.
        Prefer :meth:`put_file` for large objects: no spool, and resumable."""
        full = self._full(key)
        head = _read_upto(src, self.part_size + 1)
        if len(head) <= self.part_size:
            if progress is not None and head:
                progress(len(head))  # before the PUT, so a raising callback aborts it
            crc = self._put_bytes(key, full, head)
            return ObjectInfo(key, len(head), time.time(), crc)
        spool_dir = self.state_dir
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
            return self._put_large(key, full, spool.fileno(), size, progress, None, None)

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
            return self._put_large(key, full, f.fileno(), st.st_size, progress, Path(path), st)

    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """Streams the object (not verified: use :meth:`get_file`, or compare with ``stat().crc32c``)."""
        full = self._full(key)
        resp = self._call("GetObject", key, lambda: self.client.get_object(Bucket=self.bucket, Key=full))
        return io.BufferedReader(_BodyReader(self, key, resp["Body"]), buffer_size=MiB)

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
                    meta.update(etag=resp["ETag"], size=int(resp["ContentLength"]), crc=_meta_crc(resp),
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

    def stat(self, key: str) -> ObjectInfo | None:
        head = self._head(key, self._full(key))
        if head is None:
            return None
        return ObjectInfo(key, int(head["ContentLength"]), head["LastModified"].timestamp(), _meta_crc(head))

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
        self._put_bytes(key, pending, json.dumps({"deleting": True, **_writer()}).encode())
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

        raw = self._call("GetObject", key, _or_none(_NOT_FOUND, get))
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
        self._put_bytes(key, folder + PENDING, json.dumps(_writer()).encode())
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
        args = self._checksum_args(data, crc)
        if self._conditional_put is not False:

            def put() -> bool | None:
                try:
                    self.client.put_object(
                        Bucket=self.bucket, Key=full, Body=data, Metadata=meta, IfNoneMatch="*", **args)
                    return True
                except ParamValidationError:  # a botocore without IfNoneMatch
                    return None
                except ClientError as exc:
                    if _code(exc) in _PRECONDITION or _status(exc) == 412:
                        return False
                    if _code(exc) == "NotImplemented" or _status(exc) == 501:
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
        self, prefix: str = "", older_than_s: float = 0.0, *, marker_name: str = DEFAULT_MARKER
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
            if up["Initiated"].timestamp() <= cutoff:
                self._abort_upload(self._rel(up["Key"]), up["Key"], up["UploadId"])
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


def _writer() -> dict[str, Any]:
    return {"at_unix_s": time.time(), "host": socket.gethostname(), "pid": os.getpid()}


class S3Staging:
    """A folder whose objects go straight under the final prefix; :meth:`publish` writes the marker,
    create-only, as the commit point."""

    def __init__(self, backend: S3Backend, prefix: str, folder: str) -> None:
        self.backend = backend
        self.prefix = prefix
        self._folder = folder
        self._state = "open"  # -> "published" | "aborted" | "lost" (someone else published it)

    def _key(self, name: str) -> str:
        if self._state in ("published", "lost"):
            raise AlreadyPublished(self.backend.name, self.prefix, "this folder was already published")
        if self._state == "aborted":
            raise StorageError(self.backend.name, self.prefix, "this staging was aborted")
        check_key(self.backend.name, name, obj=True)
        return f"{self.prefix}/{name}"

    def put_stream(self, name: str, src: BinaryIO, progress: Progress | None = None) -> ObjectInfo:
        return self.backend.put_stream(self._key(name), src, progress)

    def put_file(self, name: str, path: Path, progress: Progress | None = None) -> ObjectInfo:
        return self.backend.put_file(self._key(name), path, progress)

    def publish(self, marker_name: str, marker: bytes) -> None:
        key = self._key(marker_name)
        b = self.backend
        full = self._folder + marker_name
        if b._head(key, full) is not None:
            self._state = "lost"
            raise AlreadyPublished(b.name, self.prefix, f"marker {marker_name} already exists")
        # Name the marker in the pending object first: then a crash right after the marker is
        # written leaves a folder that stage() and cleanup() still recognise as published.
        b._put_bytes(self.prefix, self._folder + PENDING, json.dumps({"marker": marker_name, **_writer()}).encode())
        if not b._put_create_only(key, full, marker):
            self._state = "lost"
            raise AlreadyPublished(b.name, self.prefix, f"marker {marker_name} was written by another writer")
        self._state = "published"
        try:
            b._delete_keys(self.prefix, [self._folder + PENDING])
        except StorageError as exc:  # harmless: cleanup() removes a pending object next to a marker
            log.warning("%s: published %s but could not remove its pending object: %s", b.name, self.prefix, exc)

    def abort(self) -> None:
        """Deletes what was staged (and aborts uploads in flight under the folder). After losing a
        publish race the folder is someone else's and nothing is deleted."""
        if self._state != "open":
            return
        b = self.backend
        for up in b._list_uploads(self._folder, self.prefix):
            b._abort_upload(self.prefix, up["Key"], up["UploadId"])
        pending = self._folder + PENDING
        keys = [o["Key"] for o in b._list_raw(self._folder, self.prefix) if o["Key"] != pending]
        b._delete_keys(self.prefix, keys)
        b._delete_keys(self.prefix, [pending])
        self._state = "aborted"


__all__ = ["DEFAULT_MARKER", "MIN_PART", "PENDING", "S3Backend", "S3Staging", "crc_b64", "is_transient", "make_client"]
