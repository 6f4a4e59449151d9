"""The landing reserve (agent.landing): how much room a spare prepares (a pure plan from the catalog),
the slots prepared in the background, never during a pull nor right after one, and a pulled file
received straight into a slot: whole, truncated to its size, renamed into place only once it
matched; an altered byte or a wrong checksum leaves no file and no slot behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from doubles import ManualClock, flipping_proxy

from ftd.agent import bulk_copy, landing
from ftd.agent.landing import GRANULE, MIN_FILE, LandingReserve, Slot, capacity_for, plan
from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord
from ftd.checkpoints.layout import FileEntry
from ftd.storage_backends.base import crc32c_hex
from ftd.waiting import wait_for

MIB = 1 << 20


def record(job: str, step: int, sizes: list[int], copies: tuple[str, ...] = ("mem",), invalid: str = "",
           world: int | None = None) -> CheckpointRecord:
    shards = {r: ShardRecord(r, n, "", (FileEntry("state.pt", n, "0"), FileEntry("SHARD.json", 100, "0")),
                             frozenset(CopyRef(t, f"node-{r}") for t in copies))
              for r, n in enumerate(sizes)}
    return CheckpointRecord(job, step, 1, world if world is not None else len(sizes), "torch", 0.0, shards, invalid)


# ---- the plan ----------------------------------------------------------------------------------------------


def test_a_spare_plans_one_slot_per_shard_of_a_nodes_share_of_the_newest_step_in_memory() -> None:
    records = [
        record("a", 10, [100 * MIB] * 8),
        record("a", 20, [200 * MIB, 300 * MIB, 100 * MIB, 250 * MIB, 10 * MIB, 20 * MIB, 30 * MIB, 40 * MIB]),
        record("a", 30, [900 * MIB] * 8, copies=("ssd",)),  # newer, but not in memory: not what a restore pulls
        record("a", 40, [900 * MIB] * 8, invalid="invalid: bad"),
        record("a", 50, [900 * MIB] * 7, world=8),  # incomplete
    ]
    slots, why = plan(records, nodes_in_world=4, room=10 << 30)  # 8 ranks on 4 nodes: 2 per node
    assert slots == [capacity_for(300 * MIB), capacity_for(250 * MIB)], why
    assert "job a step 20" in why and "2 of 8" in why


def test_the_plan_keeps_within_the_room_and_skips_small_files() -> None:
    records = [record("a", 1, [500 * MIB, 500 * MIB]), record("b", 1, [MIN_FILE - 1] * 4)]
    slots, why = plan(records, nodes_in_world=1, room=600 * MIB)
    assert slots == [capacity_for(500 * MIB)] and "1 of 2 slots fit" in why
    assert plan(records[1:], 1, 10 << 30)[0] == []  # too small to be worth preparing
    assert plan([], 3, 10 << 30) == ([], "no step is held in memory by every rank")


def test_capacities_round_up_with_room_for_the_cipher() -> None:
    assert capacity_for(1) == GRANULE and capacity_for(GRANULE - landing.SLACK) == GRANULE
    assert capacity_for(GRANULE) == 2 * GRANULE


# ---- the reserve -------------------------------------------------------------------------------------------


Reserve = tuple[LandingReserve, ManualClock, list[int]]


@pytest.fixture
def reserve(tmp_path: Path) -> Iterator[Reserve]:
    clock, ready, taken = ManualClock(), [0], []
    res = LandingReserve(tmp_path / "landing", lambda n: ready.__setitem__(0, n), lambda: taken.append(1), clock)
    try:
        yield res, clock, taken
    finally:
        res.close()


def test_slots_are_prepared_in_the_background_and_taken_once(reserve: Reserve) -> None:
    res, _, taken = reserve
    res.set_target([GRANULE, GRANULE])
    wait_for(lambda: res.ready_bytes == 2 * GRANULE, 30, "two slots prepared")
    files = sorted(res.root.iterdir())
    assert len(files) == 2 and all(f.stat().st_size == GRANULE for f in files)  # allocated: counted in the budget
    assert res.take("state.pt", MIN_FILE - 1) is None, "a small file lands the ordinary way"
    assert res.take("state.pt", GRANULE) is None, "no slot holds it with the cipher's room"
    slot = res.take("state.pt", GRANULE - landing.SLACK)
    assert slot is not None and taken == [1] and res.ready_bytes == GRANULE and res.wanted == [GRANULE]
    slot.discard()
    assert not slot.path.exists()
    res.set_target([])  # e.g. promoted: the rest is freed
    assert res.ready_bytes == 0 and list(res.root.iterdir()) == []


def test_no_slot_is_prepared_during_a_pull_or_right_after(reserve: Reserve) -> None:
    res, clock, _ = reserve
    with res.pulling():
        res.set_target([GRANULE])
        assert res._missing() == 0  # the fill thread's decision, read directly
    assert res._missing() == 0, "quiet for a while after the pull"
    clock.now += landing.QUIET_S + 0.1
    assert res._missing() == GRANULE
    wait_for(lambda: res.ready_bytes == GRANULE, 30, "the slot prepared once quiet")


def test_a_restart_frees_what_the_previous_run_left(tmp_path: Path) -> None:
    (tmp_path / "landing").mkdir()
    (tmp_path / "landing" / "slot-old").write_bytes(b"x" * 1000)
    LandingReserve(tmp_path / "landing").close()
    assert not (tmp_path / "landing").exists()


# ---- a pulled file received into a slot -------------------------------------------------------------------

CHUNK = 64 << 10
BIG = os.urandom(37 * CHUNK + 123)
CONTENTS = {"state.pt": BIG, "SHARD.json": b'{"manifest": true}'}


@pytest.fixture
def server() -> Iterator[bulk_copy.BulkServer]:
    srv = bulk_copy.BulkServer("127.0.0.1", chunk_bytes=CHUNK)
    try:
        yield srv
    finally:
        srv.close()


def offered(root: Path) -> list[bulk_copy.OfferedFile]:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in CONTENTS.items():
        (root / name).write_bytes(data)
    return [bulk_copy.OfferedFile(n, root / n, len(d), crc32c_hex(d)) for n, d in CONTENTS.items()]


def pull(server: bulk_copy.BulkServer, files: list[bulk_copy.OfferedFile], dest: Path, slot: Slot,
         expected: dict[str, tuple[int, str]] | None = None, port: int | None = None) -> int:
    offer_port, offer = server.offer(files)
    asked: list[tuple[str, int]] = []

    def land(name: str, size: int) -> Slot | None:
        asked.append((name, size))
        return slot if name == "state.pt" else None

    try:
        return bulk_copy.receive("127.0.0.1", port or offer_port, offer.transfer, offer.key,
                                 [(f.name, f.size, f.crc32c) for f in files], dest, expected, chunk=CHUNK,
                                 timeout_s=10, landing=land)
    finally:
        assert ("state.pt", len(BIG)) in asked


def test_a_file_lands_in_the_slot_whole_and_under_its_name(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    slot = Slot(tmp_path / "slot", len(BIG) + MIB)
    got = pull(server, offered(tmp_path / "holder"), tmp_path / "in", slot)
    assert got == sum(len(v) for v in CONTENTS.values())
    assert {p.name: p.read_bytes() for p in (tmp_path / "in").iterdir()} == CONTENTS  # truncated to its size
    assert not slot.path.exists(), "the slot became the file"


def test_a_wrong_checksum_leaves_no_file_and_no_slot(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    slot = Slot(tmp_path / "slot", len(BIG) + MIB)
    with pytest.raises(bulk_copy.BulkError, match="expected 12345678"):
        pull(server, offered(tmp_path / "holder"), tmp_path / "in", slot, {"state.pt": (len(BIG), "12345678")})
    assert not (tmp_path / "in" / "state.pt").exists() and not slot.path.exists()


def test_a_copy_rotten_at_the_holder_fails_the_receivers_check(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    """The holder does not hash what it sends: the receiver's check against the manifest's sum (or
    the catalog's) refuses it, and the caller falls back to ReadShard, which checks at the holder."""
    files = offered(tmp_path / "holder")
    (tmp_path / "holder" / "state.pt").write_bytes(bytes([BIG[0] ^ 0xFF]) + BIG[1:])  # differs, whatever it was
    slot = Slot(tmp_path / "slot", len(BIG) + MIB)
    with pytest.raises(bulk_copy.BulkError, match=r"state\.pt: crc32c"):
        pull(server, files, tmp_path / "in", slot)
    assert list((tmp_path / "in").iterdir()) == [] and not slot.path.exists()


def test_a_byte_altered_on_the_wire_leaves_no_file_and_no_slot(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    files = offered(tmp_path / "holder")
    offer_port, offer = server.offer(files)
    listener, worker = flipping_proxy(offer_port, flip_at=5 * (CHUNK + bulk_copy.TAG) + 3)
    slot = Slot(tmp_path / "slot", len(BIG) + MIB)
    with listener, pytest.raises(bulk_copy.BulkError, match="record 5 does not open"):
        bulk_copy.receive("127.0.0.1", listener.getsockname()[1], offer.transfer, offer.key,
                          [(f.name, f.size, f.crc32c) for f in files], tmp_path / "in", chunk=CHUNK, timeout_s=10,
                          landing=lambda name, size: slot)
    worker.join(10)
    assert list((tmp_path / "in").iterdir()) == [] and not slot.path.exists()
