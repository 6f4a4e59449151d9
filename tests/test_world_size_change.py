"""A world-size change is resharding, never corruption; reports say what the new world restored.

Pure rules, no I/O: the catalog's restore target across world sizes and formats, ``unrestorable``
only when a copy was proven corrupt (not when memory copies were pruned), a corrupt copy on a
shared tier never offered again (and never re-recorded present by the tiering), the abandoned
timeline bounded by the step the new world restored, the job's ``on_no_spare`` in the rendezvous,
and the drill's verdict on what the new world resumed from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_tiering import FakeCatalog, FakeClock, MemoryBackend, save_shard

from ftd.agent.tiering import Tiering
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, commit_shard, drop_copy, prune_memory
from ftd.checkpoints.layout import FileEntry, ShardManifest, shard_prefix
from ftd.coordinator import rendezvous as rdzv
from ftd.ftctl.drill import lost_steps, restored_since, verdict
from ftd.storage_backends.tiers import LocalSpec, Tier, TierSpec
from ftd.training.restore import order_copies
from ftd.v1 import cluster_pb2

JOB = "job"


def manifest(step: int, rank: int, world: int, fmt: str = "dcp", epoch: int = 1) -> ShardManifest:
    return ShardManifest(JOB, step, epoch, rank, world, fmt, (FileEntry(".metadata", 10, "0a0b0c0d"),), 1.0)


def committed(step: int, world: int, fmt: str = "dcp", epoch: int = 1, tier: str = "ssd",
              nodes: tuple[str, ...] = ("a", "b")) -> CheckpointRecord:
    record = None
    for rank in range(world):
        record, _ = commit_shard(record, manifest(step, rank, world, fmt, epoch), tier,
                                 nodes[rank * len(nodes) // world], 1.0)
    assert record is not None
    return record


# ---- the restore target across world sizes ----------------------------------------------------------


def test_a_dcp_job_of_another_size_restores_the_newest_step_resharded() -> None:
    recs = [committed(5, 2), committed(9, 4)]  # step 9 saved by 4 ranks; the world now has 2
    target, why = rules.restore_target(recs, world_size=2, fmt="dcp")
    assert target is not None and target.step == 9
    assert why == "newest valid step 9; saved with world size 4: resharded to 2"
    # A torch-format job cannot reshard: the newest step of its own size, the other one named.
    torch_recs = [committed(5, 2, "torch"), committed(9, 4, "torch")]
    target, why = rules.restore_target(torch_recs, world_size=2, fmt="torch")
    assert target is not None and target.step == 5 and "skipped step 9 (world size 4)" in why
    # Nothing of its size: the newest is answered with why this job cannot load it (it refuses it by name).
    target, why = rules.restore_target([committed(9, 4, "torch")], world_size=2, fmt="torch")
    assert target is not None and target.step == 9 and "restorable only by a replicated state" in why
    # Replicated (data parallel) state reads one rank's copy, of any world size.
    target, why = rules.restore_target(torch_recs, world_size=2, replicated=True)
    assert target is not None and target.step == 9 and "read as replicated state" in why
    # A grown world reshards too.
    target, why = rules.restore_target([committed(9, 2)], world_size=4, fmt="dcp")
    assert target is not None and "resharded to 4" in why
    assert rules.loadable(committed(9, 4), 2, "dcp") and not rules.loadable(committed(9, 4, "torch"), 2, "dcp")


def test_a_resharded_restore_needs_every_old_rank_reachable() -> None:
    # Old ranks 2 and 3 lived only in node b's memory: b is dead, so step 9 is out of reach; step 5
    # (on the shared HDD) is the target.
    in_memory = committed(9, 4, tier="mem")
    shared = committed(5, 4, tier="hdd", nodes=("shared",))
    target, why = rules.restore_target([shared, in_memory], world_size=2, unreachable={"b"}, fmt="dcp")
    assert target is not None and target.step == 5 and "skipped step(s) 9" in why


# ---- unrestorable only when proven corrupt ----------------------------------------------------------------


def test_pruned_memory_copies_are_no_corruption() -> None:
    step5 = committed(5, 2, tier="mem")
    step6, step7 = committed(6, 2, tier="mem"), committed(7, 2, tier="mem")
    # Node b's memory holds rank 1's newest two snapshots: recording step 7 drops step 5's copy there.
    changed, removed = prune_memory([step5, step6, step7], 1, "b")
    assert removed == [] and [r.step for r in changed] == [5]
    pruned = changed[0]
    assert not pruned.restorable
    assert pruned.status() == ("no copy left: no copy of rank(s) 1 is left (memory snapshots superseded or copies "
                               "deleted)")
    info = rules.to_info(pruned)
    assert not info.status.startswith(rules.UNRESTORABLE) and rules.from_info(info).invalid_reason == ""
    corrupt = drop_copy(step6, 1, "mem", "b", corrupt="crc32c mismatch")
    assert corrupt.status() == "unrestorable: every copy of rank(s) 1 was found corrupt"


def test_a_copy_proven_corrupt_on_a_shared_tier_is_never_offered() -> None:
    record = committed(5, 1, tier="hdd", nodes=("shared",))
    record, _ = commit_shard(record, manifest(5, 0, 1), "ssd", "a", 2.0)
    bad = drop_copy(record, 0, "hdd", "shared", corrupt="crc32c 1 != 2")
    assert [str(c) for c, _ in order_copies(bad.shards[0], [])] == ["ssd@a"]
    assert rules.restorable_steps([bad]) == {5: True}  # ssd@a is still good
    only_hdd = drop_copy(committed(6, 1, tier="hdd", nodes=("shared",)), 0, "hdd", "shared", corrupt="crc")
    assert rules.restore_target([only_hdd])[0] is None and rules.restorable_steps([only_hdd]) == {6: False}


def test_the_tiering_replaces_a_copy_recorded_corrupt_instead_of_recording_it_present(tmp_path: Path) -> None:
    ssd, hdd = MemoryBackend("ssd", tmp_path), MemoryBackend("hdd", tmp_path)
    tiers = [Tier(TierSpec("ssd", "node-a", LocalSpec(tmp_path)), ssd),  # type: ignore[arg-type]
             Tier(TierSpec("hdd", "shared", LocalSpec(tmp_path)), hdd)]  # type: ignore[arg-type]
    catalog, clock = FakeCatalog(), FakeClock()
    save_shard(ssd, catalog, 1, size=1000)
    tiering = Tiering(tiers, catalog, keep=3, clock=clock, sleep=clock.sleep)
    tiering.pass_once()
    key = f"{shard_prefix('job', 1, 0)}/state.pt"
    good = hdd.objects[key]
    hdd.objects[key] = b"\x00" + good[1:]  # rots at rest; a restore proves it and records it corrupt
    catalog.records[("job", 1)] = drop_copy(catalog.records[("job", 1)], 0, "hdd", "shared", corrupt="crc32c")
    catalog.copies.clear()
    tiering.pass_once()
    assert hdd.objects[key] == good, "the corrupt folder was replaced by a fresh, verified copy"
    assert catalog.records[("job", 1)].shards[0].has_good_copy(CopyRef("hdd", "shared"))
    assert ("hdd@shared", True) in [(w, present) for _, w, present, _ in catalog.copies]


# ---- the abandoned timeline --------------------------------------------------------------------------------


def test_only_steps_newer_than_the_restored_one_are_abandoned() -> None:
    old = [committed(s, 4, epoch=1) for s in (0, 9, 10, 11)]
    first = manifest(10, 0, 2, epoch=2)  # the shrunk world restored step 9 and saves step 10
    assert [r.step for r in rules.superseded_by(old, first, restored_step=9)] == [10, 11]
    # It restored nothing (started from scratch) and saves step 0: every older step goes, as before.
    assert [r.step for r in rules.superseded_by(old, manifest(0, 0, 2, epoch=2), restored_step=-1)] == [0, 9, 10, 11]
    # Whatever step it saves, the step it restored and older stay.
    assert [r.step for r in rules.superseded_by(old, manifest(3, 0, 2, epoch=2), restored_step=9)] == [10, 11]
    # An older training side that does not say: the steps at or after the saved one (the old rule).
    assert [r.step for r in rules.superseded_by(old, manifest(9, 0, 2, epoch=2))] == [9, 10, 11]
    assert rules.superseded_by(old, manifest(12, 0, 4, epoch=1), restored_step=9) == [], "same epoch: nothing"


def test_a_new_round_in_the_same_epoch_abandons_the_older_rounds_steps() -> None:
    """A worker restart forms round 3 in epoch 1: its timeline abandons what rounds 1 and 2 committed
    after the step it restored, not what round 3 itself committed, nor records of an unknown round."""
    def in_round(step: int, round_: int) -> CheckpointRecord:
        record, _ = commit_shard(None, manifest(step, 0, 2), "ssd", "a", 1.0, round_=round_)
        return record

    old = [in_round(20, 1), in_round(25, 2), in_round(30, 3), replace(in_round(35, 1), round=-1)]
    assert [r.step for r in rules.superseded_by(old, manifest(25, 1, 2), restored_step=20, round_=3)] == [25]
    assert rules.superseded_by(old, manifest(25, 1, 2), restored_step=20) == [], "no round said: as before"
    # The round is kept with the record and refused when older than the step's.
    assert old[1].round == 2 and rules.decode_all(rules.encode(old[1]))[0][(JOB, 25)].round == 2
    with pytest.raises(rules.CatalogError, match="first committed in round 2; rank 1 saves in round 1"):
        commit_shard(old[1], manifest(25, 1, 2), "ssd", "b", 2.0, round_=1)


# ---- on_no_spare in the rendezvous ------------------------------------------------------------------------


def test_a_wait_job_does_not_run_on_a_world_below_its_target() -> None:
    state, reply = rdzv.join(1.0, None, "j", 1, ["a", "b"], "a", -1, 1, 10, on_no_spare="wait", target_size=2)
    assert reply.status == rdzv.READY and state.on_no_spare == "wait"
    # b died, no spare: the world is [a] of a target of 2.
    waiting, reply = rdzv.join(2.0, state, "j", 2, ["a"], "a", state.round, 1, 10, target_size=2)
    assert reply.status == rdzv.WAIT and "on_no_spare=wait" in reply.message and "1 of its 2 node(s)" in reply.message
    assert waiting.waiting == reply.message and waiting.round == state.round, "no round formed, no restart counted"
    again, _ = rdzv.join(3.0, waiting, "j", 2, ["a"], "a", state.round, 1, 10, target_size=2)
    assert again == waiting, "said once: the state (and its event) does not change while it waits"
    # A spare filled the rank: the round forms and the wait is over.
    back, reply = rdzv.join(4.0, waiting, "j", 3, ["a", "c"], "a", state.round, 1, 10, target_size=2)
    assert reply.status == rdzv.READY and back.waiting == "" and back.round == state.round + 1
    # The same loss for a shrink job: the smaller world forms a round at once.
    shrink, _ = rdzv.join(1.0, None, "k", 1, ["a", "b"], "a", -1, 1, 10, target_size=2)
    shrunk, reply = rdzv.join(2.0, shrink, "k", 2, ["a"], "a", shrink.round, 1, 10, target_size=2)
    assert reply.status == rdzv.READY and reply.world_size == 1 and shrunk.on_no_spare == "shrink"
    with pytest.raises(ValueError, match="shrink, wait"):
        rdzv.check_on_no_spare("grow")


def test_a_job_record_of_a_newer_leader_still_decodes() -> None:
    state = rdzv.JobState("j", on_no_spare="wait")
    raw = rdzv.encode(state).replace(b'{"closed"', b'{"a_later_field": 1, "closed"')
    assert rdzv.decode(raw) == state


# ---- what the drill reports -------------------------------------------------------------------------------


def test_the_drill_fails_a_job_that_restarted_older_than_the_target_or_from_scratch() -> None:
    args = ("node", 1.0, 3.0, True, None, 1, 2, 0, True, 10.0, 60.0)
    ok, why = verdict(*args, restore_target=9, resumed_step=9)
    assert ok and "resumed from step 9" in why
    ok, why = verdict(*args, restore_target=9, resumed_step=-1)
    assert not ok and "from scratch although step 9 was restorable" in why
    ok, why = verdict(*args, restore_target=9, resumed_step=5)
    assert not ok and "from step 5, older than the restore target step 9" in why
    assert verdict(*args, restore_target=-1, resumed_step=-1)[0], "nothing was restorable: a fresh start is right"
    assert verdict(*args, restore_target=9, resumed_step=11)[0], "a newer snapshot committed since is fine"
    assert lost_steps(11, 9) == 2 and lost_steps(8, 9) == 0 and lost_steps(8, -1) == 9 and lost_steps(None, 3) is None


def test_the_new_worlds_restore_is_told_apart_from_an_older_one() -> None:
    progress = cluster_pb2.Progress(step=12, restored=cluster_pb2.Restored(step=9, epoch=2, at_unix_s=100.0))
    assert restored_since(progress, 99.0) is not None
    assert restored_since(progress, 101.0) is None, "reported before the round began: the old world's"
    assert restored_since(progress, 101.0, epoch_after=2) is not None, "a lagging clock, but the new epoch"
    assert restored_since(cluster_pb2.Progress(step=3), 0.0) is None
