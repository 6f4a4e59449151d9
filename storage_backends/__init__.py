"""Storage tiers for checkpoint shards: local directories, the memory tier (tmpfs) and S3-compatible
object storage.

Open tiers with :func:`open_backend` / :func:`open_tier` from a :class:`TierSpec` (module
:mod:`.tiers`); callers then use the :class:`StorageBackend` and :class:`Staging` interfaces, plus
two typed capabilities where they need more: :class:`InPlace` (a directory tier's files, to map or
send without a copy) and :class:`MemoryTier` (the memory tier's budget and keep rule, from
:attr:`Tier.memory`). boto3 is a core dependency; :class:`S3Backend` is still imported on first use,
as most processes never open an S3 tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    AlreadyPublished,
    ChecksumMismatch,
    InPlace,
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    Progress,
    Staging,
    StorageBackend,
    StorageError,
    StorageFull,
    StorageUnavailable,
    crc32c_file,
    crc32c_hex,
    crc32c_mapped,
    validate_key,
)
from .local import LocalBackend, LocalStaging
from .memory import MemoryFull, MemoryTier
from .tiers import LocalSpec, S3Spec, Tier, TierSpec, open_backend, open_tier, open_tiers

if TYPE_CHECKING:
    from .s3 import S3Backend, S3Staging


def __getattr__(name: str) -> Any:
    if name in ("S3Backend", "S3Staging"):
        from . import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AlreadyPublished",
    "ChecksumMismatch",
    "InPlace",
    "InvalidKey",
    "LocalBackend",
    "LocalSpec",
    "LocalStaging",
    "MemoryFull",
    "MemoryTier",
    "ObjectInfo",
    "ObjectNotFound",
    "Progress",
    "S3Backend",
    "S3Spec",
    "S3Staging",
    "Staging",
    "StorageBackend",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "Tier",
    "TierSpec",
    "crc32c_file",
    "crc32c_hex",
    "crc32c_mapped",
    "open_backend",
    "open_tier",
    "open_tiers",
    "validate_key",
]
