"""The memory tier without processes: its budget and per-rank limit, the catalog's memory rules
(in-memory validity, pruning, restore target around dead nodes, the cadence kept with a step),
retention on the memory tier, and replication to a buddy over real gRPC on loopback (two in-process
agent services)."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from doubles import record_copy

from ftd import rpc
from ftd.agent.errors import AgentError
from ftd.agent.peers import Buddy
from ftd.agent.replicator import ReplicationMetrics, Replicator
from ftd.agent.tiering import Tiering
from ftd.checkpoints import catalog as rules
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.coordinator.buddies import Peer, choose_buddy
from ftd.storage_backends.base import crc32c_hex
from ftd.storage_backends.memory import KEEP, MemoryFull, MemoryTier, default_capacity, evictions, superseded
from ftd.storage_backends.tiers import LocalSpec, Tier, TierSpec, open_tier
from ftd.training.cadence import CadencePolicy
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2

JOB = "job"
MiB = 1 << 20


def publish(tier: Tier, step: int, rank: int, payload: bytes = b"x" * 1000, world: int = 2) -> ShardManifest:
    """A published shard on ``tier``, as the training side writes it."""
    staging = tier.backend.stage(shard_prefix(JOB, step, rank))
    staging.put_stream("state.pt", io.BytesIO(payload))
    manifest = ShardManifest(JOB, step, 1, rank, world, "torch",
                             (FileEntry("state.pt", len(payload), crc32c_hex(payload)),))
    staging.publish(MANIFEST, manifest.encode())
    return manifest


def mem_tier(root: Path, node: str, capacity: int = 0) -> Tier:
    return open_tier(TierSpec("mem", node, LocalSpec(root, capacity)))


def store(tier: Tier) -> MemoryTier:
    assert tier.memory is not None, "the tier named mem opens as the memory tier"
    return tier.memory


def snapshots(root: Path, job: str, rank: int) -> list[int]:
    return MemoryTier(root).snapshots(job, rank)


# ---- budget and per-rank limit -----------------------------------------------------------------------


def test_a_third_snapshot_replaces_the_oldest_and_pinned_ones_stay(tmp_path: Path) -> None:
    tier = mem_tier(tmp_path / "mem", "n1")
    for step in (1, 2):
        publish(tier, step, 0)
    publish(tier, 5, 1)  # another rank: untouched
    assert store(tier).make_room(JOB, 0, 3) == [1]
    publish(tier, 3, 0)
    assert snapshots(tmp_path / "mem", JOB, 0) == [2, 3] and snapshots(tmp_path / "mem", JOB, 1) == [5]
    assert store(tier).make_room(JOB, 0, 4, pinned={2}) == []  # being copied to the SSD
    assert snapshots(tmp_path / "mem", JOB, 0) == [2, 3]


def test_evicted_steps_leave_no_folder_behind_so_the_tier_scan_stays_small(tmp_path: Path) -> None:
    """A step's folder goes with its last rank (it stays while another rank's shard is in it): a job
    saving every step must not leave a folder per step for every later scan to walk. A writer whose
    step folder was removed between making it and staging in it makes it again."""
    root = tmp_path / "mem"
    tier = mem_tier(root, "n1")
    for step in range(1, 40):
        store(tier).make_room(JOB, 0, step)
        publish(tier, step, 0)
    publish(tier, 39, 1)
    steps = sorted(p.name for p in (root / JOB).iterdir())
    assert steps == [f"step-{s:012d}" for s in (38, 39)], steps
    store(tier).make_room(JOB, 0, 40)  # step 38 goes whole; step 39 keeps rank 1
    tier.backend.delete_prefix(shard_prefix(JOB, 39, 0), marker_name=MANIFEST)
    assert sorted(p.name for p in (root / JOB).iterdir()) == [f"step-{39:012d}"]
    assert snapshots(root, JOB, 1) == [39]

    made = root / JOB / f"step-{41:012d}"
    real_mkdir = Path.mkdir
    calls = []

    def raced(self: Path, *args: Any, **kw: Any) -> None:
        if self.parent == made and not calls:  # the emptied folder removed under the writer, once
            calls.append(self)
            made.rmdir()
        real_mkdir(self, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "mkdir", raced)
        publish(tier, 41, 0)
    assert calls and snapshots(root, JOB, 0) == [41]


def test_the_keep_rule_is_one_rule_for_the_tier_the_buddy_and_the_catalog() -> None:
    assert evictions([1, 2], 3) == [1] and evictions([1, 2, 3], 3) == [1]  # a held 3 is replaced, not counted
    assert evictions([4, 6], 5) == [4] and evictions([7], 5) == []  # an older incoming step still stays
    assert superseded([4, 6], 3) and not superseded([4, 6], 5) and not superseded([4, 6], 4)
    a = CopyRef("mem", "a")
    recs = [record(s, {0: {a}}, world=1) for s in (1, 2, 3)]
    _, removed = rules.prune_memory(recs, 0, "a")
    assert [r.step for r in removed] == evictions([1, 2], 3)  # the catalog drops what the node deletes


def test_a_snapshot_over_the_budget_is_refused_naming_the_sizes(tmp_path: Path) -> None:
    root = tmp_path / "mem"
    tier = mem_tier(root, "n1", capacity=10_000)
    publish(tier, 1, 0, b"a" * 4000)
    publish(tier, 2, 0, b"b" * 4000)
    # The oldest goes first; then 4 KiB held + 7 KiB more exceeds the 10 KB budget: refused, nothing written.
    with pytest.raises(MemoryFull) as err:
        store(tier).admit(JOB, 0, 3, 7000, "the memory snapshot of step 3 (rank 0)")
    text = str(err.value)
    assert "memory tier full" in text and "7000 bytes" in text and "10000 bytes" in text and "refused" in text
    assert snapshots(root, JOB, 0) == [2]
    assert store(tier).admit(JOB, 0, 3, 5000, "step 3") == []  # fits now
    with pytest.raises(MemoryFull, match="filesystem has"):
        MemoryTier(root).check_capacity(1 << 60, "an exabyte")  # no budget: the filesystem's free space still counts


def test_the_default_budget_is_a_quarter_of_the_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    assert default_capacity(meminfo) == 16384000 * 1024 // 4
    assert default_capacity(tmp_path / "missing") == 0


# ---- the catalog's memory rules ----------------------------------------------------------------------


def record(step: int, copies: dict[int, set[CopyRef]], world: int = 2, cadence: str = "") -> CheckpointRecord:
    shards = {r: ShardRecord(r, 10, "c", (FileEntry("state.pt", 10, "0a0b0c0d"),), frozenset(c))
              for r, c in copies.items()}
    return CheckpointRecord(JOB, step, 1, world, "torch", 0.0, shards, cadence=cadence)


def test_in_memory_means_on_the_ranks_node_and_its_buddy() -> None:
    assert "mem" in rules.TIERS and rules.TIERS[0] == "mem"
    one = record(1, {0: {CopyRef("mem", "a")}, 1: {CopyRef("mem", "b")}})
    assert one.valid and one.restorable and not one.on_tier("mem")
    two = record(2, {0: {CopyRef("mem", "a"), CopyRef("mem", "b")}, 1: {CopyRef("mem", "b"), CopyRef("mem", "c")}})
    assert two.on_tier("mem") and rules.to_info(two).on_tier["mem"]


def test_memory_copies_are_pruned_to_two_per_rank_and_node() -> None:
    a, b = CopyRef("mem", "a"), CopyRef("mem", "b")
    recs = [record(1, {0: {a}}, world=1), record(2, {0: {a, b}}, world=1), record(3, {0: {a, b}}, world=1),
            record(4, {0: {b}}, world=1)]
    changed, removed = rules.prune_memory(recs, 0, "a")
    assert [r.step for r in removed] == [1]  # no copy left anywhere: the record goes
    assert changed == []
    changed, removed = rules.prune_memory(recs, 0, "b")
    assert [r.step for r in changed] == [2] and a in changed[0].shards[0].copies and removed == []
    durable = record(1, {0: {a, CopyRef("ssd", "a")}}, world=1)
    changed, removed = rules.prune_memory([durable, *recs[1:3]], 0, "a")
    assert [r.step for r in changed] == [1] and changed[0].shards[0].copies == {CopyRef("ssd", "a")}


def test_the_restore_target_skips_steps_only_readable_on_dead_nodes() -> None:
    a, b, c = CopyRef("mem", "a"), CopyRef("mem", "b"), CopyRef("mem", "c")
    replicated = record(7, {0: {a, b}, 1: {b, c}})  # rank 0 on a and its buddy b
    newer = record(8, {0: {a}, 1: {b, c}})  # rank 0's replica of step 8 never reached b
    target, why = rules.restore_target([replicated, newer], unreachable={"a"})
    assert target is replicated and "skipped step(s) 8" in why and "unreachable" in why
    target, _ = rules.restore_target([replicated, newer])
    assert target is newer
    assert rules.restore_target([newer], unreachable={"a"})[0] is None


def test_a_replicated_job_restores_a_rank_from_another_ranks_reachable_copy() -> None:
    """Node-local disks only: node a died with every copy of rank 0. A sharded job falls back to the
    newest fully reachable step (none here); a data-parallel one reads rank 1's copy and says so."""
    ssd_a, ssd_b = CopyRef("ssd", "a"), CopyRef("ssd", "b")
    older = record(5, {0: {ssd_a}, 1: {ssd_b}})
    newest = record(10, {0: {ssd_a}, 1: {ssd_b}})
    assert rules.restore_target([older, newest], unreachable={"a"})[0] is None
    target, why = rules.restore_target([older, newest], unreachable={"a"}, replicated=True)
    assert target is newest and "rank(s) 0 read another rank's copy" in why
    assert rules.restore_target([older, newest], replicated=True)[1] == "newest valid step 10"  # all reachable
    # Nothing reachable at all, or a step that is not complete: never a target, replicated or not.
    assert rules.restore_target([newest], unreachable={"a", "b"}, replicated=True)[0] is None
    partial = record(12, {1: {ssd_b}})
    assert rules.restore_target([older, partial], unreachable={"a"}, replicated=True)[0] is older


def test_the_cadence_is_kept_with_the_step() -> None:
    policy = CadencePolicy(memory_every_steps=1, persist_every_steps=1000)
    text = policy.describe()
    assert text == "memory_every_steps=1 persist_every_steps=1000 persist_every_s=0"
    assert CadencePolicy.parse(text) == policy
    m = ShardManifest(JOB, 3, 1, 0, 1, "torch", (FileEntry("state.pt", 10, "0a0b0c0d"),))
    rec, _ = rules.commit_shard(None, m, "mem", "a", 1.0, cadence=text)
    loaded, _, problems = rules.decode_all(rules.encode(rec))
    assert not problems and loaded[(JOB, 3)].cadence == text
    assert rules.from_info(rules.to_info(rec)).cadence == text == rules.to_info(rec).cadence


# ---- retention on the memory tier ------------------------------------------------------------------------


class FakeCatalog:
    def __init__(self) -> None:
        self.records: dict[int, CheckpointRecord] = {}
        self.calls: list[tuple[str, Any]] = []

    def __call__(self, method: str, request: Any) -> Any:
        self.calls.append((method, request))
        if method == "ListCheckpoints":
            return checkpoint_pb2.ListCheckpointsResponse(
                checkpoints=[rules.to_info(r) for _, r in sorted(self.records.items())])
        if method == "RecordCopy":
            return record_copy(self.records, request)
        raise AssertionError(method)


def test_retention_keeps_two_restorable_steps_per_rank_on_the_memory_tier(tmp_path: Path) -> None:
    mem = mem_tier(tmp_path / "mem", "n1")
    ssd = open_tier(TierSpec("ssd", "n1", LocalSpec(tmp_path / "ssd")))
    catalog = FakeCatalog()
    for step in (1, 2, 3, 4):
        m = publish(mem, step, 0, world=1)
        catalog.records[step], _ = rules.commit_shard(None, m, "mem", "n1", 0.0)
    tiering = Tiering([mem, ssd], catalog, keep=3)
    assert tiering.keep_on(mem) == 2 and tiering.keep_on(ssd) == 3 and tiering.durable == []
    tiering.pass_once()
    assert snapshots(tmp_path / "mem", JOB, 0) == [3, 4]
    gone = [(r.step, r.present) for m, r in catalog.calls if m == "RecordCopy"]
    assert gone == [(1, False), (2, False)]


# ---- replication to a buddy over gRPC ----------------------------------------------------------------------


class Agent(agent_pb2_grpc.AgentServicer):
    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator

    def WriteShard(self, request_iterator: Iterator[agent_pb2.WriteShardChunk],
                   context: grpc.ServicerContext) -> agent_pb2.WriteShardResponse:
        try:
            return self.replicator.receive(request_iterator)
        except AgentError as exc:
            context.abort(exc.code, str(exc))
        raise AssertionError("unreachable")


def told_buddy(me: str, rack: str, peers: list[Peer]) -> Buddy:
    """The buddy the coordinator would name in ``me``'s assignment (coordinator/buddies.py)."""
    chosen = choose_buddy(me, rack, peers)
    return Buddy(chosen.node_id, chosen.reason, next((p.address for p in peers if p.node_id == chosen.node_id), ""))


class Node:
    def __init__(self, tmp: Path, name: str, rack: str, catalog: FakeCatalog, peers: list[Peer],
                 capacity: int = 0) -> None:
        self.tier = mem_tier(tmp / name / "mem", name, capacity)
        self.metrics = ReplicationMetrics()
        self.replicator = Replicator(self.tier, name, lambda: told_buddy(name, rack, peers), rpc.channel, catalog,
                                     self.metrics, chunk_bytes=256 << 10)
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        agent_pb2_grpc.add_AgentServicer_to_server(Agent(self.replicator), self.server)
        port = rpc.add_port(self.server, "127.0.0.1:0")
        self.server.start()
        peers.append(Peer(name, rack, True, f"127.0.0.1:{port}"))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node, FakeCatalog]]:
    catalog = FakeCatalog()
    peers: list[Peer] = []
    a = Node(tmp_path, "a", "r1", catalog, peers)
    b = Node(tmp_path, "b", "r2", catalog, peers, capacity=3 * MiB)
    try:
        yield a, b, catalog
    finally:
        a.server.stop(0)
        b.server.stop(0)


def commit(catalog: FakeCatalog, node: Node, step: int, payload: bytes, rank: int = 0) -> None:
    m = publish(node.tier, step, rank, payload)
    catalog.records[step], _ = rules.commit_shard(catalog.records.get(step), m, "mem", node.tier.location, 0.0)
    node.replicator.enqueue(JOB, step, rank)


def test_a_snapshot_reaches_the_buddys_memory_verified_and_recorded_there(pair: tuple[Node, Node, FakeCatalog],
                                                                         tmp_path: Path) -> None:
    a, b, catalog = pair
    payload = bytes(range(256)) * (4096 + 7)  # several chunks and a partial one
    commit(catalog, a, 10, payload)
    assert a.replicator.replicate_once() and not a.replicator.replicate_once()
    assert a.replicator.last_buddy.node_id == "b"
    held = tmp_path / "b" / "mem" / shard_prefix(JOB, 10, 0)
    assert (held / "state.pt").read_bytes() == payload and (held / MANIFEST).exists()
    # recorded by b itself, in the memory report its heartbeat announces (soft state: no catalog RPC)
    report = b.replicator.inventory.report()
    assert [(s.manifest.step, s.manifest.rank, s.replica, s.owner) for s in report.snapshots] == [(10, 0, True, "a")]
    assert not [m for m, _ in catalog.calls if m == "RecordCopy"]
    assert a.metrics.replicated_bytes._value.get() >= len(payload)
    assert b.metrics.received._value.get() == 1


def test_the_queue_sends_the_newest_and_drops_older_pending(pair: tuple[Node, Node, FakeCatalog]) -> None:
    a, b, catalog = pair
    for step in (1, 2, 3):
        commit(catalog, a, step, b"s" * 100)
    assert [p.step for p in a.replicator.pending()] == [3]  # one per rank: the newest
    commit(catalog, a, 4, b"r" * 100, rank=1)
    assert [p.step for p in a.replicator.pending()] == [4, 3]  # newest first
    while a.replicator.replicate_once():
        pass
    assert store(b.tier).snapshots(JOB, 0) == [3]
    assert store(b.tier).snapshots(JOB, 1) == [4]


def test_the_buddy_refuses_what_its_budget_cannot_hold(pair: tuple[Node, Node, FakeCatalog]) -> None:
    a, b, catalog = pair
    commit(catalog, a, 1, b"z" * (4 * MiB))  # b's budget is 3 MiB
    a.replicator.replicate_once()
    assert a.metrics.failures.labels("refused")._value.get() == 1
    assert b.metrics.refused.labels("replica")._value.get() == 1
    assert store(b.tier).snapshots(JOB, 0) == []
    assert not b.replicator.inventory.report().snapshots


def test_a_stream_whose_bytes_do_not_match_is_not_published(pair: tuple[Node, Node, FakeCatalog]) -> None:
    a, b, catalog = pair
    m = publish(a.tier, 2, 0, b"good" * 1000, world=1)
    catalog.records[2], _ = rules.commit_shard(None, m, "mem", "a", 0.0)
    header = agent_pb2.WriteShardHeader(job=JOB, step=2, rank=0, tier="mem", bytes=10_000, source="a")
    lie = agent_pb2.ShardChunk(name="state.pt", size=4000, data=b"evil" * 1000, end_of_file=True,
                               crc32c=crc32c_hex(b"good" * 1000))
    messages = iter([agent_pb2.WriteShardChunk(header=header), agent_pb2.WriteShardChunk(chunk=lie)])
    with pytest.raises(AgentError) as err:
        b.replicator.receive(messages)
    assert err.value.code is grpc.StatusCode.DATA_LOSS and "sender read" in str(err.value)
    assert store(b.tier).snapshots(JOB, 0) == []
    wrong_tier = agent_pb2.WriteShardHeader(job=JOB, step=2, rank=0, tier="ssd", bytes=1, source="a")
    with pytest.raises(AgentError, match="memory tier"):
        b.replicator.receive(iter([agent_pb2.WriteShardChunk(header=wrong_tier)]))


def test_no_buddy_is_counted_not_fatal(tmp_path: Path) -> None:
    tier = mem_tier(tmp_path / "mem", "alone")
    metrics = ReplicationMetrics()
    replicator = Replicator(tier, "alone", lambda: told_buddy("alone", "", []), rpc.channel, FakeCatalog(), metrics)
    publish(tier, 1, 0)
    replicator.enqueue(JOB, 1, 0)
    stop = threading.Event()
    worker = threading.Thread(target=replicator.run, args=(stop,))
    worker.start()
    try:
        from ftd.waiting import wait_for

        wait_for(lambda: metrics.failures.labels("no_buddy")._value.get() == 1, 10, "the no-buddy failure counted")
    finally:
        stop.set()
        worker.join(5)
    assert replicator.last_buddy.node_id is None and KEEP == 2


# ---- the fast peer copy path (agent.bulk_copy) ---------------------------------------------------------------


def test_the_fast_path_moves_a_copy_sealed_and_checked(tmp_path: Path) -> None:
    from ftd.agent import bulk_copy

    tier = mem_tier(tmp_path / "holder", "a")
    payload = bytes(range(256)) * 40_000 + b"tail"  # several records and a short one
    publish(tier, 3, 0, payload)
    server = bulk_copy.BulkServer("127.0.0.1", chunk_bytes=1 << 20)
    try:
        files = bulk_copy.shard_files(tier.backend, JOB, 3, 0)
        assert [f.name for f in files] == ["state.pt", MANIFEST] and files[0].crc32c == crc32c_hex(payload)
        listing = [(f.name, f.size, f.crc32c) for f in files]
        port, offer = server.offer(files)
        expected = {"state.pt": (len(payload), crc32c_hex(payload))}
        got = bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "in", expected,
                                chunk=1 << 20)
        assert got == len(payload) + files[1].size and (tmp_path / "in" / "state.pt").read_bytes() == payload
        # An offer is used once; a wrong key opens nothing; a wrong catalog checksum is refused.
        with pytest.raises(bulk_copy.BulkError):
            bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "again", chunk=1 << 20)
        port, offer = server.offer(files)
        with pytest.raises(bulk_copy.BulkError, match="does not open"):
            bulk_copy.receive("127.0.0.1", port, offer.transfer, bytes(16), listing, tmp_path / "key", chunk=1 << 20)
        port, offer = server.offer(files)
        with pytest.raises(bulk_copy.BulkError, match="expected 00000000"):
            bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "crc",
                              {"state.pt": (len(payload), "00000000")}, chunk=1 << 20)
        assert not (tmp_path / "crc" / "state.pt").exists(), "a file that did not match never appears"
        # A copy corrupt at rest on the holder fails the receiver's check (against the manifest's sum).
        shard = tmp_path / "holder" / shard_prefix(JOB, 3, 0) / "state.pt"
        shard.write_bytes(b"X" + payload[1:])
        port, offer = server.offer(bulk_copy.shard_files(tier.backend, JOB, 3, 0))
        with pytest.raises(bulk_copy.BulkError, match=r"state\.pt: crc32c"):
            bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "bad", chunk=1 << 20)
        assert not (tmp_path / "bad" / "state.pt").exists()
    finally:
        server.close()


def test_the_memory_tier_hashes_staged_files_from_their_mapped_pages(tmp_path: Path) -> None:
    """Same CRC32C as the buffered read, empty files included; the manifest is what restores check."""
    from ftd.storage_backends import LocalBackend, crc32c_file

    tier = MemoryTier(tmp_path / "mem")
    staging = tier.stage("job/step-000000000001/rank-00000")
    (staging.local_dir() / "state.pt").write_bytes(bytes(range(256)) * 4099)
    (staging.local_dir() / "empty").write_bytes(b"")
    got = {o.key: o.crc32c for o in staging.objects()}
    assert got == {n: crc32c_file(staging.local_dir() / n) for n in ("empty", "state.pt")}
    assert MemoryTier.hash_file is not LocalBackend.hash_file
    staging.abort()
