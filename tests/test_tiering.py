"""The tiering of committed shards, one pass at a time, with a fake clock, in-memory tiers and an
in-memory catalog: what is copied (newest first, verified, recorded), what is skipped, what retention
deletes, and how the bandwidth limit paces the copies — without any time passing."""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ftd.agent.tiering import Tiering
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.storage_backends.base import (
    AlreadyPublished,
    ObjectInfo,
    ObjectNotFound,
    StorageFull,
    StorageUnavailable,
    crc32c_hex,
)
from ftd.storage_backends.tiers import LocalSpec, Tier, TierSpec
from ftd.v1 import checkpoint_pb2

MiB = 1 << 20
JOB = "job"

# ---- fakes ------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class MemoryBackend:
    """A StorageBackend in a dict: published objects in ``objects``; ``full`` makes writes fail."""

    def __init__(self, name: str, scratch: Path) -> None:
        self.name = name
        self.objects: dict[str, bytes] = {}
        self.scratch = scratch
        self.full = False
        self.down = False  # unreachable: every call raises StorageUnavailable (and is counted)
        self.tries_while_down = 0
        self.cleanups = 0
        self._n = itertools.count()

    def write(self, key: str, data: bytes, progress: Callable[[int], None] | None) -> ObjectInfo:
        if self.full:
            raise StorageFull(self.name, key, "quota exceeded (fake)")
        for i in range(0, len(data), 256 * 1024):
            if progress is not None:
                progress(len(data[i:i + 256 * 1024]))
        self.objects[key] = data
        return ObjectInfo(key, len(data), 0.0, crc32c_hex(data))

    def put_stream(self, key: str, src: BinaryIO, progress: Callable[[int], None] | None = None) -> ObjectInfo:
        return self.write(key, src.read(), progress)

    def put_file(self, key: str, path: Path, progress: Callable[[int], None] | None = None) -> ObjectInfo:
        return self.write(key, path.read_bytes(), progress)

    def open_read(self, key: str) -> BinaryIO:
        if key not in self.objects:
            raise ObjectNotFound(self.name, key, "no such object")
        return io.BytesIO(self.objects[key])

    def get_file(self, key: str, path: Path, progress: Any = None) -> ObjectInfo:
        with self.open_read(key) as f:
            path.write_bytes(f.read())
        return ObjectInfo(key, path.stat().st_size, 0.0, None)

    @contextmanager
    def local_folder(self, prefix: str, names: Iterable[str]) -> Iterator[Path]:
        folder = self.scratch / f"{self.name}-{next(self._n)}"
        folder.mkdir(parents=True)
        for name in names:
            self.get_file(f"{prefix}/{name}", folder / name)
        yield folder

    def stat(self, key: str) -> ObjectInfo | None:
        data = self.objects.get(key)
        return None if data is None else ObjectInfo(key, len(data), 0.0, crc32c_hex(data))

    def _reach(self, what: str) -> None:
        if self.down:
            self.tries_while_down += 1
            raise StorageUnavailable(self.name, what, "connect timeout (fake)")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._reach(prefix)
        for key in sorted(k for k in self.objects if k.startswith(prefix)):
            yield ObjectInfo(key, len(self.objects[key]), 0.0)

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def delete_prefix(self, prefix: str, *, marker_name: str = MANIFEST) -> int:
        doomed = [k for k in self.objects if k.startswith(prefix.rstrip("/") + "/")]
        for k in doomed:
            del self.objects[k]
        return len(doomed)

    def stage(self, prefix: str) -> MemoryStaging:
        self._reach(prefix)
        if self.full:
            raise StorageFull(self.name, prefix, "quota exceeded (fake)")
        return MemoryStaging(self, prefix)

    def is_published(self, prefix: str, marker_name: str) -> bool:
        self._reach(prefix)
        return f"{prefix.rstrip('/')}/{marker_name}" in self.objects

    def cleanup(self, prefix: str = "", older_than_s: float = 0.0, **_: Any) -> list[str]:
        self._reach(prefix)
        self.cleanups += 1
        return []

    def steps(self) -> set[int]:
        return {int(k.split("/")[1][5:]) for k in self.objects if k.endswith("/" + MANIFEST)}


class MemoryStaging:
    def __init__(self, backend: MemoryBackend, prefix: str) -> None:
        self.backend, self.prefix = backend, prefix
        self.staged: dict[str, bytes] = {}

    def put_file(self, name: str, path: Path, progress: Callable[[int], None] | None = None) -> ObjectInfo:
        info = self.backend.write(f"{self.prefix}/.staged/{name}", path.read_bytes(), progress)
        self.staged[name] = self.backend.objects.pop(info.key)
        return ObjectInfo(name, info.size, 0.0, info.crc32c)

    def put_stream(self, name: str, src: BinaryIO, progress: Any = None) -> ObjectInfo:
        raise AssertionError("tiering copies from files, so that an upload can resume")

    def publish(self, marker_name: str, marker: bytes) -> None:
        if self.backend.is_published(self.prefix, marker_name):
            raise AlreadyPublished(self.backend.name, self.prefix, "published by someone else")
        for name, data in {**self.staged, marker_name: marker}.items():
            self.backend.objects[f"{self.prefix}/{name}"] = data

    def abort(self) -> None:
        self.staged.clear()


class FakeCatalog:
    """The coordinator's catalog RPCs over CheckpointRecords, through the same wire form (to_info)."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, int], CheckpointRecord] = {}
        self.copies: list[tuple[int, str, bool, str]] = []  # (step, "tier@location", present, corrupt reason)
        self.down = False

    def commit(self, manifest: ShardManifest, node: str) -> None:
        before = self.records.get((manifest.job, manifest.step))
        self.records[(manifest.job, manifest.step)] = rules.commit_shard(before, manifest, "ssd", node, 0.0)[0]

    def __call__(self, method: str, request: Any) -> Any:
        if self.down:
            raise ConnectionError("coordinator unreachable (fake)")
        if method == "ListCheckpoints":
            return checkpoint_pb2.ListCheckpointsResponse(checkpoints=[
                rules.to_info(r) for (job, _), r in sorted(self.records.items()) if job == request.job])
        assert method == "RecordCopy", method
        r = request
        self.copies.append((r.step, CopyRef(r.tier, r.location).key, r.present, r.corrupt_reason))
        record = self.records[(r.job, r.step)]
        if r.present and not r.corrupt_reason:
            assert not r.checksum or r.checksum == record.shards[r.rank].checksum, "the coordinator refuses this"
            record = rules.add_copy(record, r.rank, r.tier, r.location)
        else:
            record = rules.drop_copy(record, r.rank, r.tier, r.location, r.corrupt_reason)
        self.records[(r.job, r.step)] = record
        return checkpoint_pb2.RecordCopyResponse(checkpoint=rules.to_info(record))


def save_shard(ssd: MemoryBackend, catalog: FakeCatalog, step: int, size: int, *, world_size: int = 1,
               corrupt: bool = False) -> ShardManifest:
    """What a rank's save leaves: a published shard on the SSD, committed in the catalog."""
    data = bytes([step % 251]) * size
    manifest = ShardManifest(JOB, step, 1, 0, world_size, "torch", (FileEntry("state.pt", size, crc32c_hex(data)),))
    prefix = shard_prefix(JOB, step, 0)
    ssd.objects[f"{prefix}/state.pt"] = b"\xff" + data[1:] if corrupt else data
    ssd.objects[f"{prefix}/{MANIFEST}"] = manifest.encode()
    catalog.commit(manifest, "node-a")
    return manifest


@pytest.fixture
def tiers(tmp_path: Path) -> list[Tier]:
    def tier(name: str, location: str) -> Tier:
        spec = TierSpec(name, location, LocalSpec(tmp_path / name))  # the spec is only descriptive here
        return Tier(spec, MemoryBackend(name, tmp_path / "scratch"))  # type: ignore[arg-type]

    return [tier("ssd", "node-a"), tier("hdd", "shared"), tier("s3", "s3")]


def backend(tier: Tier) -> MemoryBackend:
    assert isinstance(tier.backend, MemoryBackend)
    return tier.backend


# ---- one pass ---------------------------------------------------------------------------------------


def test_another_timelines_bytes_under_a_committed_step_are_never_copied_or_recorded(tiers: list[Tier]) -> None:
    """A restart re-saved step 2 with other bytes whose commit was refused: the SSD folder is not the
    catalog's shard, so it is not copied to the HDD nor recorded there as the committed shard."""
    ssd, hdd, _ = (backend(t) for t in tiers)
    catalog, clock = FakeCatalog(), FakeClock()
    save_shard(ssd, catalog, 1, size=1000)
    committed = save_shard(ssd, catalog, 2, size=1000)
    other = bytes([7]) * 1000
    prefix = shard_prefix(JOB, 2, 0)
    ssd.objects[f"{prefix}/state.pt"] = other
    ssd.objects[f"{prefix}/{MANIFEST}"] = ShardManifest(JOB, 2, 1, 0, 1, "torch", (
        FileEntry("state.pt", 1000, crc32c_hex(other)),)).encode()
    Tiering(tiers[:2], catalog, keep=3, clock=clock, sleep=clock.sleep).pass_once()
    assert [(step, where) for step, where, present, _ in catalog.copies if present] == [(1, "hdd@shared")]
    assert hdd.steps() == {1} and catalog.records[(JOB, 2)].shards[0].checksum == committed.checksum


def test_one_pass_copies_newest_first_records_every_copy_and_keeps_the_newest_three(tiers: list[Tier]) -> None:
    ssd, hdd, s3 = (backend(t) for t in tiers)
    catalog, clock = FakeCatalog(), FakeClock()
    manifests = {step: save_shard(ssd, catalog, step, size=MiB) for step in range(1, 6)}
    rate = 2 * MiB
    tiering = Tiering(tiers, catalog, keep=3, bandwidth_bytes_s=rate, clock=clock, sleep=clock.sleep)

    tiering.pass_once()

    copied = [(step, where) for step, where, present, _ in catalog.copies if present]
    # Only what retention keeps (the newest three) is copied: steps 1 and 2 never leave the SSD.
    assert copied == [(s, "hdd@shared") for s in (5, 4, 3)] + [(s, "s3@s3") for s in (5, 4, 3)]
    assert ssd.steps() == hdd.steps() == s3.steps() == {3, 4, 5}
    for step in (3, 4, 5):
        key = f"{shard_prefix(JOB, step, 0)}/state.pt"
        assert hdd.objects[key] == s3.objects[key] == ssd.objects[key]
        prefix = shard_prefix(JOB, step, 0)
        assert ShardManifest.decode("hdd", hdd.objects[f"{prefix}/{MANIFEST}"]) == manifests[step]
        shard = catalog.records[(JOB, step)].shards[0]
        assert shard.good_copies() == [CopyRef("hdd", "shared"), CopyRef("s3", "s3"), CopyRef("ssd", "node-a")]
    for step in (1, 2):  # retention removed these everywhere and said so
        assert not catalog.records[(JOB, step)].shards[0].copies
    st = tiering.stats
    assert (st.migrations, st.deleted) == ({"hdd": 3, "s3": 3}, {"ssd": 2})
    assert st.pending == {"hdd": 0, "s3": 0} and st.errors == {}
    assert st.last_valid_step == {JOB: 5}
    assert hdd.cleanups == s3.cleanups == 1
    # 6 MiB at 2 MiB/s, the first MiB of burst free: the pass waited exactly the rest, never more.
    assert sum(clock.slept) == pytest.approx((6 * MiB - tiering.bucket.burst) / rate)

    catalog.copies.clear()
    tiering.pass_once()  # nothing left to do
    assert catalog.copies == [] and hdd.cleanups == 1  # cleanup runs once a minute, not every pass
    assert st.lag_steps == {"hdd": 0, "s3": 0}  # measured against the catalog as the pass found it


def test_a_spare_back_with_the_old_shards_of_its_rank_deletes_them_instead_of_copying_them_round(
        tiers: list[Tier]) -> None:
    """A replaced node rejoins as a spare with its disks: its SSD holds only the shards of the rank it
    had (steps 1-3 never completed: the other rank's copies are gone; step 5 still restorable from
    S3), while the job's newest kept steps (10, 20, 30) live on the shared HDD. Copying its old steps
    up would have the HDD's retention delete them at once, every pass (a loop that ran for minutes
    in bench/goodput.py); the spare copies nothing and deletes the dead steps from its SSD."""
    ssd, hdd, _ = (backend(t) for t in tiers)
    catalog, clock = FakeCatalog(), FakeClock()
    for step in (1, 2, 3, 5):
        save_shard(ssd, catalog, step, size=100, world_size=2)
    elsewhere = [(5, 1, "s3", "s3")] + [(step, rank, "hdd", "shared") for step in (10, 20, 30) for rank in (0, 1)]
    for step, rank, tier, location in elsewhere:
        data = bytes([step]) * 100
        manifest = ShardManifest(JOB, step, 1, rank, 2, "torch", (FileEntry("state.pt", 100, crc32c_hex(data)),))
        catalog.records[(JOB, step)] = rules.commit_shard(catalog.records.get((JOB, step)), manifest, tier, location,
                                                          0.0)[0]
        if tier == "hdd":
            hdd.objects[f"{shard_prefix(JOB, step, rank)}/state.pt"] = data
            hdd.objects[f"{shard_prefix(JOB, step, rank)}/{MANIFEST}"] = manifest.encode()
    assert [s for (_, s), r in sorted(catalog.records.items()) if r.restorable] == [5, 10, 20, 30]
    tiering = Tiering(tiers[:2], catalog, keep=3, clock=clock, sleep=clock.sleep)

    for _ in range(3):
        tiering.pass_once()
        clock.now += 2.0

    assert [c for c in catalog.copies if c[2]] == [], "nothing copied up to be deleted"
    assert ssd.steps() == {5}, "the dead steps went; the restorable one stays a source"
    assert hdd.steps() == {10, 20, 30} and tiering.stats.deleted == {"ssd": 3}
    assert [(step, where) for step, where, present, _ in catalog.copies] == [(s, "ssd@node-a") for s in (1, 2, 3)]


def test_a_pass_skips_invalid_steps_flags_a_corrupt_source_and_stops_at_a_full_tier(tiers: list[Tier]) -> None:
    ssd, hdd, s3 = (backend(t) for t in tiers)
    catalog, clock = FakeCatalog(), FakeClock()
    save_shard(ssd, catalog, 1, size=1000)
    catalog.records[(JOB, 1)] = replace(catalog.records[(JOB, 1)], invalid_reason="no tier holds a verified copy")
    save_shard(ssd, catalog, 2, size=1000, corrupt=True)
    save_shard(ssd, catalog, 3, size=1000, world_size=2)  # in progress: rank 1 has not committed yet
    s3.full = True
    tiering = Tiering(tiers, catalog, keep=3, clock=clock, sleep=clock.sleep)

    tiering.pass_once()

    assert hdd.steps() == {3}  # not the invalid step, not the corrupt bytes
    flagged = [(step, where, reason) for step, where, present, reason in catalog.copies if reason]
    assert flagged == [(2, "ssd@node-a", flagged[0][2])] and "crc32c" in flagged[0][2]
    assert catalog.records[(JOB, 2)].shards[0].good_copies() == []
    assert s3.steps() == set() and tiering.stats.errors == {"s3": 1}  # one failure, then the tier waits
    assert tiering.stats.pending["s3"] == 2 and clock.slept == []


def test_an_unreachable_tier_rests_while_the_others_go_on(tiers: list[Tier]) -> None:
    """S3 down: one failed try, then S3 rests (5 s, doubling) while HDD migration and SSD retention go
    on every pass; the lag is still reported; once S3 answers, the backlog goes newest first."""
    ssd, hdd, s3 = (backend(t) for t in tiers)
    catalog, clock = FakeCatalog(), FakeClock()
    tiering = Tiering(tiers, catalog, keep=3, clock=clock, sleep=clock.sleep)
    tiering.cleanup_every_s = 1e9  # not the point here
    save_shard(ssd, catalog, 1, size=100)
    tiering.pass_once()  # S3 reachable: step 1 everywhere
    s3.down = True
    for step in (2, 3, 4, 5):
        save_shard(ssd, catalog, step, size=100)
        clock.now += 1.0
        tiering.pass_once()
    assert hdd.steps() == {3, 4, 5} and ssd.steps() == {3, 4, 5}  # HDD kept up, SSD retention too
    assert s3.steps() == {1}
    assert s3.tries_while_down == 1, "tried once, then resting for 5 s"
    assert tiering.stats.errors == {"s3": 1} and tiering.stats.lag_steps["s3"] == 5  # none of 3..5 there
    clock.now += 2.0  # 6 s after the failure: one more try, and the rest doubles to 10 s
    tiering.pass_once()
    assert s3.tries_while_down == 2 and tiering.stats.errors == {"s3": 2}
    clock.now += 5.0
    tiering.pass_once()
    assert s3.tries_while_down == 2
    s3.down = False
    clock.now += 6.0
    tiering.pass_once()
    assert s3.steps() == {3, 4, 5}
    tiering.pass_once()
    assert tiering.stats.lag_steps["s3"] == 0  # measured against the catalog as the pass found it
    s3_copies = [step for step, where, present, _ in catalog.copies if present and where == "s3@s3"]
    assert s3_copies[1:] == [5, 4, 3]  # after step 1: the backlog newest first


def test_without_the_catalog_nothing_is_copied_or_deleted(tiers: list[Tier]) -> None:
    ssd, hdd, s3 = (backend(t) for t in tiers)
    catalog = FakeCatalog()
    for step in range(1, 6):
        save_shard(ssd, catalog, step, size=100)
    catalog.down = True
    Tiering(tiers, catalog, keep=1).pass_once()
    assert ssd.steps() == {1, 2, 3, 4, 5} and hdd.objects == {} and s3.objects == {}
