"""Resharding a dcp step on restore (training/reshard.py, training/restore.py): the merge of the old
ranks' metadata (pure), and real gloo process groups that save a DTensor state as 4 ranks (each its
own shard folder, as the Checkpointer writes it) and restore it as 2, through the Restorer's copy
loop over real directory tiers. The agent is a recording stand-in: what would be recorded corrupt,
gone or invalid is what these tests check."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord, to_info
from ftd.checkpoints.layout import FileEntry, shard_prefix
from ftd.storage_backends.base import crc32c_file
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.tiers import LocalSpec, Tier, TierSpec
from ftd.training.corruption import IncompatibleCheckpoint
from ftd.training.reshard import ReshardMismatch, link_name, merge_metadata

JOB, STEP, OLD, NEW = "rs", 9, 4, 2
ROWS, COLS = 12, 5


def metadata(rank: int, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...] = (8, 4),
             value: bool = True) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    sd: dict[str, Any] = {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [chunk])}
    storage = {MetadataIndex("w", offsets): _StorageInfo(f"__{rank}_0.distcp", 0, 10)}
    if value:
        sd["n"] = BytesStorageMetadata()
        storage[MetadataIndex("n")] = _StorageInfo(f"__{rank}_0.distcp", 10, 5)
    return Metadata(state_dict_metadata=sd, planner_data={"w": ("w",), "n": ("n",)}, storage_data=storage)


def test_the_old_ranks_metadata_merge_into_one_checkpoint_named_per_rank() -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    merged = merge_metadata({0: metadata(0, (0, 0), (4, 4)), 1: metadata(1, (4, 0), (4, 4))})
    chunks = merged.state_dict_metadata["w"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (4, 0)]
    assert merged.storage_data[MetadataIndex("w", (4, 0))].relative_path == link_name(1, "__1_0.distcp")
    assert merged.storage_data[MetadataIndex("n")].relative_path == link_name(0, "__0_0.distcp"), "the lowest rank's"
    # A chunk both ranks hold (a replicated tensor) is read from the lowest rank only.
    both = merge_metadata({0: metadata(0, (0, 0), (8, 4)), 1: metadata(1, (0, 0), (8, 4))})
    assert len(both.state_dict_metadata["w"].chunks) == 1


@pytest.mark.parametrize(("parts", "match"), [
    ({0: metadata(0, (0, 0), (4, 4)), 1: metadata(1, (4, 0), (4, 4), size=(9, 4))}, r"w: rank 1 saved it as \(9, 4\)"),
    ({0: metadata(0, (0, 0), (4, 4))}, "hold 16 of its 32 elements"),
    ({0: metadata(0, (0, 0), (8, 4)), 1: metadata(1, (0, 0), (4, 4))}, "a chunk at"),
])
def test_metadata_that_does_not_make_one_checkpoint_is_refused_naming_the_tensor(parts: Any, match: str) -> None:
    with pytest.raises(ReshardMismatch, match=match) as err:
        merge_metadata(parts)
    assert err.value.tensor == "w"


def test_an_incompatible_checkpoint_names_step_rank_and_tensor() -> None:
    exc = IncompatibleCheckpoint("Size mismatch between saved torch.Size([192, 256]) and current: "
                                 "torch.Size([384, 256]) for model.blocks.0.weight")
    placed = exc.at(9, 1, "mem@node-0")
    assert placed.tensor == "model.blocks.0.weight" and placed.step == 9 and placed.rank == 1
    assert str(placed).startswith("step 9, rank 1, tensor 'model.blocks.0.weight', copy mem@node-0: Size mismatch")


# ---- real process groups -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(ROWS, COLS, generator=g), "m": torch.randn(ROWS, generator=g),
            "b": torch.randn(COLS, generator=g)}


def _state(mesh: Any, source: dict[str, torch.Tensor]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {"model": {"w": distribute_tensor(source["w"], mesh, [Shard(0)]),
                      "b": distribute_tensor(source["b"], mesh, [Replicate()])},
            "optim": {"exp_avg": distribute_tensor(source["m"], mesh, [Shard(0)]), "step": torch.tensor(9.0)},
            "epoch": 3}


def _leave() -> None:
    """Ends a spawned rank whose work is done and written: at the interpreter's exit C++ destructors
    can still find a gloo thread joinable and abort ("terminate called without an active exception",
    SIGABRT: seen in CI rehearsals even after the barrier and the teardown). ``os._exit`` skips them;
    an exception never gets here, so spawn still reports it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _save(rank: int, port: int, root: str, world: int = OLD) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ftd.training.dcp_io import save_dcp
    from ftd.training.snapshot import Snapshotter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        snap = Snapshotter().snapshot(_state(init_device_mesh("cpu", (world,)), full_state()))
        save_dcp(snap, Path(root) / shard_prefix(JOB, STEP, rank), rank)
        dist.barrier()  # as in _restore: no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    _leave()


class Agent:
    """Records what the restore would tell the catalog."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def record_corrupt(self, *args: Any) -> None:
        self.calls.append(("corrupt", *args))

    def record_gone(self, *args: Any) -> None:
        self.calls.append(("gone", *args))

    def invalidate(self, *args: Any) -> None:
        self.calls.append(("invalidate", *args))

    def fetch_shard(self, request: Any, timeout_s: float = 0.0) -> Any:
        raise AssertionError("every copy is on this node's tiers")


def _restore(rank: int, port: int, roots: list[str], record_json: str, out: str, shape: int, world: int = NEW) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ftd.checkpoints.catalog import from_info
    from ftd.training.restore import Restorer
    from ftd.v1 import checkpoint_pb2

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tiers = [Tier(TierSpec(name, "node-x" if name == "ssd" else "shared", LocalSpec(Path(root))),
                      LocalBackend(Path(root))) for name, root in zip(("ssd", "hdd"), roots, strict=True)]
        agent = Agent()
        restorer = Restorer(JOB, rank, world, "dcp", tiers, agent)  # type: ignore[arg-type]
        zeros = {k: torch.zeros_like(v) for k, v in full_state().items()}
        if shape:
            zeros["w"] = torch.zeros(ROWS + shape, COLS)
        template = _state(init_device_mesh("cpu", (world,)), zeros)
        info = checkpoint_pb2.CheckpointInfo()
        info.ParseFromString(bytes.fromhex(record_json))
        result: dict[str, Any] = {}
        try:
            got = restorer._load_step(info, "cpu", template, True)
            assert got is not None and got[0] == STEP
            want = full_state()
            result["equal"] = torch.equal(template["model"]["w"].full_tensor(), want["w"]) and \
                torch.equal(template["model"]["b"].full_tensor(), want["b"]) and \
                torch.equal(template["optim"]["exp_avg"].full_tensor(), want["m"]) and \
                float(template["optim"]["step"]) == 9.0 and template["epoch"] == 3
            result["local_rows"] = template["model"]["w"].to_local().shape[0]
            result["from"] = restorer.restored_from
        except IncompatibleCheckpoint as exc:
            result["incompatible"] = {"tensor": exc.tensor, "step": exc.step, "message": str(exc)}
        result["calls"] = [list(map(str, c)) for c in agent.calls]
        assert from_info(info).world_size != world
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank tears gloo down while another still talks to it (a SIGABRT at exit on a busy box)
    finally:
        dist.destroy_process_group()
    _leave()


def record_of(root: Path, world: int = OLD) -> CheckpointRecord:
    shards = {}
    for rank in range(world):
        folder = root / shard_prefix(JOB, STEP, rank)
        files = tuple(FileEntry(p.name, p.stat().st_size, crc32c_file(p)) for p in sorted(folder.iterdir()))
        shards[rank] = ShardRecord(rank, sum(f.size for f in files), "c", files,
                                   frozenset({CopyRef("ssd", "node-x"), CopyRef("hdd", "shared")}))
    return CheckpointRecord(JOB, STEP, 1, world, "dcp", 1.0, shards)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    ssd, hdd = tmp_path_factory.mktemp("ssd"), tmp_path_factory.mktemp("hdd")
    mp.start_processes(_save, args=(free_port(), str(ssd)), nprocs=OLD, start_method="spawn")
    shutil.copytree(ssd / JOB, hdd / JOB)  # the same shards on a second tier
    return ssd, hdd


def restore(ssd: Path, hdd: Path, out: Path, shape: int = 0, old: int = OLD, new: int = NEW) -> list[dict[str, Any]]:
    info = to_info(record_of(hdd, old)).SerializeToString().hex()
    mp.start_processes(_restore, args=(free_port(), [str(ssd), str(hdd)], info, str(out), shape, new), nprocs=new,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(new)]


def test_four_ranks_saved_two_ranks_restore_resharded_bit_exact(saved: tuple[Path, Path], tmp_path: Path) -> None:
    ssd, hdd = saved
    results = restore(ssd, hdd, tmp_path)
    for r in results:
        assert r["equal"] and r["local_rows"] == ROWS // NEW and r["calls"] == [], r
    # New rank 0 holds rows 0-5: old ranks 0 and 1 (rows 0-2, 3-5) only, plus the lowest rank's values.
    assert results[0]["from"] == ("resharded from world size 4 to 2; old rank(s) 0: ssd@node-x, 1: ssd@node-x")
    assert results[1]["from"].endswith("old rank(s) 0: ssd@node-x, 2: ssd@node-x, 3: ssd@node-x")


def test_a_corrupt_old_shard_is_recorded_and_read_from_the_next_copy(saved: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    ssd, hdd = saved
    data = ssd / shard_prefix(JOB, STEP, 1) / "__1_0.distcp"
    good = data.read_bytes()
    try:
        data.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        results = restore(ssd, hdd, tmp_path)
    finally:
        data.write_bytes(good)
    assert results[0]["equal"] and "1: hdd@shared" in results[0]["from"]
    assert [c[:4] for c in results[0]["calls"]] == [["corrupt", JOB, str(STEP), "1"]]
    assert "crc32c" in results[0]["calls"][0][-1]
    assert results[1]["equal"] and results[1]["calls"] == [], "rank 1 never reads old rank 1's data"


def test_a_state_of_another_shape_is_incompatible_never_corrupt(saved: tuple[Path, Path], tmp_path: Path) -> None:
    ssd, hdd = saved
    results = restore(ssd, hdd, tmp_path, shape=4)
    for r in results:
        assert r["incompatible"]["step"] == STEP and r["calls"] == [], r
        assert "model.w" in r["incompatible"]["message"]


def test_a_grown_world_reshards_too(tmp_path: Path) -> None:
    ssd, hdd = tmp_path / "ssd", tmp_path / "hdd"
    mp.start_processes(_save, args=(free_port(), str(ssd), 2), nprocs=2, start_method="spawn")
    shutil.copytree(ssd, hdd)
    results = restore(ssd, hdd, tmp_path, old=2, new=3)  # 12 rows: 6 + 6 saved, 4 + 4 + 4 restored
    assert [r["local_rows"] for r in results] == [4, 4, 4] and all(r["equal"] and r["calls"] == [] for r in results)
    assert results[1]["from"] == "resharded from world size 2 to 3; old rank(s) 0: ssd@node-x, 1: ssd@node-x"
