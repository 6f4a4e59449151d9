"""A promoted node pulls its new ranks' shards ahead (agent/restore_prefetch.py): which assignments
start it, which copies it pulls (the ones the worker would read), and the agent's one-pull-per-copy
rule that lets the worker's own FetchShard find the pull done or wait for it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ftd.agent.peer_copy import Fetched, PeerFetcher
from ftd.agent.restore_prefetch import Prefetcher, Ranks, plan, ranks_of, should_prefetch
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord
from ftd.checkpoints.layout import MANIFEST, FileEntry
from ftd.v1 import agent_pb2, cluster_pb2
from ftd.waiting import wait_for


def shard(rank: int, *copies: tuple[str, str], bad: dict[str, str] | None = None) -> ShardRecord:
    files = (FileEntry("__0_0.distcp", 100 + rank, "0000000a"), FileEntry(".metadata", 10, "0000000b"))
    return ShardRecord(rank, 110 + rank, "x", files, frozenset(CopyRef(t, loc) for t, loc in copies), bad or {})


def record(world: int = 4) -> CheckpointRecord:
    return CheckpointRecord("job", 32, 2, world, "dcp", 0.0, shards={
        0: shard(0, ("mem", "node-0"), ("mem", "node-1")),  # the dead node-0 and its buddy node-1
        1: shard(1, ("mem", "node-0"), ("mem", "node-3"), ("mem", "node-1"), ("ssd", "node-0")),
        2: shard(2, ("mem", "node-1"), ("mem", "node-2")),  # already in node-2's memory
        3: shard(3, ("ssd", "node-1"), ("mem", "node-1"), bad={"mem@node-1": "crc"}),  # no good memory copy
    })


def assignment(epoch: int, rank: int, world: int = 2, fenced: bool = False) -> cluster_pb2.Assignment:
    role = cluster_pb2.ROLE_ACTIVE if rank >= 0 else cluster_pb2.ROLE_SPARE
    return cluster_pb2.Assignment(epoch=epoch, role=role, rank=rank, world_size=world, fenced=fenced, job="job")


def test_a_promotion_or_a_new_rank_starts_it_an_unchanged_rank_does_not() -> None:
    spare, promoted = ranks_of(assignment(1, -1), 2), ranks_of(assignment(2, 0), 2)
    assert promoted.globals() == [0, 1] and ranks_of(assignment(2, 1), 2).globals() == [2, 3]
    assert spare.globals() == [] and ranks_of(assignment(2, 1, fenced=True), 2).rank == -1
    go, why = should_prefetch(spare, promoted, "job")
    assert go and why == "node rank 0 of 2 in epoch 2 (was a spare)"
    go, why = should_prefetch(Ranks(1, 1, 2, 2), Ranks(2, 1, 2, 2), "job")
    assert not go and "the same ranks as in epoch 1" in why  # a survivor: its shards are in its memory
    assert should_prefetch(Ranks(1, 1, 2, 2), Ranks(2, 0, 1, 2), "job")[0]  # shrunk: new ranks
    assert not should_prefetch(None, spare, "job")[0]
    assert should_prefetch(None, promoted, "")[1] == "no training job"


def test_the_plan_pulls_what_the_worker_would_read_from_another_node() -> None:
    got = plan(record(), [0, 1, 2, 3], "node-2")
    # each rank's memory copies on other nodes in the worker's order (order_copies: by location);
    # rank 2 is in node-2's own memory; rank 3 has no good memory copy
    assert [[(r.rank, r.location, r.tier) for r in rank] for rank in got] == [
        [(0, "node-0", "mem"), (0, "node-1", "mem")],
        [(1, "node-0", "mem"), (1, "node-1", "mem"), (1, "node-3", "mem")]]
    assert [(f.name, f.size, f.crc32c) for f in got[0][0].expected] == [("__0_0.distcp", 100, "0000000a"),
                                                                        (".metadata", 10, "0000000b")]
    assert got[0][0].job == "job" and got[0][0].step == 32
    assert plan(record(), [7], "node-2") == []  # a rank the step does not have


def test_the_prefetcher_pulls_on_a_promotion_and_keeps_going_past_a_failure() -> None:
    asked: list[tuple[str, int]] = []
    fetched: list[tuple[int, str]] = []

    def target(job: str, world: int) -> CheckpointRecord | None:
        asked.append((job, world))
        return record(world)

    def fetch(request: agent_pb2.FetchShardRequest) -> object:
        if request.location == "node-0":
            raise OSError("node node-0 has no reachable agent")  # the dead node: the next copy is pulled
        if (request.rank, request.location) == (1, "node-1"):
            raise OSError("node-1 is busy")
        fetched.append((request.rank, request.location))
        return None

    p = Prefetcher("node-2", "job", 2, target, fetch)
    assert not p.on_assignment(assignment(1, -1))  # a spare
    assert p.on_assignment(assignment(2, 0))  # promoted to node rank 0: global ranks 0 and 1
    p.join(10)
    assert asked == [("job", 4)]
    assert fetched == [(0, "node-1"), (1, "node-3")] and p.pulled == [(32, 0, "node-1"), (32, 1, "node-3")]
    assert not p.on_assignment(assignment(3, 0))  # the same ranks again: nothing to pull
    p2 = Prefetcher("node-2", "job", 2, lambda job, world: record(8), fetch)
    assert p2.on_assignment(assignment(2, 0))
    p2.join(10)
    assert p2.pulled == []  # a target of another world size is resharded by the workers: nothing pulled


class CountingFetcher(PeerFetcher):
    """The agent's fetcher with the pull itself replaced: counts the pulls, each held until released."""

    def __init__(self, spool: Path) -> None:
        super().__init__(lambda node: "127.0.0.1:1", lambda address: None, spool)  # type: ignore[arg-type, return-value]
        self.pulls = 0
        self.release = threading.Event()
        self.fail_next = False

    def _pull(self, request: agent_pb2.FetchShardRequest) -> Fetched:
        self.pulls += 1
        assert self.release.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise OSError("the holder went away")
        folder = self.spool / request.job / f"step-{request.step}" / f"rank-{request.rank:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).write_text("{}")
        return Fetched(folder, 110, 0.01, verified=True)


def test_one_copy_is_pulled_once_and_a_second_caller_waits_for_that_pull(tmp_path: Path) -> None:
    f = CountingFetcher(tmp_path / "spool")
    request = agent_pb2.FetchShardRequest(job="job", step=32, rank=1, tier="mem", location="node-0")
    results: list[Fetched] = []
    first = threading.Thread(target=lambda: results.append(f.fetch(request)))
    second = threading.Thread(target=lambda: results.append(f.fetch(request)))
    first.start()
    wait_for(lambda: f.pulls == 1, 10, "the first pull")
    second.start()  # the worker asks while the prefetch pulls
    f.release.set()
    first.join(10)
    second.join(10)
    assert f.pulls == 1 and len(results) == 2 and results[0] == results[1]
    assert f.fetch(request) == results[0] and f.pulls == 1  # pulled before, still in the spool
    f.fail_next = True  # the worker tries the dead node's copy first: that fails and changes nothing
    with pytest.raises(OSError):
        f.fetch(agent_pb2.FetchShardRequest(job="job", step=32, rank=1, tier="mem", location="node-9"))
    assert f.fetch(request) == results[0] and f.pulls == 2
    (results[0].path / MANIFEST).unlink()  # replaced since (the spool keeps one copy per rank)
    assert f.fetch(request).path == results[0].path and f.pulls == 3


def test_a_failed_pull_is_tried_again_by_the_next_caller(tmp_path: Path) -> None:
    f = CountingFetcher(tmp_path / "spool")
    f.release.set()
    f.fail_next = True
    request = agent_pb2.FetchShardRequest(job="job", step=32, rank=1, tier="mem", location="node-0")
    with pytest.raises(OSError, match="went away"):
        f.fetch(request)
    assert f.fetch(request).verified and f.pulls == 2
