"""The save loop's snapshot buffers are reused, so a save must own them until its shard is written.
A regression: when a save's commit ran long, its end marked the buffers free although the next save
(queued behind it) had not written its snapshot yet; the snapshot after that then overwrote the
buffers under it, and that step's shard held the next step's values (a torn checkpoint, found
restoring an FSDP2 job after a rollback). Here the commit of step 1 is held while steps 2 and 3 are
saved; every shard must hold its own step's values."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ftd.storage_backends.tiers import LocalSpec, TierSpec, open_tier  # noqa: E402
from ftd.training.save_loop import SaveLoop  # noqa: E402
from ftd.v1 import checkpoint_pb2  # noqa: E402


class SlowFirstCommit:
    """The agent as the save loop sees it: the commit of step 1 waits until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.committed: list[int] = []

    def commit_shard(self, manifest: checkpoint_pb2.ShardManifest, **_: Any) -> checkpoint_pb2.CommitShardResponse:
        if manifest.step == 1:
            assert self.release.wait(30), "the test never released the first commit"
        self.committed.append(manifest.step)
        return checkpoint_pb2.CommitShardResponse()

    def report(self, *_: Any, **__: Any) -> None:
        return None


def test_a_slow_commit_never_lets_a_later_snapshot_overwrite_a_shard_still_being_written(tmp_path: Path) -> None:
    agent = SlowFirstCommit()
    ssd = open_tier(TierSpec("ssd", "node-0", LocalSpec(tmp_path / "ssd")))
    loop = SaveLoop("job", 0, 1, 1, "torch", agent, ssd, None)  # type: ignore[arg-type]
    weights = torch.zeros(1024)
    try:
        loop.save(1, {"w": weights})
        weights.fill_(2.0)
        second = loop.save(2, {"w": weights})  # step 1's shard is written; its commit waits
        agent.release.set()  # step 1 commits and ends while step 2 may still be queued or writing
        weights.fill_(3.0)
        loop.save(3, {"w": weights})  # must wait until step 2's shard is written
        weights.fill_(4.0)
        assert second.result(timeout=30).ok
        loop.wait()
    finally:
        loop.close()
    assert agent.committed == [1, 2, 3]
    for step, value in ((1, 0.0), (2, 2.0), (3, 3.0)):
        path = tmp_path / "ssd" / "job" / f"step-{step:012d}" / "rank-00000" / "state.pt"
        saved = torch.load(path, weights_only=True)["w"]
        assert torch.all(saved == value), f"step {step}'s shard holds {saved.unique().tolist()}, not {value}"


def test_shards_carry_no_zip_crc32_and_the_switch_is_restored_after_the_last_writer(tmp_path: Path) -> None:
    """torch.save's per-record CRC32 is a third of a snapshot's write and torch.load never reads
    it; ftd's CRC32C covers the file. The switch is process-wide: shared by count, restored after."""
    import zipfile

    from torch.utils.serialization import config

    from ftd.training.save_loop import _ZipCrc

    def data_crcs(path: Path) -> list[int]:
        return [i.CRC for i in zipfile.ZipFile(path).infolist() if "/data/" in i.filename]

    assert config.save.compute_crc32
    with _ZipCrc.off():
        with _ZipCrc.off():
            assert not config.save.compute_crc32
        assert not config.save.compute_crc32, "one writer is still writing"
    assert config.save.compute_crc32
    torch.save({"w": torch.arange(8.0)}, tmp_path / "user.pt")  # the user's own saves keep theirs
    assert all(data_crcs(tmp_path / "user.pt"))

    agent = SlowFirstCommit()
    agent.release.set()
    ssd = open_tier(TierSpec("ssd", "node-0", LocalSpec(tmp_path / "ssd")))
    loop = SaveLoop("job", 0, 1, 1, "torch", agent, ssd, None)  # type: ignore[arg-type]
    try:
        assert loop.save(1, {"w": torch.arange(8.0)}).result(timeout=30).ok
    finally:
        loop.close()
    shard = tmp_path / "ssd" / "job" / f"step-{1:012d}" / "rank-00000" / "state.pt"
    assert data_crcs(shard) == [0]
    assert torch.equal(torch.load(shard, weights_only=True)["w"], torch.arange(8.0))
    assert config.save.compute_crc32
