"""The snapshot and the rank state without an agent: buffers kept in one arena and laid out again
only when shapes change, Stateful values resolved, RNG states and a data loader's position set back
exactly, a rank's DCP shard written and read back (mapped, in place); and on a real 2-rank gloo FSDP2
world (tests/fsdp_job.py --checks): a snapshot holds each rank's local shards with their placements,
its DCP shards are what ``dcp.save`` of the live state writes, and it loads in place into a fresh
model and an optimizer that never stepped."""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ftd.storage_backends.base import crc32c_file
from ftd.training import rank_state
from ftd.training.dcp_io import check_template, data_file, load_dcp, save_dcp
from ftd.training.rank_state import RankState
from ftd.training.restore import crc32c_mapped, load_into
from ftd.training.snapshot import Snapshotter, owning_storages

JOB_SCRIPT = Path(__file__).with_name("fsdp_job.py")


class Counter:
    """A Stateful: what DCP calls ``state_dict()`` on."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.w = torch.full((4,), float(n))

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])
        self.w.copy_(sd["w"])


def test_buffers_are_reused_and_laid_out_again_only_when_shapes_change() -> None:
    snap = Snapshotter()
    state: dict[str, Any] = {"a": torch.arange(1000, dtype=torch.float32), "b": [torch.ones(3, 5), 7], "c": "x"}
    first = snap.snapshot(state)
    ptr = first["a"].data_ptr()
    assert torch.equal(first["a"], state["a"]) and first["b"][1] == 7 and first["c"] == "x"
    state["a"] += 1
    second = snap.snapshot(state)
    assert second["a"].data_ptr() == ptr and snap.last_alloc_s == 0.0 and torch.equal(second["a"], state["a"])
    assert snap.buffer_bytes == 1000 * 4 + 15 * 4
    state["b"][0] = torch.ones(2, 2, dtype=torch.float64)  # smaller: laid out again inside the arena
    reserved = snap.reserved_bytes
    third = snap.snapshot(state)
    assert snap.reserved_bytes == reserved and snap.last_alloc_s == 0.0 and third["b"][0].dtype == torch.float64
    assert all(t.data_ptr() % 64 == 0 for t in (third["a"], third["b"][0]))
    state["big"] = torch.zeros(100_000)  # no longer fits: a bigger arena
    snap.snapshot(state)
    assert snap.reserved_bytes >= 100_000 * 4 + 4000


def test_a_torch_format_file_holds_the_state_not_the_arena(tmp_path: Path) -> None:
    """torch.save writes a tensor's whole storage: after a 4 MB state, an 80 KB one saved from the
    arena's views would be a 4 MB file (the buddy then refuses it as over budget)."""
    snap = Snapshotter()
    snap.snapshot({"w": torch.ones(1 << 20)})
    small = snap.snapshot({"w": torch.full((20_000,), 2.0), "step": 7})
    torch.save(owning_storages(small), tmp_path / "state.pt")
    assert (tmp_path / "state.pt").stat().st_size < 200_000
    loaded = torch.load(tmp_path / "state.pt")
    assert loaded["step"] == 7 and torch.equal(loaded["w"], torch.full((20_000,), 2.0))
    whole = snap.snapshot({"w": torch.ones(1 << 20)})
    assert owning_storages(whole)["w"].untyped_storage().nbytes() == 4 << 20


def test_snapshot_buffers_own_their_storage_so_no_writer_clones_them() -> None:
    """torch.save and DCP's writer clone a tensor whose storage is larger than it (a view): each
    buffer has a storage of exactly its bytes over the arena, so a save writes from the arena itself."""
    snap = Snapshotter()
    state = {"a": torch.randn(1000), "b": torch.randn(10, 7).to(torch.bfloat16), "c": torch.arange(5)}
    out = snap.snapshot(state)
    for key, t in out.items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        assert owning_storages(out)[key].data_ptr() == t.data_ptr(), f"{key} was cloned"
        assert torch.equal(t, state[key])
    snap.reserve(snap.reserved_bytes * 4)  # a new arena: the old snapshot's buffers keep theirs alive
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_reserve_and_prepare_take_the_allocation_out_of_the_save() -> None:
    snap = Snapshotter()
    assert snap.reserve(1 << 20) > 0 and snap.reserved_bytes == 1 << 20
    snap.snapshot({"w": torch.zeros(1000)})
    assert snap.last_alloc_s == 0.0 and snap.reserved_bytes == 1 << 20  # fits in what was reserved
    other = Snapshotter()
    assert other.prepare({"w": torch.zeros(10, 10), "s": Counter(2)}) == 100 * 4 + 4 * 4
    other.snapshot({"w": torch.ones(10, 10), "s": Counter(3)})
    assert other.last_alloc_s == 0.0


def test_stateful_values_are_snapshotted_through_their_state_dict() -> None:
    Point = collections.namedtuple("Point", "x y")
    counter = Counter(5)
    out = Snapshotter().snapshot({"c": counter, "p": Point(torch.ones(2), 3)})
    assert out["c"]["n"] == 5 and torch.equal(out["c"]["w"], counter.w) and out["c"]["w"].data_ptr() != \
        counter.w.data_ptr()
    assert isinstance(out["p"], Point) and out["p"].y == 3


def test_rng_states_and_the_loader_position_come_back_exactly(tmp_path: Path) -> None:
    loader = Counter(11)
    extra = RankState(dataloader=loader)
    random.seed(1)
    torch.manual_seed(2)
    random.random()
    torch.rand(3)
    rank_state.write(tmp_path, extra.capture())
    want = (random.random(), random.gauss(0, 1), torch.rand(5), torch.randn(2))
    loader.load_state_dict({"n": 99, "w": torch.zeros(4)})
    random.seed(7)
    torch.manual_seed(7)
    assert set(extra.apply(rank_state.read(tmp_path))) >= {"python", "torch", "dataloader"}
    got = (random.random(), random.gauss(0, 1), torch.rand(5), torch.randn(2))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert loader.n == 11 and torch.equal(loader.w, torch.full((4,), 11.0))
    assert RankState(rng=False).capture() == {} and not RankState(rng=False).enabled
    with pytest.raises(TypeError, match="dataloader= needs state_dict"):
        RankState(dataloader=object())


def test_a_rank_shard_in_dcp_form_loads_mapped_in_place_and_a_bare_optimizer_is_refused(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(3)},
             "c": Counter(4), "meta": {"lr": 0.5}}
    folder = tmp_path / "shard"
    folder.mkdir()
    save_dcp(Snapshotter().snapshot(state), folder, rank=3)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", data_file(3)] == [".metadata", "__3_0.distcp"]
    expected = {p.name: (p.stat().st_size, crc32c_file(p)) for p in folder.iterdir()}
    assert all(crc32c_mapped(folder / n) == crc for n, (_, crc) in expected.items())
    live = Counter(0)
    w = torch.zeros(300_000)
    template: dict[str, Any] = {"model": {"w": w, "b": torch.zeros(3)}, "c": live, "meta": {"lr": 0.0}}
    load_dcp(folder, expected, template, weights_only=True)
    assert template["model"]["w"] is w and torch.equal(w, state["model"]["w"])  # in place
    assert live.n == 4 and torch.equal(live.w, torch.full((4,), 4.0)) and template["meta"]["lr"] == 0.5
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match=r"bare optimizer.*get_state_dict"):
        check_template({"optim": opt})


def test_a_torch_format_state_is_put_into_the_live_objects() -> None:
    live = Counter(0)
    w = torch.zeros(3)
    state: dict[str, Any] = {"c": live, "model": {"w": w}, "step": 0}
    load_into(state, {"c": {"n": 2, "w": torch.ones(4)}, "model": {"w": torch.ones(3)}, "step": 9})
    assert live.n == 2 and state["model"]["w"] is w and torch.equal(w, torch.ones(3)) and state["step"] == 9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp2_snapshot_holds_local_shards_like_dcp_save_and_loads_in_place(tmp_path: Path) -> None:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(JOB_SCRIPT), "--checks", "--out", str(tmp_path)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"checks-{rank}.json").read_text())
        assert got["dtensors_local_and_equal"], "a DTensor's local shard, its placements, mesh and global shape"
        assert got["prepared_bytes"] > 8e6 and got["alloc_after_prepare"] == 0.0 and got["alloc_second"] == 0.0
        assert got["buffers_reused"]
        assert got["sharded_tensor"] == ["ShardedTensor", [[5, 4]], True]
        assert got["files"] == [".metadata", f"__{rank}_0.distcp"]
        assert got["like_stock_save"], "the snapshot's DCP shard is what dcp.save of the live state writes"
        assert got["loaded_equal"] and got["next_step_equal"]
    assert json.loads((tmp_path / "checks-0.json").read_text())["chunks_tile_global_shapes"]


def test_a_signed_copy_in_memory_is_hashed_once_by_its_signature_check(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In memory the signature's digest of every file stands for the CRC32C pass (one hash, not two);
    a disk copy keeps the CRC32C first, so plain damage is named as such."""
    from ftd.training import corruption
    from ftd.training.corruption import CorruptCopy
    from ftd.training.restore import load_shard

    torch.save({"w": torch.arange(4096.0)}, tmp_path / "state.pt")
    expected = {"state.pt": ((tmp_path / "state.pt").stat().st_size, crc32c_file(tmp_path / "state.pt"))}
    hashed: list[Path] = []
    monkeypatch.setattr(corruption, "crc32c_mapped", lambda p: hashed.append(p) or crc32c_file(p))
    checked: list[Path] = []
    loaded = load_shard(tmp_path, expected, "torch", "cpu", None, True, in_memory=True, verify=checked.append)
    assert torch.equal(loaded["w"], torch.arange(4096.0)) and checked == [tmp_path] and hashed == []

    def refuse(directory: Path) -> None:
        raise CorruptCopy("signature check failed: state.pt: blake3 of piece 0 is not the one signed")

    data = bytearray((tmp_path / "state.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCopy, match="signature check failed"):
        load_shard(tmp_path, expected, "torch", "cpu", None, True, in_memory=True, verify=refuse)
    with pytest.raises(CorruptCopy, match="crc32c"):
        load_shard(tmp_path, expected, "torch", "cpu", None, True, in_memory=False, verify=refuse)
    with pytest.raises(CorruptCopy, match="crc32c"):  # unsigned (no mTLS): the CRC32C is the check
        load_shard(tmp_path, expected, "torch", "cpu", None, True, in_memory=True)
    assert hashed == [tmp_path / "state.pt"]
