"""The restore order (training/restore.py, a pure function): which copy of a shard a rank reads
first, and which tier of this node reads it."""

from __future__ import annotations

from pathlib import Path

from ftd.checkpoints.catalog import CopyRef, ShardRecord
from ftd.checkpoints.layout import FileEntry
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.tiers import LocalSpec, S3Spec, Tier, TierSpec
from ftd.training.restore import order_copies

FILES = (FileEntry("state.pt", 10, "0a0b0c0d"),)


def shard(*copies: CopyRef, bad: dict[str, str] | None = None) -> ShardRecord:
    return ShardRecord(0, 10, "c", FILES, frozenset(copies), bad or {})


def tiers(node: str) -> list[Tier]:
    """This node's tiers (ordering is pure: their backends are never touched, so none is opened)."""
    specs = [TierSpec("mem", node, LocalSpec(Path("/m"))), TierSpec("ssd", node, LocalSpec(Path("/s"))),
             TierSpec("hdd", "shared", LocalSpec(Path("/h"))), TierSpec("s3", "s3", S3Spec(endpoint="", bucket="b"))]
    return [Tier(spec, LocalBackend(Path("/nonexistent"))) for spec in specs]


def test_memory_first_then_this_nodes_disks_then_other_nodes_disks() -> None:
    mine = tiers("a")
    copies = [CopyRef("ssd", "b"), CopyRef("s3", "s3"), CopyRef("hdd", "shared"), CopyRef("ssd", "a"),
              CopyRef("mem", "c"), CopyRef("mem", "a"), CopyRef("mem", "b")]
    order = order_copies(shard(*copies), mine)
    assert [str(c) for c, _ in order] == ["mem@a", "mem@b", "mem@c", "ssd@a", "hdd@shared", "s3@s3", "ssd@b"]
    readers = {str(c): t for c, t in order}
    assert readers["mem@a"] is mine[0] and readers["ssd@a"] is mine[1] and readers["s3@s3"] is mine[3]
    assert readers["mem@b"] is None and readers["ssd@b"] is None, "another node's copy is pulled through the agent"


def test_corrupt_copies_are_left_out_and_nodes_not_alive_go_last() -> None:
    s = shard(CopyRef("mem", "b"), CopyRef("mem", "c"), CopyRef("ssd", "b"), CopyRef("ssd", "a"),
              bad={"mem@c": "crc32c mismatch"})
    assert [str(c) for c, _ in order_copies(s, tiers("a"))] == ["mem@b", "ssd@a", "ssd@b"]
    # Node b is not known alive: its copies come after every other, this node's own are never affected.
    assert [str(c) for c, _ in order_copies(s, tiers("a"), alive={"c"})] == ["ssd@a", "mem@b", "ssd@b"]
    assert order_copies(shard(), tiers("a")) == []
