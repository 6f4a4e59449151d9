"""Checkpoint layout, shard manifests and catalog rules: pure, no I/O."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftd.checkpoints.catalog import (
    CatalogError,
    CheckpointRecord,
    CopyRef,
    Rollback,
    add_copy,
    commit_shard,
    decode_all,
    drop_copy,
    encode,
    encode_rollback,
    from_info,
    invalidation_loses_last,
    job_floor,
    restorable_steps,
    restore_target,
    retention,
    rollback,
    to_info,
)
from ftd.checkpoints.layout import (
    BadIdentifier,
    FileEntry,
    ManifestError,
    ShardManifest,
    check_job,
    check_step,
    parse_shard_key,
    shard_prefix,
)


def manifest(step: int = 100, rank: int = 0, world: int = 2, epoch: int = 3, crc: str = "0a0b0c0d") -> ShardManifest:
    return ShardManifest("job1", step, epoch, rank, world, "torch", (FileEntry("state.pt", 1024, crc),), 5.0)


@pytest.mark.parametrize("job", ["..", ".", "a/b", "/abs", "", "a\\b", "x" * 200, "-lead", 7])
def test_job_ids_that_could_escape_are_refused(job: object) -> None:
    with pytest.raises(BadIdentifier) as err:
        check_job(job)
    assert err.value.field == "job"


@pytest.mark.parametrize("step", [-1, "5", "../5", 1.5, True, 10**12])
def test_bad_steps(step: object) -> None:
    with pytest.raises(BadIdentifier):
        check_step(step)


def test_layout_keys() -> None:
    assert shard_prefix("job1", 100, 3) == "job1/step-000000000100/rank-00003"
    assert parse_shard_key("job1/step-000000000100/rank-00003/state.pt") == ("job1", 100, 3)
    assert parse_shard_key("job1/step-1/rank-00003") is None
    assert parse_shard_key("../step-000000000100/rank-00003") is None


def test_manifest_roundtrip_and_named_errors() -> None:
    m = manifest()
    assert ShardManifest.decode("x", m.encode()) == m
    assert len(m.checksum) == 8 and m.checksum != manifest(crc="ffffffff").checksum
    with pytest.raises(ManifestError, match="not JSON"):
        ShardManifest.decode("ssd:job1/step/SHARD.json", b"{not json")
    bad = m.encode().replace(b'"state.pt"', b'"../../etc/passwd"')
    with pytest.raises(ManifestError, match="file"):
        ShardManifest.decode("x", bad)
    with pytest.raises(ManifestError):
        ShardManifest.decode("x", m.encode().replace(b'"rank": 0', b'"rank": 7'))


def test_a_checkpoint_is_valid_only_when_every_rank_committed() -> None:
    rec, what = commit_shard(None, manifest(rank=1), "ssd", "node-1", 10.0)
    assert not rec.valid and rec.status() == "in progress: 1 of 2 shards committed"
    rec, what = commit_shard(rec, manifest(rank=0), "ssd", "node-0", 11.0)
    assert rec.valid and "now valid" in what
    assert rec.on_tier("ssd") and not rec.on_tier("hdd")
    rec, _ = commit_shard(rec, manifest(rank=0), "hdd", "shared", 12.0)
    rec, _ = commit_shard(rec, manifest(rank=1), "hdd", "shared", 12.0)
    assert rec.on_tier("hdd")
    assert not drop_copy(rec, 1, "hdd", "shared", corrupt="crc mismatch").on_tier("hdd")


def test_contradictions_are_refused_with_the_field() -> None:
    rec, _ = commit_shard(None, manifest(rank=0), "ssd", "n0", 1.0)
    with pytest.raises(CatalogError) as err:
        commit_shard(rec, manifest(rank=1, world=4), "ssd", "n1", 1.0)
    assert err.value.field == "world_size" and not err.value.exists
    with pytest.raises(CatalogError) as err:
        commit_shard(rec, manifest(rank=0, crc="deadbeef"), "ssd", "n0", 1.0)
    assert err.value.field == "rank" and err.value.exists
    with pytest.raises(CatalogError, match="unknown tier"):
        commit_shard(rec, manifest(rank=1), "tape", "n1", 1.0)


def test_restore_target_and_rollback() -> None:
    recs = []
    for step in (10, 20, 30):
        r, _ = commit_shard(None, manifest(step=step, rank=0, world=1), "ssd", "n0", float(step))
        recs.append(r)
    partial, _ = commit_shard(None, manifest(step=40, rank=0, world=2), "ssd", "n0", 40.0)
    recs.append(partial)
    target, why = restore_target(recs)
    assert target is not None and target.step == 30 and "newest valid" in why
    rb, removed = rollback(recs, "job1", 20, 99.0)
    assert [r.step for r in removed] == [30, 40] and rb.superseded == (30, 40)
    kept = [r for r in recs if r.step not in rb.superseded]
    target, why = restore_target(kept, rb)
    assert target is not None and target.step == 20 and "rollback" in why
    with pytest.raises(CatalogError, match="not valid"):
        rollback(recs, "job1", 40, 1.0)
    with pytest.raises(CatalogError, match="no checkpoint at step 25"):
        rollback(recs, "job1", 25, 1.0)
    assert restore_target([])[0] is None


def test_retention_keeps_the_last_three_valid_committed_here() -> None:
    steps = range(10, 110, 10)  # 10 checkpoints
    on_tier = {s: True for s in steps}
    valid = {s: True for s in steps}
    assert [d.step for d in retention(on_tier, valid, keep=3)] == list(range(10, 80, 10))
    # 100 is valid but not yet copied here: 70 must stay until it is.
    on_tier[100] = False
    assert 70 not in {d.step for d in retention(on_tier, valid, keep=3)}
    # In-progress (unknown) newer steps are never touched; invalid older ones go.
    on_tier, valid = {10: True, 20: True, 30: True, 40: True, 50: True}, {10: False, 20: True, 30: True, 40: True}
    deleted = {d.step: d.reason for d in retention(on_tier, valid, keep=3)}
    assert set(deleted) == {10} and "invalid" in deleted[10]
    # Fewer valid than keep: nothing older is deleted at all.
    assert retention({1: True, 2: True}, {1: False, 2: True}, keep=3) == []


def test_the_jobs_floor_lets_a_tier_with_only_stale_shards_delete_them() -> None:
    """A replaced node back as a spare holds on its SSD only the shards of the rank it had: none
    restorable any more (the other ranks' copies were retired) and fewer than ``keep`` valid ones
    here, so the tier's own rule keeps them; the job's floor (its own newest kept steps, on
    other nodes) deletes them. Valid ones stay: they are still a source to restore from."""
    assert job_floor({10: True, 20: True, 30: True, 40: False}, keep=3) == 10
    assert job_floor({10: True, 20: True, 30: False}, keep=3) is None, "fewer than keep restorable"
    stale = {1: True, 2: True, 3: True}
    assert retention(stale, {1: False, 2: False}, keep=3) == [], "alone, the tier keeps what it cannot judge"
    deleted = {d.step: d.reason for d in retention(stale, {1: False, 2: False, 3: True}, keep=3, floor=10)}
    assert set(deleted) == {1, 2} and deleted[1] == "invalid and older than the job's kept step 10"
    assert [d.step for d in retention({5: True, 50: True}, {}, keep=3, floor=10)] == [5], \
        "unknown to the catalog and older than the floor: garbage; newer: maybe in progress"


def committed(step: int, world: int, crc: str = "0a0b0c0d") -> CheckpointRecord:
    record = None
    for rank in range(world):
        record, _ = commit_shard(record, manifest(step=step, rank=rank, world=world, crc=crc), "ssd", f"n{rank}", 1.0)
    assert record is not None
    return record


def test_a_step_of_another_world_size_is_skipped_by_a_restore_of_this_size() -> None:
    recs = [committed(10, 2), committed(20, 1), committed(30, 2), committed(40, 1), committed(50, 1)]
    target, why = restore_target(recs, world_size=2)
    assert target is not None and target.step == 30
    assert why == "newest valid step 30; skipped step 40 (world size 1), step 50 (world size 1)"
    target, why = restore_target([committed(20, 1)], world_size=2)
    assert target is not None and target.step == 20 and "no restorable step was saved with world size 2" in why
    assert restore_target(recs)[0].step == 50  # type: ignore[union-attr]


def test_the_last_restorable_step_is_never_invalidated() -> None:
    a, b = committed(10, 1), committed(20, 1)
    assert invalidation_loses_last([a, b], 20) == "" and invalidation_loses_last([a, b], 10) == ""
    assert "last restorable" in invalidation_loses_last([a], 10)
    corrupt = drop_copy(a, 0, "ssd", "n0", corrupt="crc mismatch")
    assert not corrupt.restorable and invalidation_loses_last([corrupt], 10) == ""


def test_retention_counts_restorable_steps_not_merely_valid_ones() -> None:
    recs = [committed(s, 1) for s in (10, 20, 30, 40)]
    recs[3] = drop_copy(recs[3], 0, "ssd", "n0", corrupt="bit rot")  # 40: valid, but no good copy
    on_tier = {r.step: True for r in recs}
    assert [d.step for d in retention(on_tier, {r.step: r.valid for r in recs}, keep=3)] == [10]
    assert retention(on_tier, restorable_steps(recs), keep=3) == [], "10 is one of the 3 restorable steps"


def test_codec_roundtrip_and_corrupt_keys_are_reported_not_fatal() -> None:
    rec, _ = commit_shard(None, manifest(rank=0), "ssd", "n0", 1.0)
    rec, _ = commit_shard(rec, manifest(rank=1), "s3", "s3", 2.0)
    kv = encode(rec) | encode_rollback(Rollback("job1", 100, 3.0))
    records, rollbacks, problems = decode_all(kv)
    assert records[("job1", 100)] == rec and rollbacks["job1"].step == 100 and problems == []
    kv["ckpt/job1/000000000100/rank-00001"] = b"garbage"
    records, _, problems = decode_all(kv)
    assert problems and "rank-00001" in problems[0]
    assert not records[("job1", 100)].valid and "corrupt" in records[("job1", 100)].invalid_reason


def test_a_copy_is_named_one_way_everywhere() -> None:
    ssd = CopyRef("ssd", "node-1")
    assert ssd.key == str(ssd) == f"{ssd}" == "ssd@node-1"
    assert ssd == ("ssd", "node-1")  # still the (tier, location) pair that records and RPCs carry
    record, _ = commit_shard(None, manifest(rank=0, world=1), "ssd", "node-1", 1.0)
    record = add_copy(record, 0, "hdd", "shared")
    record = drop_copy(record, 0, "ssd", "node-1", corrupt="crc32c mismatch")
    shard = record.shards[0]
    assert dict(shard.bad) == {"ssd@node-1": "crc32c mismatch"}
    assert not shard.has_good_copy(ssd) and shard.has_good_copy(CopyRef("hdd", "shared"))
    assert shard.good_copies() == [CopyRef("hdd", "shared")]
    healed = add_copy(record, 0, "ssd", "node-1")  # a fresh copy heals the bad one
    assert healed.shards[0].has_good_copy(ssd) and not healed.shards[0].bad


def test_the_grpc_form_reads_back_into_the_same_record() -> None:
    in_progress, _ = commit_shard(None, manifest(rank=1), "ssd", "node-2", 1.0)
    valid, _ = commit_shard(in_progress, manifest(rank=0), "ssd", "node-1", 2.0)
    valid = drop_copy(add_copy(valid, 0, "s3", "s3"), 1, "ssd", "node-2", corrupt="bit flip")
    invalid = replace(valid, invalid_reason="rank 1: no tier holds a verified copy")
    for record in (in_progress, valid, invalid):
        back = from_info(to_info(record))
        committed_at_dropped = {r: replace(s, committed_unix_s=0.0) for r, s in record.shards.items()}
        assert back == replace(record, shards=committed_at_dropped)  # the wire form has no commit times
        assert (back.valid, back.invalid_reason) == (record.valid, record.invalid_reason)
    assert [from_info(to_info(r)).status() for r in (in_progress, valid, invalid)] == [
        "in progress: 1 of 2 shards committed", "unrestorable: every copy of rank(s) 1 was found corrupt",
        "invalid: rank 1: no tier holds a verified copy"]
