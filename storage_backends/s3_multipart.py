"""Resumable, checksummed multipart uploads for the S3 tier.

* **Our own multipart loop, not s3transfer.** s3transfer cannot resume from a saved UploadId, so an
  interrupted upload of a 100 GB shard would start over. :meth:`MultipartUploader.upload` of a file
  keeps a small JSON :class:`Journal` per (bucket, key, source file) in ``state_dir`` (default:
  ``.ftd-uploads/`` next to the source) with the UploadId and the parts done; a new upload of the
  same unchanged file asks ``ListParts`` what the store really holds, uploads only the missing parts
  and completes.
* **CRC32C computed here**, with the ``crc32c`` package (botocore would need the AWS CRT for CRC32C).
  Each part goes out with ``x-amz-checksum-crc32c`` (``ChecksumCRC32C``), so the store verifies it
  server side; the upload is created with ``ChecksumAlgorithm=CRC32C`` as S3 requires for per-part
  checksums. The whole-object CRC32C is stored as user metadata ``ftd-crc32c``; metadata can only be
  given at ``CreateMultipartUpload``, so the source is read once for the checksums before uploading.
  ``part_checksum="md5"`` sends ``Content-MD5`` instead, for stores without the flexible-checksum
  headers.
* **Parts go out on ``concurrency`` threads**; progress and the journal are updated in the caller's
  thread as parts complete, so a raising progress callback stops the upload cleanly.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import logging
import os
import re
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from .atomic_files import os_error
from .base import CHUNK, Crc32c, ObjectInfo, Progress, StorageError, crc32c_hex
from .s3_errors import NO_UPLOAD, S3Caller, error_code, or_none

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3: every part but the last is at least 5 MiB
MAX_PARTS = 10_000
META_CRC32C = "ftd-crc32c"  # sent as x-amz-meta-ftd-crc32c
PART_CHECKSUMS = ("crc32c", "md5")

_CRC_RE = re.compile(r"^[0-9a-f]{8}$")


def crc_b64(crc_hex: str) -> str:
    """S3's form of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def meta_crc(head: dict[str, Any]) -> str | None:
    """The whole-object CRC32C stored in an object's metadata, if any."""
    value = head.get("Metadata", {}).get(META_CRC32C)
    return value if isinstance(value, str) and _CRC_RE.match(value) else None


def checksum_args(part_checksum: str, data: bytes, crc: str) -> dict[str, str]:
    """The checksum the store verifies for one PUT body: CRC32C, or MD5 for older stores."""
    if part_checksum == "crc32c":
        return {"ChecksumCRC32C": crc_b64(crc)}
    return {"ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode("ascii")}


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        block = os.pread(fd, size - got, offset + got)
        if not block:
            break
        chunks.append(block)
        got += len(block)
    return b"".join(chunks)


@dataclass(frozen=True)
class Part:
    number: int
    offset: int
    size: int
    crc32c: str


def scan(fd: int, size: int, part_size: int) -> tuple[str, list[Part]]:
    """One read of the source: the whole-object CRC32C and each part's."""
    whole = Crc32c()
    parts: list[Part] = []
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
        parts.append(Part(len(parts) + 1, offset, length, crc.hexdigest()))
        offset += length
    return whole.hexdigest(), parts


class Journal:
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


class MultipartUploader:
    """Multipart uploads into one bucket through ``client``, every call run by ``calls`` (retries,
    error translation). ``part_size`` ≥ 5 MiB (raised for objects that would need more than 10,000
    parts); ``concurrency`` parts in flight (memory: ``concurrency * part_size``); ``state_dir`` holds
    the journals (``None``: next to each source)."""

    def __init__(self, client: Any, calls: S3Caller, *, part_size: int, concurrency: int,
                 state_dir: Path | None, part_checksum: str) -> None:
        self.client = client
        self.calls = calls
        self.bucket = calls.bucket
        self.part_size = part_size
        self.concurrency = concurrency
        self.state_dir = state_dir
        self.part_checksum = part_checksum

    @property
    def name(self) -> str:
        return self.calls.name

    def abort(self, key: str, full: str, upload_id: str) -> None:
        def abort() -> Any:
            return self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

        self.calls.call("AbortMultipartUpload", key, or_none(NO_UPLOAD, abort))

    def abort_quietly(self, key: str, full: str, upload_id: str) -> None:
        try:
            self.abort(key, full, upload_id)
        except StorageError as exc:  # cleanup() aborts it later
            log.warning("%s: could not abort multipart upload %s of %s: %s", self.name, upload_id, key, exc)

    def part_size_for(self, size: int) -> int:
        part = self.part_size
        if -(-size // part) > MAX_PARTS:
            part = -(-size // (MAX_PARTS * MiB)) * MiB
        return part

    def _journal_for(self, full: str, source: Path, st: os.stat_result, part_size: int, crc: str) -> Journal:
        real = os.path.realpath(source)
        folder = self.state_dir if self.state_dir is not None else Path(real).parent / ".ftd-uploads"
        digest = hashlib.sha256(f"{self.calls.endpoint}\n{self.bucket}\n{full}\n{real}".encode()).hexdigest()[:32]
        identity = {"bucket": self.bucket, "key": full, "source": real, "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns, "part_size": part_size, "crc32c": crc}
        return Journal(folder / f"{digest}.json", identity)

    def _reusable(self, key: str, full: str, upload_id: str, plan: dict[int, Part],
                  recorded: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str]] | None:
        """The recorded parts that the store still holds with the same size, ETag and checksum,
        and whose source bytes are unchanged; ``None`` if the upload is gone."""
        listed: dict[int, dict[str, Any]] = {}
        marker = 0
        for _ in range(MAX_PARTS // 1000 + 1):
            args = {"Bucket": self.bucket, "Key": full, "UploadId": upload_id, "PartNumberMarker": marker,
                    "MaxParts": 1000}
            page = self.calls.call("ListParts", key, or_none(NO_UPLOAD, lambda a=args: self.client.list_parts(**a)))  # type: ignore[misc]
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

    def _send_part(self, key: str, full: str, upload_id: str, fd: int, part: Part, source: str) -> str:
        data = pread_exact(fd, part.size, part.offset)
        if len(data) != part.size or crc32c_hex(data) != part.crc32c:
            raise StorageError(self.name, key, f"{source} changed during the upload (part {part.number})")
        args = checksum_args(self.part_checksum, data, part.crc32c)
        # UploadPart of a given part number is idempotent (the last copy wins): retried.
        resp = self.calls.call("UploadPart", key, lambda: self.client.upload_part(
            Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=part.number, Body=data, **args))
        return str(resp["ETag"])

    def _send_parts(
        self, key: str, full: str, upload_id: str, fd: int, todo: builtins.list[Part],
        done: dict[int, tuple[str, str]], journal: Journal | None, progress: Progress | None, source: str,
    ) -> None:
        """Uploads ``todo`` on ``concurrency`` threads. On any failure (a progress callback raising
        included) the parts not started are cancelled, and those that finished anyway are still
        recorded."""

        def record(part: Part, etag: str) -> None:
            done[part.number] = (etag, part.crc32c)
            if journal is not None:
                journal.parts[part.number] = (etag, part.crc32c)
                journal.save()

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="ftd-s3-part") as pool:
            futures: dict[Future[str], Part] = {
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
                if error_code(exc) != "NoSuchUpload":
                    raise
                # An attempt whose reply was lost may have completed it: then the object is there.
                head = self.client.head_object(Bucket=self.bucket, Key=full)
                if meta_crc(head) != crc or int(head["ContentLength"]) != size:
                    raise

        # CompleteMultipartUpload is idempotent for the same part list (a repeat after success finds
        # NoSuchUpload and the finished object, handled above): retried.
        self.calls.call("CompleteMultipartUpload", key, complete)

    def upload(self, key: str, full: str, fd: int, size: int, progress: Progress | None,
               source: Path | None, st: os.stat_result | None) -> ObjectInfo:
        """Uploads ``size`` bytes of ``fd`` to ``full``; resumable when ``source`` (a file path) and
        its ``st`` are given, else (a spooled stream) aborted on failure."""
        part_size = self.part_size_for(size)
        what = str(source) if source is not None else "the spooled stream"
        try:
            crc, plan = scan(fd, size, part_size)
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
                self.abort_quietly(key, old_key, old_id)
        if not upload_id:
            # Not retried: a retry after a lost reply would leave a second upload; this one fails
            # as StorageUnavailable and the next put starts clean.
            extra = {"ChecksumAlgorithm": "CRC32C"} if self.part_checksum == "crc32c" else {}
            resp = self.calls.call("CreateMultipartUpload", key, lambda: self.client.create_multipart_upload(
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
                self.abort_quietly(key, full, upload_id)
            raise
        if journal is not None:
            journal.remove()
        return ObjectInfo(key, size, time.time(), crc)


__all__ = [
    "MAX_PARTS",
    "META_CRC32C",
    "MIN_PART",
    "PART_CHECKSUMS",
    "Journal",
    "MiB",
    "MultipartUploader",
    "Part",
    "checksum_args",
    "crc_b64",
    "meta_crc",
    "pread_exact",
    "scan",
]
