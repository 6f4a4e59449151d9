"""The catalog's authorization bound to the job's state (coordinator/shard_rules.py), as pure rules."""

from __future__ import annotations

from ftd.checkpoints import catalog as ckpt
from ftd.checkpoints.layout import FileEntry
from ftd.coordinator import shard_rules as rules
from ftd.coordinator.rendezvous import JobState

JOB = JobState("train", round=3, epoch=7, members=("node-0", "node-1"))


def record(step: int, ranks: dict[int, set[tuple[str, str]]], world_size: int = 4) -> ckpt.CheckpointRecord:
    files = (FileEntry("a.pt", 1, "00000000"),)
    shards = {r: ckpt.ShardRecord(r, 1, f"c{r}", files, frozenset(ckpt.CopyRef(t, loc) for t, loc in copies))
              for r, copies in ranks.items()}
    return ckpt.CheckpointRecord("train", step, 7, world_size, "dcp", 0.0, shards)


def no_buddy(node: str) -> str | None:
    return None


def test_holder_numbers_ranks_node_by_node() -> None:
    assert [rules.holder(JOB, 4, r) for r in range(4)] == ["node-0", "node-0", "node-1", "node-1"]
    assert [rules.holder(JOB, 2, r) for r in range(2)] == ["node-0", "node-1"]
    assert rules.holder(JOB, 3, 0) is None  # 3 ranks do not fit 2 nodes
    assert rules.holder(JOB, 4, 4) is None
    assert rules.holder(JobState("train"), 4, 0) is None


def test_a_node_commits_only_the_ranks_it_holds_at_the_jobs_epoch() -> None:
    assert rules.may_commit("node-1", JOB, "train", 10, 7, 2, 4, None).allowed
    other = rules.may_commit("node-1", JOB, "train", 10, 7, 0, 4, None)
    assert not other.allowed and other.rule == "shard_holder" and "rank 0 is held by node-0" in other.reason
    future = rules.may_commit("node-1", JOB, "train", 0, 10**18, 2, 4, None)
    assert not future.allowed and future.rule == "job_epoch" and "at epoch 7" in future.reason
    past = rules.may_commit("node-1", JOB, "train", 10, 6, 2, 4, None)
    assert not past.allowed and past.rule == "job_epoch"
    unknown = rules.may_commit("node-1", None, "junk-17", 10, 7, 0, 1, None)
    assert not unknown.allowed and "job junk-17 has no round" in unknown.reason
    misfit = rules.may_commit("node-1", JOB, "train", 10, 7, 2, 3, None)
    assert not misfit.allowed and "does not fit round 3" in misfit.reason


def test_steps_are_bounded_by_the_progress_plus_the_slack() -> None:
    limit = rules.progress_limit([120, -1], [100], 1000)
    assert limit == 1120
    assert rules.may_commit("node-0", JOB, "train", 1120, 7, 0, 4, limit).allowed
    far = rules.may_commit("node-0", JOB, "train", 999_999_999_999, 7, 0, 4, limit)
    assert not far.allowed and far.rule == "step_progress" and "step 1120 at most" in far.reason
    assert rules.progress_limit([-1], [], 1000) is None  # nothing known: no bound (the holder rule still holds)
    assert rules.progress_limit([], [5], 10) == 15


def test_copies_are_recorded_by_the_holder_its_buddy_or_a_node_holding_one() -> None:
    rec = record(10, {0: {("ssd", "node-0")}, 2: {("ssd", "node-1")}})

    def buddy(node: str) -> str | None:
        return {"node-0": "node-1", "node-1": "node-2"}.get(node)

    # the holder moves its own bytes up; the buddy mirrors the holder's memory snapshot
    assert rules.may_record("node-0", JOB, rec, 0, "hdd", "shared", True, False, buddy, None).allowed
    assert rules.may_record("node-1", JOB, rec, 0, "mem", "node-1", True, False, buddy, None).allowed
    assert rules.may_record("node-2", JOB, rec, 2, "mem", "node-2", True, False, buddy, None).allowed
    # a node that is none of these may not claim a copy, nor call a shared one corrupt
    stranger = rules.may_record("node-2", JOB, rec, 0, "mem", "node-2", True, False, buddy, None)
    assert not stranger.allowed and stranger.rule == "copy_owner" and "held by node-0" in stranger.reason
    assert not rules.may_record("node-2", JOB, rec, 0, "hdd", "shared", True, True, buddy, None).allowed
    # the buddy mirrors; it does not judge the shared copies of a rank it does not hold
    assert not rules.may_record("node-1", JOB, rec, 0, "hdd", "shared", True, True, buddy, None).allowed
    assert not rules.may_record("node-1", JOB, rec, 0, "ssd", "node-1", True, False, buddy, None).allowed
    # a node that holds a copy (a rank it held before a world change) moves it up
    moved = record(10, {0: {("ssd", "node-5")}})
    assert rules.may_record("node-5", JOB, moved, 0, "s3", "s3", True, False, no_buddy, None).allowed
    # its own copies a node drops or calls corrupt freely
    assert rules.may_record("node-2", JOB, rec, 0, "mem", "node-2", False, False, no_buddy, None).allowed
    assert rules.may_record("node-2", None, rec, 0, "ssd", "node-2", True, True, no_buddy, None).allowed


def test_the_last_shared_copy_of_the_restore_target_is_never_dropped() -> None:
    newest = record(20, {0: {("hdd", "shared"), ("ssd", "node-0")}, 2: {("hdd", "shared")}})
    older = record(10, {0: {("hdd", "shared")}, 2: {("hdd", "shared")}})
    last = rules.may_record("node-1", JOB, newest, 2, "hdd", "shared", False, False, no_buddy, newest)
    assert not last.allowed and last.rule == "keep_restore_target" and "step 20" in last.reason
    # another good copy remains: allowed; an older step: retention's business
    assert rules.may_record("node-0", JOB, newest, 0, "hdd", "shared", False, False, no_buddy, newest).allowed
    assert rules.may_record("node-1", JOB, older, 2, "hdd", "shared", False, False, no_buddy, newest).allowed


def test_a_job_with_no_round_is_refused_unless_the_fleet_is_trusted() -> None:
    trusted = rules.Unmanaged(world_epoch=7, caller_registered=True)
    assert rules.may_commit("node-1", None, "solo", 10, 7, 0, 1, None, trusted).allowed
    wipe = rules.may_commit("node-1", None, "solo", 0, 10**18, 0, 1, None, trusted)
    assert not wipe.allowed and wipe.rule == "job_epoch" and "world is at epoch 7" in wipe.reason
    stranger = rules.may_commit("node-x", None, "solo", 10, 7, 0, 1, None, rules.Unmanaged(7, False))
    assert not stranger.allowed and "not registered" in stranger.reason
    # its copies: the committer's buddy mirrors its memory copy; on a trusted fleet any node records its own
    solo = record(10, {0: {("mem", "node-0")}}, world_size=1)
    assert rules.may_record("node-1", None, solo, 0, "mem", "node-1", True, False, {"node-0": "node-1"}.get,
                            None).allowed
    assert not rules.may_record("node-2", None, solo, 0, "mem", "node-2", True, False, no_buddy, None).allowed
    assert rules.may_record("node-2", None, solo, 0, "mem", "node-2", True, False, no_buddy, None, True).allowed
