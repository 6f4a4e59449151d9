"""The one way to copy a shard (checkpoints/copy.py) on real directory tiers: published whole and
checked, or not at all; what is already there with the same manifest is kept, another timeline's
replaced."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ftd.checkpoints.copy import CopyMismatch, Landed, copy_published, copy_shard, files_of, published_manifest
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.storage_backends.base import Staging, crc32c_hex
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.memory import MemoryTier

A, B = os.urandom(300_000), os.urandom(1234)


def publish(backend: LocalBackend, step: int, files: dict[str, bytes]) -> ShardManifest:
    manifest = ShardManifest("job", step, 1, 0, 1, "torch",
                             tuple(FileEntry(n, len(d), crc32c_hex(d)) for n, d in sorted(files.items())))
    staging = backend.stage(shard_prefix("job", step, 0))
    for name, data in files.items():
        staging.put_stream(name, io.BytesIO(data))
    staging.publish(MANIFEST, manifest.encode())
    return manifest


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_copy_between_tiers_is_checked_and_published_last(tmp_path: Path) -> None:
    mem, ssd = MemoryTier(tmp_path / "mem"), LocalBackend(tmp_path / "ssd")
    manifest = publish(mem, 3, {"state.pt": A, "extra.bin": B})
    copied = copy_published(mem, ssd, manifest)
    assert copied.bytes == len(A) + len(B) and not copied.already
    prefix = shard_prefix("job", 3, 0)
    assert (tmp_path / "ssd" / prefix / "state.pt").read_bytes() == A
    assert published_manifest(ssd, prefix) == manifest
    assert copy_published(mem, ssd, manifest).already, "the same shard is there: kept as is"


def test_a_corrupt_source_publishes_nothing(tmp_path: Path) -> None:
    mem, ssd = MemoryTier(tmp_path / "mem"), LocalBackend(tmp_path / "ssd")
    manifest = publish(mem, 3, {"state.pt": A})
    (tmp_path / "mem" / shard_prefix("job", 3, 0) / "state.pt").write_bytes(bytes([A[0] ^ 0xFF]) + A[1:])
    with pytest.raises(CopyMismatch, match=r"state\.pt: 300000 bytes crc32c [0-9a-f]{8}, the manifest says") as err:
        copy_published(mem, ssd, manifest)
    assert err.value.file == "state.pt" and leftovers(tmp_path / "ssd") == []


def test_another_timelines_copy_is_replaced(tmp_path: Path) -> None:
    mem, ssd = MemoryTier(tmp_path / "mem"), LocalBackend(tmp_path / "ssd")
    publish(ssd, 3, {"state.pt": B})  # the same step of an abandoned timeline
    manifest = publish(mem, 3, {"state.pt": A})
    assert not copy_published(mem, ssd, manifest).already
    assert (tmp_path / "ssd" / shard_prefix("job", 3, 0) / "state.pt").read_bytes() == A


class Wire:
    """A source off the wire: files as streams, what the sender read, the manifest last."""

    where = "the wire"

    def __init__(self, files: dict[str, bytes], sent: dict[str, str], manifest: bytes) -> None:
        self.files, self.sent, self.raw = files, sent, manifest

    def write(self, staging: Staging, landed: Landed) -> None:
        for name, data in self.files.items():
            landed(name, staging.put_stream(name, io.BytesIO(data)), self.sent[name])

    def manifest(self, received: dict[str, tuple[int, str]]) -> bytes:
        return self.raw


def test_off_the_wire_the_sender_and_the_expected_files_are_checked(tmp_path: Path) -> None:
    spool, prefix = LocalBackend(tmp_path / "spool"), shard_prefix("job", 5, 0)
    expected = {"state.pt": (len(A), crc32c_hex(A))}
    lie = Wire({"state.pt": b"evil"}, {"state.pt": crc32c_hex(A)}, b"{}")
    with pytest.raises(CopyMismatch, match="the sender read"):
        copy_shard(lie, spool, prefix, expected)
    with pytest.raises(CopyMismatch, match=r"lacks state\.pt"):
        copy_shard(Wire({}, {}, b"{}"), spool, prefix, expected, says="the catalog")
    assert leftovers(tmp_path / "spool") == []
    good = Wire({"state.pt": A}, {"state.pt": crc32c_hex(A)}, b'{"m": 1}')
    assert copy_shard(good, spool, prefix, expected).bytes == len(A)
    assert (tmp_path / "spool" / prefix / MANIFEST).read_bytes() == b'{"m": 1}'
    assert files_of(publish(LocalBackend(tmp_path / "x"), 1, {"state.pt": A})) == expected
