"""Storage tiers for checkpoint shards: local directories and S3-compatible object storage.

Open tiers with :func:`open_backend` / :func:`open_tier` from a :class:`TierSpec` (module
:mod:`.tiers`); callers then use the :class:`StorageBackend` and :class:`Staging` interfaces only.
:class:`S3Backend` is imported on first use: boto3 is an optional dependency (the ``s3`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    AlreadyPublished,
    ChecksumMismatch,
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
    validate_key,
)
from .local import LocalBackend, LocalStaging
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
    "InvalidKey",
    "LocalBackend",
    "LocalSpec",
    "LocalStaging",
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
    "open_backend",
    "open_tier",
    "open_tiers",
    "validate_key",
]
