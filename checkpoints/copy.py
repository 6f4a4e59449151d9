"""One way to copy a shard: from a tier to another, or off the wire into a tier.

:func:`copy_shard` owns the protocol, whatever moves the bytes: the destination's staging folder
for the shard (:func:`~.layout.shard_prefix`), every file checked as it lands — its size and CRC32C
against what is expected of it (the manifest's, or the catalog's) and against what the sender read
— then the manifest, checked by the source, published last (the commit point of the destination's
publish strategy). Any failure aborts the staging: a copy is published whole and verified, or not
at all. Every path that moves a shard uses it: the memory → SSD hop and the tiering to the slower
tiers (:class:`TierSource`), a buddy's replica and a pulled peer copy (sources in ``ftd.agent``:
the gRPC chunk stream, the peer copy's fast path).

A source is the transport: it moves its files into the staging (``put_file`` from a local file, so
an upload resumes; ``put_stream`` off the wire; or straight into :meth:`Staging.local_dir`) and
reports each one as it lands.

A file that does not match is :class:`CopyMismatch` (a :class:`~ftd.storage_backends.base.ChecksumMismatch`):
the source's copy is corrupt, or the bytes changed on the way; the destination's own failures keep
their storage error (:class:`~ftd.storage_backends.base.StorageFull`, ...).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ftd.storage_backends.base import (
    AlreadyPublished,
    ChecksumMismatch,
    ObjectInfo,
    Progress,
    Staging,
    StorageBackend,
    StorageError,
)

from .layout import MANIFEST, ManifestError, ShardManifest, shard_prefix

log = logging.getLogger("ftd.checkpoints.copy")
Expected = Mapping[str, tuple[int, str]]  # file name -> (size, crc32c)
# A file complete in the staging: its name, what was written (size, CRC32C), what the sender read.
Landed = Callable[[str, ObjectInfo, str | None], None]


class CopyMismatch(ChecksumMismatch):
    """A file of the copy does not match what was expected of it (or what its sender read), or one is
    missing; nothing was published. ``file`` names it."""

    def __init__(self, backend: str, key: str, message: str, file: str = "") -> None:
        super().__init__(backend, key, message)
        self.message = message  # without the backend and key: what a corrupt copy is recorded with
        self.file = file


class ShardSource(Protocol):
    """Where a copy's bytes come from."""

    where: str  # names the source in messages

    def write(self, staging: Staging, landed: Landed) -> None:
        """Moves the shard's files (not the manifest) into ``staging``, calling ``landed`` with each
        one's name and :class:`ObjectInfo` (size and CRC32C as written) as soon as it is complete."""
        ...

    def manifest(self, received: Expected) -> bytes:
        """The manifest to publish, once every file landed (``received``: their sizes and CRC32Cs);
        raises when there is none or it does not describe them."""
        ...


@dataclass(frozen=True)
class Copied:
    bytes: int  # of the files copied (the manifest not counted)
    seconds: float
    already: bool = False  # the destination held this very shard already (or a concurrent copy won)


def files_of(manifest: ShardManifest) -> dict[str, tuple[int, str]]:
    return {f.name: (f.size, f.crc32c) for f in manifest.files}


def copy_shard(src: ShardSource, dst: StorageBackend, prefix: str, expected: Expected | None = None, *,
               says: str = "the manifest") -> Copied:
    """Copies one shard from ``src`` into ``dst``'s folder ``prefix`` (see the module docstring).
    ``expected``: every file the copy must hold, with its size and CRC32C (``says``: who says so,
    for messages); ``None``: only what the sender read is checked here (the source's manifest, which
    comes last on the wire, checks the rest)."""
    started = time.perf_counter()
    received: dict[str, tuple[int, str]] = {}

    def landed(name: str, info: ObjectInfo, sent: str | None) -> None:
        got = info.crc32c or ""
        if sent is not None and got != sent:
            raise CopyMismatch(dst.name, f"{prefix}/{name}", f"{name}: received crc32c {got}, the sender read {sent}",
                               name)
        if expected is not None and name in expected and (info.size, got) != expected[name]:
            size, crc = expected[name]
            raise CopyMismatch(dst.name, f"{prefix}/{name}", (
                f"{name}: {info.size} bytes crc32c {got}, {says} says {size} bytes crc32c {crc}"), name)
        received[name] = (info.size, got)

    staging = dst.stage(prefix)
    try:
        src.write(staging, landed)
        missing = sorted(set(expected or ()) - set(received))
        if missing:
            raise CopyMismatch(dst.name, prefix, f"the copy from {src.where} lacks {', '.join(missing)}", missing[0])
        staging.publish(MANIFEST, src.manifest(received))
    except AlreadyPublished:
        return Copied(sum(s for s, _ in received.values()), time.perf_counter() - started, already=True)
    except BaseException:
        try:
            staging.abort()
        except (StorageError, OSError) as exc:
            log.warning("could not remove the staging of %s on %s (cleanup removes it): %s", prefix, dst.name, exc)
        raise
    return Copied(sum(s for s, _ in received.values()), time.perf_counter() - started)


class TierSource:
    """A published shard on a tier, its files handed over as local files (``put_file``: an upload
    to an object store resumes from them; a directory tier hands out its own files, an object store
    downloads them, verified, first)."""

    def __init__(self, backend: StorageBackend, manifest: ShardManifest, progress: Progress | None = None) -> None:
        self.backend = backend
        self.shard = manifest
        self.prefix = shard_prefix(manifest.job, manifest.step, manifest.rank)
        self.progress = progress
        self.where = f"{backend.name}/{self.prefix}"

    def write(self, staging: Staging, landed: Landed) -> None:
        names = [f.name for f in self.shard.files]
        with self.backend.local_folder(self.prefix, names) as folder:
            for name in names:
                landed(name, staging.put_file(name, folder / name, self.progress), None)

    def manifest(self, received: Expected) -> bytes:
        return self.shard.encode()


def published_manifest(backend: StorageBackend, prefix: str) -> ShardManifest | None:
    """The manifest of the published folder ``prefix`` on ``backend``; ``None`` when there is none
    or it does not parse."""
    if not backend.is_published(prefix, MANIFEST):
        return None
    try:
        with backend.open_read(f"{prefix}/{MANIFEST}") as f:
            return ShardManifest.decode(f"{backend.name}/{prefix}", f.read())
    except (ManifestError, StorageError):
        return None


def copy_published(src: StorageBackend, dst: StorageBackend, manifest: ShardManifest, *,
                   progress: Progress | None = None) -> Copied:
    """A published shard from one tier to another (:class:`TierSource`), every file checked against
    ``manifest``. A copy already published on ``dst`` with the same manifest is kept as is (it was
    checked the same way); any other folder there (another timeline's bytes) is replaced."""
    prefix = shard_prefix(manifest.job, manifest.step, manifest.rank)
    if dst.is_published(prefix, MANIFEST):
        there = published_manifest(dst, prefix)
        if there is not None and there.checksum == manifest.checksum:
            return Copied(0, 0.0, already=True)
        log.info("replacing a stale copy of %s on %s (another timeline's bytes)", prefix, dst.name)
        dst.delete_prefix(prefix, marker_name=MANIFEST)
    return copy_shard(TierSource(src, manifest, progress), dst, prefix, files_of(manifest))


__all__ = ["Copied", "CopyMismatch", "Expected", "ShardSource", "TierSource", "copy_published", "copy_shard",
           "files_of", "published_manifest"]
