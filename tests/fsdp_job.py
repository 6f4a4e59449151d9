"""A small FSDP2 job for the sharded-checkpoint tests, run as real processes (one per rank, gloo on
CPU): a residual MLP, ``fully_shard`` per block, Adam, dropout (torch's RNG), a python-``random``
jitter on the data and a Stateful data loader, saved through ftd's Checkpointer in DCP form with the
state as ``get_state_dict`` returns it (an ``AppState``).

Every step each rank appends a JSON line to ``--out/rank-<r>.jsonl``: the loss and exact fingerprints
of its local parameter shards and optimizer state; at start, what it restored. ``--crash-after N``:
once step N's save is committed the process SIGKILLs itself (no close, no flush: a crash).

    python tests/fsdp_job.py --job J --steps 6 --out DIR [--crash-after 3]   # RANK, WORLD_SIZE, MASTER_*,
                                                                             # FTD_AGENT_SOCKET set per rank
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from ftd.training import Checkpointer
from ftd.training.cadence import CadencePolicy

WIDTH = 512
BLOCKS = 8  # 8 x (512 x 512 + 512) = 2.1 M parameters


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank builds the same weights; fully_shard keeps each rank's shard
    model = torch.nn.Sequential(*[Block() for _ in range(BLOCKS)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


class AppState:
    """The DCP Stateful of the checkpoint usage (ftd.training.checkpoint)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class Loader:
    """Deterministic synthetic batches with a position: a Stateful data loader."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 * self.rank + self.position)
        self.position += 1
        return torch.randn(16, WIDTH, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


def fingerprint(t: torch.Tensor) -> int:
    """An exact fingerprint of a tensor's bits."""
    local = t.to_local() if hasattr(t, "to_local") else t
    words = local.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) % 1_000_003 + 1
    return int((words * weights).sum()) & 0xFFFFFFFFFFFF


def fingerprints(app: AppState) -> dict[str, int]:
    """Of every local parameter shard and every optimizer state tensor of this rank."""
    out = {}
    for name, p in app.model.named_parameters():
        out[f"p/{name}"] = fingerprint(p)
        for k, v in app.optim.state.get(p, {}).items():
            out[f"o/{name}/{k}"] = fingerprint(v)
    return out


def snapshot_checks(out: Path) -> None:
    """``--checks``, without an agent: what a snapshot of the live FSDP2 state is, that its per-rank DCP
    shards are what a distributed ``dcp.save`` writes, and that it loads in place; written to
    ``out/checks-<rank>.json``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    from ftd.storage_backends.base import crc32c_file
    from ftd.training.dcp_io import load_dcp, save_dcp
    from ftd.training.snapshot import Snapshotter

    rank = dist.get_rank()
    model, optim = build()
    app, loader = AppState(model, optim), Loader(rank)
    for _ in range(2):
        model(loader.next()).square().mean().backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    st = sharded_tensor.rand(spec, 10, 4)
    state: dict[str, Any] = {"app": app, "st": st}
    result: dict[str, Any] = {}
    snap = Snapshotter()
    result["prepared_bytes"] = snap.prepare(state)
    first = snap.snapshot(state)
    result["alloc_after_prepare"] = snap.last_alloc_s
    live = app.state_dict()
    checks = []
    for name, value in first["app"]["model"].items():
        want = live["model"][name]
        checks.append(isinstance(value, DTensor) and value.placements == want.placements
                      and value.device_mesh == want.device_mesh and value.shape == want.shape
                      and value.to_local().shape == want.to_local().shape != want.shape
                      and torch.equal(value.to_local(), want.to_local()))
    result["dtensors_local_and_equal"] = all(checks) and len(checks) == 2 * BLOCKS
    ptrs = [v.to_local().data_ptr() for v in first["app"]["model"].values()]
    second = snap.snapshot(state)
    result["buffers_reused"] = ptrs == [v.to_local().data_ptr() for v in second["app"]["model"].values()]
    result["alloc_second"] = snap.last_alloc_s
    local_st = second["st"].local_shards()
    result["sharded_tensor"] = (type(second["st"]).__name__, [tuple(s.tensor.shape) for s in local_st],
                                torch.equal(local_st[0].tensor, st.local_shards()[0].tensor))
    mine, stock = out / f"mine-{rank}", out / f"stock-{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    save_dcp(second, mine, rank)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True)  # of the live state
    dist.barrier()
    result["files"] = sorted(p.name for p in mine.iterdir())

    def layout(folder: Path) -> dict[str, Any]:
        entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        return {k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
                if isinstance(v, TensorStorageMetadata) else type(v).__name__ for k, v in entries.items()}

    result["like_stock_save"] = layout(mine) == layout(stock)
    if rank == 0:  # the two ranks' chunks tile every sharded tensor's global shape exactly
        parts = [layout(out / f"mine-{r}") for r in range(2)]
        tiled = []
        for key, (size, _) in ((k, v) for k, v in parts[0].items() if isinstance(v, tuple)):
            chunks = {c for p in parts for c in p[key][1]}
            tiled.append(sum(math.prod(sizes) for _, sizes in chunks) == math.prod(size))
        result["chunks_tile_global_shapes"] = all(tiled) and len(tiled) > 4 * BLOCKS
    # In place into a fresh model and an optimizer that never stepped (get_state_dict makes its state).
    model2, optim2 = build()
    app2 = AppState(model2, optim2)
    st2 = sharded_tensor.zeros(spec, 10, 4)
    expected = {p.name: (p.stat().st_size, crc32c_file(p)) for p in mine.iterdir()}
    load_dcp(mine, expected, {"app": app2, "st": st2}, True)
    result["loaded_equal"] = fingerprints(app2) == fingerprints(app) and torch.equal(
        st2.local_shards()[0].tensor, st.local_shards()[0].tensor)
    x = loader.next()
    rng = torch.get_rng_state()
    losses = []
    for m, o in ((model, optim), (model2, optim2)):
        torch.set_rng_state(rng)
        loss = m(x).square().mean()
        loss.backward()  # type: ignore[no-untyped-call]
        o.step()
        losses.append(loss.item())
    result["next_step_equal"] = losses[0] == losses[1] and fingerprints(app2) == fingerprints(app)
    (out / f"checks-{rank}.json").write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="")
    ap.add_argument("--checks", action="store_true", help="the snapshot checks, no agent (snapshot_checks)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--crash-after", type=int, default=-1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    if args.checks:
        snapshot_checks(args.out)
        dist.destroy_process_group()
        return 0
    rank = dist.get_rank()
    random.seed(rank)  # a deterministic job: every generator seeded (torch's in build())
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / f"rank-{rank}.jsonl", "a")  # noqa: SIM115 - open for the whole run

    def emit(**record: Any) -> None:
        log.write(json.dumps({"rank": rank, **record}) + "\n")
        log.flush()

    model, optim = build()
    app, loader = AppState(model, optim), Loader(rank)
    state = {"app": app}
    ckpt = Checkpointer(args.job, format="dcp", cadence=CadencePolicy(1, 1000), dataloader=loader,
                        install_signal_handlers=False)
    restored = ckpt.restore(state)
    if restored is not None:
        ckpt.prepare(state)  # after a restore the optimizer state exists: no side effect
    emit(event="start", restored=-1 if restored is None else restored, source=ckpt.restored_from,
         extra=ckpt.restored_extra, position=loader.position, prints=fingerprints(app))
    for step in range(0 if restored is None else restored + 1, args.steps):
        x = loader.next() * (1.0 + 0.01 * random.random())
        loss = model(x).square().mean()
        optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
        emit(event="step", step=step, loss=loss.item(), prints=fingerprints(app))
        future = ckpt.step_end(step, lambda: state)
        if future is not None:
            emit(event="saved", step=step, alloc_s=ckpt.snapshot_alloc_s)
        if step == args.crash_after:
            result = future.result() if future is not None else None
            ckpt.wait()
            emit(event="crash", step=step, saved=None if result is None else [result.ok, result.tier, result.error])
            dist.barrier()  # both ranks' shards committed before either dies
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    emit(event="done")
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
