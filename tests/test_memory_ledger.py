"""Memory snapshots as soft state in the leader (coordinator/memory_ledger.py): the cheap checks per
reported snapshot, the commit-time rules applied when records are merged, the readiness of a new
leader, and the catalog's answers built from them (in process, on the controller harness's fake clock)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from controller_harness import Clock, cluster, make, run, step
from test_memory_tier import JOB as TIER_JOB
from test_memory_tier import mem_tier, publish, store

from ftd.agent.errors import AgentError
from ftd.agent.memory_report import FILE, MemoryInventory, manifest_proto
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.coordinator import errors, merge_cache
from ftd.coordinator import memory_ledger as ledger
from ftd.coordinator.store import MemoryStore
from ftd.v1 import checkpoint_pb2, coordinator_pb2

JOB = "llm"


def man(step: int, rank: int, world: int = 2, epoch: int = 1, crc: str = "0a0b0c0d") -> ShardManifest:
    return ShardManifest(JOB, step, epoch, rank, world, "torch", (FileEntry("state.pt", 100, crc),), 50.0 + step)


def snap(step: int, rank: int, world: int = 2, epoch: int = 1, crc: str = "0a0b0c0d", owner: str = "",
         restored: int | None = None, round_: int | None = None) -> coordinator_pb2.MemorySnapshot:
    m = coordinator_pb2.MemorySnapshot(manifest=manifest_proto(man(step, rank, world, epoch, crc)),
                                       replica=bool(owner), owner=owner)
    if restored is not None:
        m.restored_step = restored
    if round_ is not None:
        m.job_round = round_
    return m


def report(*snaps: coordinator_pb2.MemorySnapshot, version: int = 1) -> coordinator_pb2.MemoryReport:
    return coordinator_pb2.MemoryReport(snapshots=list(snaps), version=version)


def taken(node: str, m: coordinator_pb2.MemorySnapshot) -> ledger.Snap:
    got = ledger.parse(node, m, {})
    assert isinstance(got, ledger.Snap), got
    return got


def pair(step: int, **kw: object) -> list[ledger.Snap]:
    """Step ``step`` of a 2-rank world: a holds rank 0 and b's replica, b rank 1 and a's replica."""
    return [taken("a", snap(step, 0, **kw)), taken("a", snap(step, 1, owner="b", **kw)),  # type: ignore[arg-type]
            taken("b", snap(step, 1, **kw)), taken("b", snap(step, 0, owner="a", **kw))]  # type: ignore[arg-type]


# ---- the cheap checks ----------------------------------------------------------------------------------------


def test_a_reported_snapshot_is_taken_as_its_shard_with_the_manifests_checksum() -> None:
    s = taken("a", snap(7, 1, owner="b", restored=3, round_=2))
    assert (s.node, s.writer, s.replica, s.step, s.rank, s.restored, s.round) == ("a", "b", True, 7, 1, 3, 2)
    assert s.checksum == man(7, 1).checksum and s.bytes == 100


@pytest.mark.parametrize("bad, why", [
    (snap(1, 2, world=2), "out of range"),
    (snap(1, 0, owner="a"), "names its owner"),
    (coordinator_pb2.MemorySnapshot(replica=True, manifest=manifest_proto(man(1, 0))), "names its owner"),
    (coordinator_pb2.MemorySnapshot(manifest=checkpoint_pb2.ShardManifest(job="../x", world_size=1)), "job"),
    (coordinator_pb2.MemorySnapshot(manifest=checkpoint_pb2.ShardManifest(job="j", world_size=1, format="pickle")),
     "format"),
    (coordinator_pb2.MemorySnapshot(manifest=checkpoint_pb2.ShardManifest(job="j", world_size=1, format="torch")),
     "0 files"),
])
def test_cheap_checks_refuse_what_no_node_could_hold(bad: coordinator_pb2.MemorySnapshot, why: str) -> None:
    got = ledger.parse("a", bad, {})
    assert isinstance(got, str) and why in got


def test_a_manifests_wire_form_is_sliced_from_its_snapshots_as_it_serializes_itself() -> None:
    names = ["x" * n for n in (1, 60, 200, 20_000)]  # manifests under and over 128 bytes (a 1- and 2-byte length)
    for i, name in enumerate(names):
        m = snap(3, 1, owner="b" if i % 2 else "", restored=2)
        m.manifest.files[0].name = name
        raw = m.SerializeToString(deterministic=True)
        assert ledger.manifest_bytes(raw) == m.manifest.SerializeToString(deterministic=True)
    no_manifest = coordinator_pb2.MemorySnapshot(owner="b", replica=True).SerializeToString(deterministic=True)
    assert ledger.manifest_bytes(no_manifest) is None and ledger.manifest_bytes(b"") is None
    assert ledger.manifest_bytes(b"\x0a\x05abc") is None  # cut short: not sliced past the end
    cache = ledger.ManifestCache()
    sliced = snap(4, 0)
    got = ledger.parse("a", sliced, {}, cache, sliced.SerializeToString(deterministic=True))
    assert isinstance(got, ledger.Snap) and got == taken("a", sliced)
    assert list(cache.new) == [sliced.manifest.SerializeToString(deterministic=True)]


def test_an_own_rank_is_taken_only_from_the_node_holding_it_in_that_round() -> None:
    rounds = {(JOB, 4): ("a", "b")}  # 2 ranks, one per node: rank 1 is b's in round 4
    refused = ledger.parse("a", snap(9, 1, round_=4), rounds)
    assert isinstance(refused, str) and "held by b in round 4" in refused
    assert isinstance(ledger.parse("b", snap(9, 1, round_=4), rounds), ledger.Snap)
    assert isinstance(ledger.parse("a", snap(9, 1, round_=3), rounds), ledger.Snap)  # a round not seen: not judged


def test_a_late_report_of_the_same_agent_is_ignored_a_new_incarnations_replaces() -> None:
    book = ledger.MemoryLedger()
    assert book.take("a", "i1", report(snap(5, 0), version=3)) == 1
    assert book.take("a", "i1", report(snap(4, 0), version=2)) == 0  # older: out of order
    assert [s.step for s in book.snapshots(JOB)] == [5]
    assert book.take("a", "i2", report(snap(1, 0), version=1)) == 1  # restarted agent: counts from 1 again
    assert [s.step for s in book.snapshots(JOB)] == [1]
    book.take("b", "i1", report(snap(1, 0, owner="x"), snap(1, 1, world=1)))
    assert book.refused == 1 and {s.node for s in book.snapshots(JOB)} == {"a", "b"}


def test_the_holders_of_a_rank_follow_the_reports() -> None:
    """Above the inline bound a node is told the addresses of the nodes holding its rank (buddies.py)."""
    book = ledger.MemoryLedger()
    book.take("a", "i1", report(snap(5, 0), snap(5, 1, owner="b"), snap(6, 1, owner="b")))
    book.take("b", "i1", report(snap(5, 1), snap(5, 0, owner="a")))
    assert book.holders(JOB, 1) == {"a", "b"} and book.holders(JOB, 0) == {"a", "b"}
    book.take("a", "i1", report(snap(6, 0), version=2))  # a no longer holds b's replicas
    assert book.holders(JOB, 1) == {"b"} and book.holders(JOB, 0) == {"a", "b"}
    book.forget_node("b")
    assert book.holders(JOB, 1) == set() and book.holders(JOB, 0) == {"a"}


def test_holders_are_touched_only_where_a_report_changes_them_and_a_node_gone_and_back_holds_again() -> None:
    book = ledger.MemoryLedger()
    book.take("a", "i1", report(snap(5, 0), snap(5, 1, owner="b")))
    book.take("a", "i1", report(snap(6, 0), snap(6, 1, owner="b"), version=2))  # same ranks, a newer step
    assert book.holders(JOB, 0) == {"a"} and book.holders(JOB, 1) == {"a"}
    book._rehold("a", ())  # what gone() does for a dead or fenced node: its report stays, copyless
    assert book.holders(JOB, 0) == set()
    book.take("a", "i2", report(snap(7, 0), snap(7, 1, owner="b")))  # alive again (a new incarnation)
    assert book.holders(JOB, 0) == {"a"} and book.holders(JOB, 1) == {"a"}


def test_a_manifest_is_checked_once_for_its_owner_and_its_buddys_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner's snapshot and the buddy's replica carry the same manifest bytes: one parse serves both."""
    calls: list[int] = []
    check = ledger.check_manifest
    monkeypatch.setattr(ledger, "check_manifest", lambda m: calls.append(m.step) or check(m))
    book = ledger.MemoryLedger()
    book.take("a", "i1", report(snap(5, 0), snap(5, 1, owner="b")))
    book.take("b", "i1", report(snap(5, 1), snap(5, 0, owner="a")))
    assert sorted(calls) == [5, 5]  # two manifests (rank 0 and 1), each checked once
    a0, b0 = (next(s for s in book.snapshots(JOB) if s.node == n and s.rank == 0) for n in ("a", "b"))
    assert (a0.writer, a0.replica, b0.writer, b0.replica) == ("a", False, "a", True)
    assert a0.files is b0.files and a0.checksum == b0.checksum
    bad = snap(5, 0, crc="zz")
    assert isinstance(book.manifests.check(bad), str)  # a refusal is remembered too, as a reason


def test_the_manifest_cache_is_bounded_to_two_generations() -> None:
    cache = ledger.ManifestCache(size=3)
    manifests = [snap(step, 0) for step in range(1, 8)]
    for m in manifests:
        assert isinstance(cache.check(m), ledger.Manifest)
    assert len(cache.new) + len(cache.old) <= 6 and len(cache.new) <= 3
    assert cache.check(manifests[-1]) is cache.check(manifests[-1])


# ---- merge: the commit-time rules at read time ------------------------------------------------------------------


def test_a_memory_only_step_is_valid_and_in_memory_once_every_rank_and_replica_reported() -> None:
    [record] = ledger.merge([], pair(12))
    assert record.valid and record.on_tier("mem") and record.shards[1].writer == "b"
    assert record.shards[0].copies == {rules.CopyRef("mem", "a"), rules.CopyRef("mem", "b")}
    [half] = ledger.merge([], pair(12)[:2])  # a's copies only: valid, on one node's memory
    assert half.valid and not half.on_tier("mem")


def test_memory_copies_join_the_durable_record_and_a_copy_with_other_bytes_does_not_count() -> None:
    durable, _ = rules.commit_shard(None, man(12, 0), "ssd", "a", 1.0)
    durable, _ = rules.commit_shard(durable, man(12, 1), "ssd", "b", 1.0)
    forged = taken("b", snap(12, 0, owner="a", crc="deadbeef"))
    [record] = ledger.merge([durable], [*pair(12)[:3], forged])
    assert record.shards[0].copies == {rules.CopyRef("ssd", "a"), rules.CopyRef("mem", "a")}
    assert rules.CopyRef("mem", "b") in record.shards[1].copies and record.on_tier("ssd")
    # the replica alone (its owner's report gone with its node) still defines the rank
    [alone] = ledger.merge([], [taken("b", snap(12, 1)), taken("b", snap(12, 0, owner="a"))])
    assert alone.valid and alone.shards[0].writer == "a"


def test_an_abandoned_timelines_steps_are_not_restorable_memory_or_durable() -> None:
    old_durable, _ = rules.commit_shard(None, man(20, 0, world=1, epoch=1), "ssd", "a", 1.0)
    kept, _ = rules.commit_shard(None, man(10, 0, world=1, epoch=1), "ssd", "a", 1.0)
    old_mem = taken("a", snap(22, 0, world=1, epoch=1))
    new = taken("b", snap(12, 0, world=1, epoch=2, restored=10))  # the new world restored step 10
    records = ledger.merge([kept, old_durable], [old_mem, new])
    assert [r.step for r in records] == [10, 12]
    target, _ = rules.restore_target(records)
    assert target is not None and target.step == 12 and target.epoch == 2


def test_a_rollbacks_removed_steps_and_held_steps_count_no_memory_copy() -> None:
    rb = rules.Rollback(JOB, 10, at_unix_s=100.0, superseded=(11, 12))
    before = pair(12)  # created at 62 s: before the rollback
    assert ledger.merge([], before, rollback=rb) == []
    after = [s._replace(created=200.0) for s in before]  # saved again after it
    assert [r.step for r in ledger.merge([], after, rollback=rb)] == [12]
    assert ledger.merge([], after, held=lambda epoch, round_: 12) == []
    assert [r.step for r in ledger.merge([], after, held=lambda epoch, round_: 13)] == [12]


def test_after_a_step_anomaly_rollback_memory_snapshots_of_suspect_steps_saved_before_it_do_not_count() -> None:
    """The demo's NaN rollback: the ranks ran on past the bad step before the rollback; their memory
    snapshots of those steps have no etcd record to mark suspect, JobState.suspect_from covers them."""
    book = ledger.MemoryLedger()
    for saved in (9, 12):  # created at 59 and 62 s (a node keeps the newest two per rank)
        for s in pair(saved):
            book.add(s)

    def no_hold(epoch: int, round_: int | None) -> None:
        return None

    assert [r.step for r in book.records(JOB, [], None, no_hold)] == [9, 12]
    assert [r.step for r in book.records(JOB, [], None, no_hold, suspect=(10, 100.0))] == [9]
    assert [r.step for r in book.records(JOB, [], None, no_hold, suspect=(10, 60.0))] == [9, 12]  # 12: after it


def test_readiness_waits_for_every_alive_node_until_the_deadline() -> None:
    assert ledger.readiness(100.0, 99.0, 4.0, ["a", "b"], ["a"]) == ledger.Readiness(waiting=("b",), left_s=3.0)
    assert ledger.readiness(104.0, 99.0, 4.0, ["a", "b"], ["a"]) == ledger.Readiness(late=("b",))
    assert ledger.readiness(100.0, 99.0, 4.0, ["a", "b"], ["b", "a"]) == ledger.Readiness()


def test_the_restore_target_of_16000_ranks_is_built_in_well_under_a_second() -> None:
    """2,000 nodes x 8 ranks, each node's own ranks and its buddy's, two snapshots each: 64,000."""
    nodes, per, world = 2000, 8, 16000
    book = ledger.MemoryLedger()
    began = time.perf_counter()
    for n in range(nodes):
        buddy = (n + 1) % nodes
        snaps = [snap(s, n * per + r, world=world) for s in (40, 41) for r in range(per)]
        snaps += [snap(s, buddy * per + r, world=world, owner=f"n{buddy}") for s in (40, 41) for r in range(per)]
        book.take(f"n{n}", "i", report(*snaps))
    per_snapshot_us = (time.perf_counter() - began) / (nodes * 4 * per) * 1e6
    began = time.perf_counter()
    records = book.records(JOB, [], None, lambda e, r: None)
    target, _ = rules.restore_target(records, world_size=world)
    info = rules.to_info(target) if target is not None else None
    took = time.perf_counter() - began
    assert target is not None and target.step == 41 and target.on_tier("mem") and info is not None
    print(f"ingest {per_snapshot_us:.1f} us/snapshot (with building the test's protos); "
          f"restore target of {world} ranks {took:.2f}s")
    assert took < 2.0, f"restore target of {world} ranks took {took:.2f}s"


# ---- the catalog's answers on a leader (the controller harness) ------------------------------------------------


async def durable_step_10() -> tuple[Any, Clock]:
    """A leader (a, b active, s a spare) whose catalog holds step 10 on the two nodes' SSDs."""
    clock = Clock()
    ctl = make(MemoryStore(), clock)
    await cluster(ctl, clock)
    for rank, node in ((0, "a"), (1, "b")):
        await ctl.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
            manifest=manifest_proto(man(10, rank)), tier="ssd", location=node))
    return ctl, clock


def new_term(ctl: Any, clock: Clock) -> None:
    """A new term (as a standby taking over): nothing is known until the agents re-announce."""
    view = ctl.committer.require_leader()
    ctl.catalog.memory.new_term(clock(), view.nodes)
    for rt in view.runtime.values():
        rt.last_heartbeat = None


def test_a_new_leader_never_answers_an_older_step_because_a_report_is_missing() -> None:
    async def go() -> None:
        ctl, clock = await durable_step_10()
        cat = ctl.catalog
        cat.take_report("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
        first = cat.restore_target(JOB)
        assert first.checkpoint.step == 12 and first.checkpoint.on_tier["mem"]
        new_term(ctl, clock)
        with pytest.raises(errors.ReportsPending, match=r"3 node\(s\).*a, b, s"):
            cat.restore_target(JOB)
        cat.take_report("a", "i1", report(snap(12, 0)))  # a's replica of b went (say)
        ctl.committer.require_leader().runtime["s"].last_heartbeat = clock()  # a spare's heartbeat, no report
        with pytest.raises(errors.ReportsPending, match=r"1 node\(s\).*\(b\)") as pending:
            cat.restore_target(JOB)
        assert errors.grpc_code(pending.value).name == "UNAVAILABLE"
        clock.advance(cat.memory_deadline_s + 0.1)
        late = cat.restore_target(JOB)  # durable + what was reported: older, and it says why
        assert late.checkpoint.step == 10 and "memory copies of node(s) b are not counted" in late.reason
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
        assert cat.restore_target(JOB).checkpoint.step == 12
        listed = {i.step: i for i in cat.list(JOB)}
        assert set(listed) == {10, 12} and listed[12].valid and not listed[10].on_tier["mem"]

    run(go)


def test_a_late_node_coming_back_changes_the_answers_reason_without_choosing_the_target_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failover's deadline the late set shrinks with every node that comes back; while the merged
    records stay the same, only the answer's reason changes (16,000 ranks: no new choice per poll)."""
    async def go() -> None:
        ctl, clock = await durable_step_10()
        cat, view = ctl.catalog, ctl.committer.require_leader()
        new_term(ctl, clock)
        cat.take_report("a", "i1", report(snap(12, 0)))
        clock.advance(cat.memory_deadline_s + 0.1)
        choices: list[str] = []
        choose = rules.restore_target
        monkeypatch.setattr(rules, "restore_target", lambda *a, **k: choices.append(a[0]) or choose(*a, **k))
        first = cat.restore_target(JOB)
        assert first.checkpoint.step == 10 and "node(s) b, s are not counted" in first.reason, first.reason
        view.runtime["s"].last_heartbeat = clock()  # the spare is back (no report): only the late set changed
        second = cat.restore_target(JOB)
        assert "node(s) b are not counted" in second.reason and second.checkpoint == first.checkpoint
        assert len(choices) == 1, "the same records: the same choice"
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
        third = cat.restore_target(JOB)
        assert third.checkpoint.step == 12 and "not counted" not in third.reason and len(choices) == 2

    run(go)


def test_a_dead_nodes_memory_copies_do_not_count_but_its_shards_stay_defined() -> None:
    async def go() -> None:
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        await cluster(ctl, clock)
        cat = ctl.catalog
        cat.take_report("a", "i1", report(snap(12, 0), snap(13, 0)))
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a"), snap(13, 1)))
        assert cat.restore_target(JOB).checkpoint.step == 13
        await step(ctl, clock, beats=("b", "s"), n=60)  # a falls silent: declared dead
        target = cat.restore_target(JOB)
        assert target.checkpoint.step == 12, target.reason  # 13's rank 0 was only in a's memory
        assert {(c.tier, c.location) for c in target.checkpoint.shards[0].copies} == {("mem", "b")}
        # a's report stays as the definition of its shards, copyless: step 13 is complete (a replicated
        # restore reads it from rank 1, as it did when the commit was in etcd), rank 0 has no copy
        thirteen = next(c for c in cat.list(JOB) if c.step == 13)
        assert len(thirteen.shards) == 2 and not next(s for s in thirteen.shards if s.rank == 0).copies
        replicated = cat.restore_target(JOB, replicated=True)
        assert replicated.checkpoint.step == 13, replicated.reason

    run(go)


def test_an_expensive_merge_is_rebuilt_for_reports_at_a_bounded_rate_and_at_once_for_anything_else() -> None:
    """merge_due: a cheap merge is rebuilt on every change; an expensive one that only reports changed
    waits took / MERGE_SHARE, never more than MERGE_MAX_AGE_S."""
    assert ledger.merge_due(now=10.0, built_at=10.0, took_s=0.001)  # cheap: at once
    assert not ledger.merge_due(now=10.2, built_at=10.0, took_s=0.05)  # 50 ms: again after 0.5 s
    assert ledger.merge_due(now=10.5, built_at=10.0, took_s=0.05)
    assert not ledger.merge_due(now=10.9, built_at=10.0, took_s=0.4)
    assert ledger.merge_due(now=10.0 + ledger.MERGE_MAX_AGE_S, built_at=10.0, took_s=0.4)  # capped
    book = ledger.MemoryLedger()
    book.take("a", "i1", report(snap(12, 0)))
    assert (book.generation, book.settled) == (1, 0), "a report changes the snapshots, not what is settled"
    book.mark_bad(JOB, 12, 0, "a", "checksum")
    book.forget_node("a")
    assert (book.generation, book.settled) == (3, 2)


def test_the_catalog_coalesces_report_only_rebuilds_of_an_expensive_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        monkeypatch.setattr(ledger, "MERGE_FRESH_S", 0.0)  # every merge counts as expensive
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        await cluster(ctl, clock)
        cat = ctl.catalog
        cat.take_report("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
        assert cat.restore_target(JOB).checkpoint.step == 12
        cat.take_report("a", "i1", report(snap(13, 0), snap(13, 1, owner="b"), version=2))
        cat.take_report("b", "i1", report(snap(13, 1), snap(13, 0, owner="a"), version=2))
        assert cat.restore_target(JOB).checkpoint.step == 12, "reports only, just rebuilt: the same answer"
        clock.advance(ledger.MERGE_MAX_AGE_S)
        assert cat.restore_target(JOB).checkpoint.step == 13, "due again: the newer step"
        cat.take_report("a", "i1", report(snap(14, 0), snap(14, 1, owner="b"), version=3))
        cat.take_report("b", "i1", report(snap(14, 1), snap(14, 0, owner="a"), version=3))
        assert cat.restore_target(JOB).checkpoint.step == 13
        await cat.invalidate(checkpoint_pb2.InvalidateCheckpointRequest(job=JOB, step=13, reason="bad"))
        assert cat.restore_target(JOB).checkpoint.step == 14, "anything but a report rebuilds at once"

    run(go)


def test_an_expensive_merge_is_rebuilt_on_a_worker_thread_once_for_concurrent_askers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MergeCache.prepare: a restore target's expensive rebuild runs off the event loop (a 16,000-rank
    merge stopped a failover's loop for seconds), and the answer then comes from the cache."""
    async def go() -> None:
        monkeypatch.setattr(ledger, "MERGE_FRESH_S", 0.0)  # every merge counts as expensive
        monkeypatch.setattr(merge_cache, "OFFLOAD_S", 0.0)
        threads: list[int] = []
        real = ledger.merge

        def spy(*args: Any, **kwargs: Any) -> list[rules.CheckpointRecord]:
            threads.append(threading.get_ident())
            return real(*args, **kwargs)
        monkeypatch.setattr(ledger, "merge", spy)
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        await cluster(ctl, clock)
        cat = ctl.catalog
        cat.take_report("a", "i1", report(snap(12, 0), snap(12, 1, owner="b")))
        cat.take_report("b", "i1", report(snap(12, 1), snap(12, 0, owner="a")))
        await asyncio.gather(*(cat.prepare(JOB) for _ in range(5)))
        assert len(threads) == 1, "five askers at once: one rebuild"
        assert threads[0] != threading.get_ident(), "built on a worker thread, not the event loop's"
        assert cat.restore_target(JOB).checkpoint.step == 12 and len(threads) == 1, "then served from the cache"
        cat.take_report("a", "i1", report(snap(13, 0), snap(13, 1, owner="b"), version=2))
        cat.take_report("b", "i1", report(snap(13, 1), snap(13, 0, owner="a"), version=2))
        await cat.prepare(JOB)
        assert len(threads) == 1 and cat.restore_target(JOB).checkpoint.step == 12, "reports only: not due yet"
        clock.advance(ledger.MERGE_MAX_AGE_S)
        await cat.prepare(JOB)
        assert len(threads) == 2 and threads[1] != threading.get_ident()
        assert cat.restore_target(JOB).checkpoint.step == 13 and len(threads) == 2
        with pytest.raises(errors.InvalidArgument):
            await cat.prepare("no such/job")

    run(go)


def test_the_old_mem_rpcs_land_in_the_ledger_not_in_etcd() -> None:
    async def go() -> None:
        clock = Clock()
        store = MemoryStore()
        ctl = make(store, clock)
        await cluster(ctl, clock)
        def writes() -> float:
            return sum(s.value for m in ctl.metrics.registry.collect() if m.name == "ftd_coordinator_etcd_writes"
                       for s in m.samples if s.name.endswith("_total"))

        before = writes()
        assert before > 0  # the cluster's own commits are counted
        for rank, node in ((0, "a"), (1, "b")):
            got = await ctl.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
                manifest=manifest_proto(man(12, rank)), tier="mem", location=node))
            assert "not written to etcd" in got.message
        assert got.checkpoint.valid
        copy = await ctl.catalog.record_copy(checkpoint_pb2.RecordCopyRequest(
            job=JOB, step=12, rank=0, tier="mem", location="b", present=True))
        assert {(c.tier, c.location) for c in copy.checkpoint.shards[0].copies} == {("mem", "a"), ("mem", "b")}
        with pytest.raises(errors.CatalogConflict, match="other bytes"):
            await ctl.catalog.record_copy(checkpoint_pb2.RecordCopyRequest(
                job=JOB, step=12, rank=1, tier="mem", location="a", present=True, checksum="ffffffff"))
        assert writes() == before
        assert (JOB, 12) not in ctl.committer.require_leader().catalog
        await ctl.catalog.invalidate(checkpoint_pb2.InvalidateCheckpointRequest(job=JOB, step=12, reason="bad"))
        assert not ctl.catalog.restore_target(JOB).found

    run(go)


def test_memory_snapshots_in_etcd_keeps_the_old_path_for_measuring_it() -> None:
    async def go() -> None:
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        ctl.catalog.memory_in_etcd = True  # --memory-snapshots-in-etcd (bench/coordinator_scale.py's old path)
        await cluster(ctl, clock)
        got = await ctl.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
            manifest=manifest_proto(man(12, 0)), tier="mem", location="a"))
        assert "not written to etcd" not in got.message
        assert (JOB, 12) in ctl.committer.require_leader().catalog and not ctl.catalog.memory.singles

    run(go)


# ---- the agent's side: the inventory its heartbeat announces ----------------------------------------------------


def test_the_inventory_announces_what_the_memory_tier_holds_on_a_streams_first_message_and_on_changes(
        tmp_path: Path) -> None:
    tier = mem_tier(tmp_path / "mem", "a")
    inventory = MemoryInventory(store(tier), "a")
    assert inventory.take(first=True) == coordinator_pb2.MemoryReport()  # a stream's first message: always
    assert inventory.take(first=False) is None and not inventory.changed()
    written = publish(tier, 5, 0, world=1)
    request = checkpoint_pb2.CommitShardRequest(manifest=manifest_proto(written), tier="mem", restored_step=3,
                                                job_round=2)
    answer = inventory.own(request)
    assert not answer.checkpoint.valid and "announced to the leader with the next heartbeat" in answer.message
    assert answer.checkpoint.shards[0].checksum == written.checksum
    publish(tier, 6, 1, world=2)
    inventory.replica(TIER_JOB, 6, 1, owner="b")
    assert inventory.changed()
    sent = inventory.take(first=False)
    assert sent is not None and inventory.take(first=False) is None
    assert [(m.manifest.step, m.replica, m.owner, m.restored_step if m.HasField("restored_step") else None)
            for m in sent.snapshots] == [(5, False, "", 3), (6, True, "b", None)]
    store(tier).delete_prefix(shard_prefix(TIER_JOB, 5, 0), marker_name=MANIFEST)  # evicted by the keep rule
    again = inventory.take(first=True)  # a new stream (a new leader): the whole report, less what went
    assert again is not None and [m.manifest.step for m in again.snapshots] == [6] and again.version > sent.version
    with pytest.raises(AgentError, match="not in the memory tier"):
        inventory.own(checkpoint_pb2.CommitShardRequest(manifest=manifest_proto(man(9, 0)), tier="mem"))  # not written


def test_a_restarted_agent_announces_what_its_memory_tier_still_holds(tmp_path: Path) -> None:
    tier = mem_tier(tmp_path / "mem", "a")
    first = MemoryInventory(store(tier), "a")
    first.own(checkpoint_pb2.CommitShardRequest(manifest=manifest_proto(publish(tier, 5, 0, world=1)), tier="mem"))
    publish(tier, 6, 1, world=2)
    first.replica(TIER_JOB, 6, 1, owner="b")
    store(tier).delete_prefix(shard_prefix(TIER_JOB, 6, 1), marker_name=MANIFEST)
    again = MemoryInventory(store(tier), "a").take(first=True)  # the agent restarted; its tmpfs did not
    assert again is not None and [(m.manifest.step, m.replica) for m in again.snapshots] == [(5, False)]
    assert (tmp_path / "mem" / FILE).is_file() and not [i.key for i in store(tier).list() if FILE in i.key]


def test_the_training_side_retries_an_unavailable_restore_target_bounded(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from ftd.training import agent_link

    link = agent_link.AgentLink(str(tmp_path / "no.sock"))
    calls: list[str] = []

    def refused_twice(method: str, request: object, timeout_s: float | None = None) -> object:
        calls.append(method)
        if len(calls) <= 2:  # the new leader still hears the nodes' memory reports
            raise agent_link.AgentUnavailable("UNAVAILABLE: this leader waits for the memory reports of 1 node(s)")
        return checkpoint_pb2.RestoreTarget(found=True)

    monkeypatch.setattr(link, "_call", refused_twice)
    assert link.restore_target(JOB).found and calls == ["GetRestoreTarget"] * 3
    monkeypatch.setattr(agent_link, "RESTORE_TARGET_RETRY_S", 0.5)
    calls.clear()

    def always(method: str, request: object, timeout_s: float | None = None) -> object:
        calls.append(method)
        raise agent_link.AgentUnavailable("still waiting")

    monkeypatch.setattr(link, "_call", always)
    with pytest.raises(agent_link.AgentUnavailable):
        link.restore_target(JOB)
    assert 2 <= len(calls) <= 5  # retried, then given up after the bound


def test_the_leaders_garbage_collector_leaves_the_start_up_objects_alone_and_runs_less_often() -> None:
    """coordinator/main.py's tune_gc, in a fresh interpreter (this one's collector stays as it is)."""
    import subprocess
    import sys

    code = ("import gc; from ftd.coordinator.main import GC_THRESHOLDS, tune_gc; before = gc.get_freeze_count(); "
            "tune_gc(); print(before, gc.get_freeze_count(), gc.get_threshold() == GC_THRESHOLDS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, frozen, tuned = out.stdout.split()
    assert before == "0" and int(frozen) > 10_000 and tuned == "True"  # the imported modules' objects

