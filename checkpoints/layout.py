"""Where a checkpoint's bytes live on a tier, and the shard manifest written last.

``<job>/step-<step:012d>/rank-<rank:05d>/`` holds one rank's shard: its data files and ``SHARD.json``,
the manifest (step, epoch, rank, world size, format, per-file size and CRC32C, created time) written
**last**, so a shard folder is complete exactly when its manifest is there (the tier's publish
strategy guarantees the rest). Folders are never reused. On a cluster with mTLS one of the data
files is ``SHARD.sig``, the writing node's signature over the others' SHA-256s (:mod:`.signing`).

Identifiers arrive from RPCs and from files on disk; anything that could escape a directory is
refused here with :class:`BadIdentifier` / :class:`ManifestError`, never deeper in the I/O.

This module imports nothing else of ftd: the storage tiers (the memory tier lists its snapshots by
this layout) and the catalog both build on it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c

MANIFEST = "SHARD.json"
FORMATS = ("torch", "dcp")
# Whole strings only (re.fullmatch): with re.match, "$" also matches before a final newline.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FILE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._-]{0,254}")
_STEP_DIR = re.compile(r"step-([0-9]{12})")
_RANK_DIR = re.compile(r"rank-([0-9]{5})")
MAX_STEP = 10**12 - 1
MAX_RANK = 10**5 - 1


class BadIdentifier(ValueError):
    """A job, step or rank identifier is malformed; ``field`` names it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class ManifestError(ValueError):
    """A shard manifest does not parse or contradicts itself; ``where`` names the file."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"shard manifest {where} is invalid: {why}")
        self.where = where


def check_job(job: Any) -> str:
    if not isinstance(job, str) or not _ID.fullmatch(job) or job in (".", ".."):
        raise BadIdentifier("job", f"{str(job)[:100]!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return job


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise BadIdentifier("step", f"{str(step)[:100]!r} must be an integer in [0, {MAX_STEP}]")
    return step


def check_rank(rank: Any, world_size: int | None = None) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_RANK:
        raise BadIdentifier("rank", f"{str(rank)[:100]!r} must be an integer in [0, {MAX_RANK}]")
    if world_size is not None and rank >= world_size:
        raise BadIdentifier("rank", f"{rank} is not below the world size {world_size}")
    return rank


def check_file_name(name: Any) -> str:
    if not isinstance(name, str) or not _FILE.fullmatch(name) or name in (".", "..") or name == MANIFEST:
        raise BadIdentifier("file", f"{str(name)[:100]!r} is not a plain file name")
    return name


def step_prefix(job: str, step: int) -> str:
    return f"{check_job(job)}/step-{check_step(step):012d}"


def shard_prefix(job: str, step: int, rank: int) -> str:
    return f"{step_prefix(job, step)}/rank-{check_rank(rank):05d}"


def parse_shard_key(key: str) -> tuple[str, int, int] | None:
    """``job/step-…/rank-…[/anything]`` → (job, step, rank), or ``None`` for anything else."""
    parts = key.split("/")
    if len(parts) < 3:
        return None
    step_m, rank_m = _STEP_DIR.fullmatch(parts[1]), _RANK_DIR.fullmatch(parts[2])
    if not step_m or not rank_m or not _ID.fullmatch(parts[0]):
        return None
    return parts[0], int(step_m.group(1)), int(rank_m.group(1))


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a shard. Slotted: a leader keeps hundreds of thousands (every node's memory report),
    and an instance without a ``__dict__`` is half the objects its garbage collector walks."""

    name: str
    size: int
    crc32c: str


def files_checksum(files: Iterable[FileEntry]) -> str:
    """One CRC32C over files' names, sizes and CRC32Cs, in order: a shard's checksum (the leader computes
    it for reported memory snapshots without building a manifest)."""
    return f"{crc32c.crc32c(''.join(f'{f.name}:{f.size}:{f.crc32c};' for f in files).encode()):08x}"


@dataclass(frozen=True)
class ShardManifest:
    job: str
    step: int
    epoch: int
    rank: int
    world_size: int
    format: str
    files: tuple[FileEntry, ...]
    created_unix_s: float = field(default_factory=time.time)
    version: int = 1

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def checksum(self) -> str:
        """One CRC32C for the shard: :func:`files_checksum` of its files."""
        return files_checksum(self.files)

    def encode(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files]
        return json.dumps(data, sort_keys=True, indent=1).encode()

    @classmethod
    def decode(cls, where: str, raw: bytes) -> ShardManifest:
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(where, f"not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ManifestError(where, "not a JSON object")
        try:
            files = tuple(FileEntry(check_file_name(f["name"]), int(f["size"]), str(f["crc32c"]))
                          for f in data["files"])
            manifest = cls(
                job=check_job(data["job"]), step=check_step(data["step"]), epoch=int(data["epoch"]),
                rank=check_rank(data["rank"], int(data["world_size"])), world_size=int(data["world_size"]),
                format=str(data["format"]), files=files, created_unix_s=float(data["created_unix_s"]),
                version=int(data.get("version", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(where, f"{type(exc).__name__}: {exc}") from exc
        if manifest.format not in FORMATS:
            raise ManifestError(where, f"unknown format {manifest.format!r}")
        if not files or any(f.size < 0 or not re.fullmatch(r"[0-9a-f]{8}", f.crc32c) for f in files):
            raise ManifestError(where, "file entries need a size >= 0 and an 8-hex-digit crc32c")
        return manifest
