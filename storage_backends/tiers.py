"""Tiers are described once and opened in one place.

A :class:`TierSpec` says everything needed to open a tier: its name, where the catalog records its
copies, and its storage — a directory (:class:`LocalSpec`) or an S3-compatible bucket with every one
of its settings (:class:`S3Spec`). The agent builds the specs from its settings and hands the very
same specs to the training process over ``GetTiers`` (the wire form lives at those edges:
``ftd.agent.tiers_wire`` writes it, ``ftd.training.agent_link`` reads it back), so both sides open
identical backends with :func:`open_backend`; a setting added here travels to both, instead of one
side silently falling back to a default (the S3 region once did). The tier named ``mem`` opens as
the :class:`~.memory.MemoryTier` (its budget and keep rule: :attr:`Tier.memory`).

Credentials are not part of a spec: each process takes them from its own environment, as boto3 does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .base import StorageBackend
from .local import LocalBackend
from .memory import NAME as MEMORY
from .memory import MemoryTier

SHARED_LOCATIONS = ("shared", "s3")  # locations of tiers that every node sees (vs. a node id)
_MIN_PART = 5 << 20  # S3's smallest multipart part


@dataclass(frozen=True)
class LocalSpec:
    """A directory tier: a local disk, a mounted shared filesystem, or the memory tier (a tmpfs
    directory owned by the agent). ``capacity_bytes``: the memory tier's budget, checked before
    every write (0: only the filesystem's free space); other directory tiers have none."""

    path: Path
    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ValueError(f"tier directory {self.path}: capacity_bytes must be >= 0, got {self.capacity_bytes}")


@dataclass(frozen=True)
class S3Spec:
    """Every setting of an S3 tier (see :class:`.s3.S3Backend` for what each one does)."""

    endpoint: str  # URL; "" for the provider's default endpoint of ``region``
    bucket: str
    prefix: str = ""
    region: str = "us-east-1"
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    max_attempts: int = 5
    state_dir: Path | None = None  # upload journals
    part_size: int = 64 << 20
    concurrency: int = 4
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    part_checksum: str = "crc32c"
    spool_dir: Path | None = None  # local copies: downloads for readers that need paths, large streams

    def __post_init__(self) -> None:
        checks = {
            "bucket": bool(self.bucket),
            "region": bool(self.region),
            "connect_timeout_s": self.connect_timeout_s > 0,
            "read_timeout_s": self.read_timeout_s > 0,
            "max_attempts": self.max_attempts >= 1,
            "part_size": self.part_size >= _MIN_PART,
            "concurrency": self.concurrency >= 1,
            "backoff_s": self.backoff_s >= 0,
            "max_backoff_s": self.max_backoff_s >= self.backoff_s,
            "part_checksum": self.part_checksum in ("crc32c", "md5"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = ", ".join(f"{name}={getattr(self, name)!r}" for name in bad)
            raise ValueError(f"invalid S3 tier settings for bucket {self.bucket!r}: {values}")


@dataclass(frozen=True)
class TierSpec:
    """One tier: ``name`` ("mem", "ssd", "hdd", "s3"), ``location`` (this node's id for a node-local tier,
    "shared" or "s3" for one every node sees) and its storage."""

    name: str
    location: str
    storage: LocalSpec | S3Spec

    @property
    def shared(self) -> bool:
        return self.location in SHARED_LOCATIONS


@dataclass(frozen=True)
class Tier:
    """An opened tier: its spec and the backend made from it by :func:`open_backend`."""

    spec: TierSpec
    backend: StorageBackend

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def location(self) -> str:
        return self.spec.location

    @property
    def shared(self) -> bool:
        return self.spec.shared

    @property
    def memory(self) -> MemoryTier | None:
        """The memory tier's own operations (byte budget, keep rule), when this tier is it."""
        return self.backend if isinstance(self.backend, MemoryTier) else None


def open_backend(spec: TierSpec) -> StorageBackend:
    """The one place where storage backends are constructed. The S3 backend is imported only when a
    spec asks for it (boto3 alone takes 0.15 s to import; most processes never open an S3 tier)."""
    storage = spec.storage
    if isinstance(storage, LocalSpec):
        if spec.name == MEMORY:
            return MemoryTier(storage.path, storage.capacity_bytes)
        return LocalBackend(storage.path)
    from .s3 import S3Backend

    return S3Backend(
        storage.bucket, storage.prefix, endpoint_url=storage.endpoint or None, region=storage.region,
        part_size=storage.part_size, concurrency=storage.concurrency, state_dir=storage.state_dir,
        max_attempts=storage.max_attempts, connect_timeout_s=storage.connect_timeout_s,
        read_timeout_s=storage.read_timeout_s, backoff_s=storage.backoff_s, max_backoff_s=storage.max_backoff_s,
        part_checksum=storage.part_checksum, spool_dir=storage.spool_dir,
    )


def open_tier(spec: TierSpec) -> Tier:
    return Tier(spec, open_backend(spec))


def open_tiers(specs: Iterable[TierSpec]) -> list[Tier]:
    return [open_tier(spec) for spec in specs]


__all__ = [
    "SHARED_LOCATIONS",
    "LocalSpec",
    "S3Spec",
    "Tier",
    "TierSpec",
    "open_backend",
    "open_tier",
    "open_tiers",
]
