"""An FSDP2 training job through ftd: a residual MLP sharded with ``fully_shard`` per block, Adam, the
state checkpointed in DCP format by ftd's Checkpointer as torch's ``get_state_dict`` gives it, a
Stateful data loader, and a ``prepare()`` hook that standby workers run before their assignment.

    ftctl up --workdir /tmp/c --nodes 2 --spares 1 --nproc-per-node 2 --job fsdp2 \\
        --train-cmd "examples/fsdp2_train.py --params 2M --steps 300 --out /tmp/c/run"
    ftctl --workdir /tmp/c drill --kill-node node-1

or under torchrun, with or without ftd (``--no-ftd``: no checkpoints, the uninterrupted baseline):

    torchrun --standalone --nproc-per-node 4 examples/fsdp2_train.py --no-ftd --steps 50 --out /tmp/ref

What runs where (docs/training.md, "Your own script"):

* ``prepare(argv)`` (in a standby, before it has a rank): parses the flags, builds the model on the
  CPU with its initial weights, the data loader at position 0 and the teacher, runs one forward and
  backward pass in eval mode so that the kernels and the autograd code are loaded, and with
  ``--reserve-world W`` reserves the snapshot buffers of one rank of a W-rank world
  (``Snapshotter().reserve``). It needs no process group and creates no Checkpointer (no rank is
  known yet); the optimizer comes after ``fully_shard``, which replaces the parameters.
* ``main(argv, prepared)`` (after the assignment; ``prepared`` is ``None`` under torchrun, or when the
  standby's ``prepare`` failed, and then it calls ``prepare`` itself): the process group, the device
  mesh, ``fully_shard`` per block and of the whole model, Adam, the Checkpointer
  (``format="dcp"``, the data loader as its ``dataloader``) and its restore in place, the snapshot
  buffers laid out (``Checkpointer.prepare``), then the loop.

Every step each rank appends a JSON line to ``--out/<node>-<local rank>.jsonl``: the step, its loss,
a checksum of the bits of its local parameter shards (``params_crc``), its pid and how long its
forward pass, backward pass and optimizer step took (``phases_s``); at the start the
step it restored and from where, with the time of each phase (``prepare_s``, ``pg_s``, ``wrap_s``,
``restore_s``, ``buffers_s``). A recovered run is bit-identical to an uninterrupted one of the same world size:
the data come from the loader's position, dropout from the RNG states the Checkpointer restores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ftd.training import Checkpointer
from ftd.training.cadence import CadencePolicy
from ftd.training.snapshot import Snapshotter

DIMS = (256, 512, 1024, 2048)  # the widths a --params size picks from (hidden = 4 x width)
MIN_BLOCKS = 8  # the widest width that still gives this many blocks; narrower models get fewer


# ---- the model, the data -----------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"2M"`` -> 2_000_000 (K, M, G; a plain number too)."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 2M or 38M") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the model needs at least one parameter")
    return int(value)


def block_params(dim: int) -> int:
    hidden = 4 * dim
    return 2 * dim + (dim * hidden + hidden) + (hidden * dim + dim)  # LayerNorm, fc1, fc2


def snapshot_bytes(params: int, world: int) -> int:
    """About what one rank's snapshot holds: its shards of the parameters and of Adam's two moments
    (float32), with room for FSDP's padding of uneven shards and the small tensors."""
    return math.ceil(12 * params / world * 1.05) + (1 << 20)


def shape_for(params: int) -> tuple[int, int]:
    """``(width, blocks)`` of about ``params`` parameters: the widest width with :data:`MIN_BLOCKS`
    blocks or more (38 M: 18 blocks of 512; 152 M: 18 of 1024), else the narrowest (2 M: 4 of 256)."""
    for dim in reversed(DIMS):
        blocks = round(params / block_params(dim))
        if blocks >= MIN_BLOCKS:
            return dim, blocks
    return DIMS[0], max(1, round(params / block_params(DIMS[0])))


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))
        return x + update


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, blocks: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class SyntheticData(Stateful):
    """Deterministic batches by (position, rank): a teacher network's answers to Gaussian inputs. Its
    position is saved and restored with the step (a DCP ``Stateful``), so a resumed run reads the
    batches an uninterrupted one would have."""

    def __init__(self, dim: int, batch: int, seed: int) -> None:
        self.dim, self.batch, self.seed = dim, batch, seed
        self.position = 0
        g = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(dim, dim, generator=g) / math.sqrt(dim)

    def next_batch(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position * 9973 + rank)
        self.position += 1
        x = torch.randn(self.batch, self.dim, generator=g)
        return x, torch.tanh(x @ self.teacher)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


class AppState(Stateful):
    """The model and optimizer as DCP saves them: torch's ``get_state_dict`` (DTensor shards, with
    their placements and mesh) and ``set_state_dict`` to load in place."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        # get_state_dict creates Adam's state (a step at lr 0) when there is none. Done once here, in
        # every mode, so that a fresh run, a restored one and the --no-ftd baseline take the same path.
        get_state_dict(model, optim)

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optim)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def params_crc(model: nn.Module) -> str:
    """An exact fingerprint of this rank's local parameter shards (their bits, in order)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        words = local.detach().contiguous().flatten().cpu().view(torch.int32).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) % 1_000_003 + 1
        total = (total * 31 + int((words * weights).sum())) & 0xFFFFFFFFFFFF
    return f"{total:012x}"


def plain_dcp_restore(root: Path, state: dict[str, Any]) -> int:
    """The newest complete ``step-N`` folder under ``root`` loaded in place with torch DCP's own reader
    (the baseline: no ftd); -1 when there is none. A folder is complete once DCP wrote its ``.metadata``
    (the coordinator rank writes it last)."""
    import torch.distributed.checkpoint as dcp

    steps = sorted((int(d.name[5:]) for d in root.glob("step-*") if (d / ".metadata").exists()), reverse=True)
    if not steps:
        return -1
    dcp.load(state, checkpoint_id=str(root / f"step-{steps[0]}"))
    return steps[0]


def plain_dcp_save(root: Path, step: int, state: dict[str, Any]) -> None:
    """One synchronous torch DCP save of ``state`` (every rank writes its shard) as ``step-N``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(root / f"step-{step}"))


# ---- prepare and main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fsdp2_train.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_size, default=parse_size("2M"), help="model size, e.g. 2M, 38M")
    ap.add_argument("--steps", type=int, default=200, help="train until this step (exclusive)")
    ap.add_argument("--batch", type=int, default=32, help="rows per rank and step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout after each block (draws from the RNG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-every", type=int, default=1, help="a memory snapshot every N steps")
    ap.add_argument("--persist-every", type=int, default=1000, help="a durable checkpoint every N steps")
    ap.add_argument("--reserve-world", type=int, default=0,
                    help="prepare() reserves the snapshot buffers of a rank of this world size (0: laid out "
                         "after the restore instead)")
    ap.add_argument("--step-time", type=float, default=0.0, help="pace: at least this many seconds per step")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl when CUDA is available, else gloo")
    ap.add_argument("--job", default=os.environ.get("FTD_JOB", "fsdp2"), help="the ftd job id (default: $FTD_JOB)")
    ap.add_argument("--no-ftd", action="store_true", help="no Checkpointer: the uninterrupted baseline")
    ap.add_argument("--plain-dcp", type=Path, default=None,
                    help="with --no-ftd: torch DCP's own save/load to this shared directory every --persist-every "
                         "steps (the torchrun baseline of bench/recovery.py)")
    ap.add_argument("--out", type=Path, required=True, help="directory of the per-rank step records")
    ap.add_argument("--nan-at", type=int, default=-1,
                    help="a fault for tests: rank --nan-rank's loss is NaN at this step, once per job (a marker file "
                         "in --out); the reduce-scatter spreads it to every shard, a rollback undoes it")
    ap.add_argument("--nan-rank", type=int, default=0)
    return ap.parse_args(argv)


@dataclass
class Prepared:
    """What :func:`prepare` built, for :func:`main`."""

    args: argparse.Namespace
    model: ResidualMLP
    data: SyntheticData
    buffers: Snapshotter | None
    prepare_s: float


def prepare(argv: list[str] | None = None) -> Prepared:
    """Everything that needs no rank: run by a standby worker before its assignment."""
    started = time.monotonic()
    args = parse_args(argv)
    dim, blocks = shape_for(args.params)
    torch.manual_seed(args.seed)  # the same initial weights on every rank, as FSDP expects
    model = ResidualMLP(dim, blocks, args.dropout)
    data = SyntheticData(dim, args.batch, args.seed)
    model.eval()  # a warm-up pass without dropout: it draws nothing from the RNG and changes no weight
    model(torch.zeros(2, dim)).sum().backward()
    model.zero_grad(set_to_none=True)
    model.train()
    buffers = None
    if args.reserve_world > 0 and not args.no_ftd:  # the pages touched now, not at the first save
        buffers = Snapshotter()
        buffers.reserve(snapshot_bytes(sum(p.numel() for p in model.parameters()), args.reserve_world))
    return Prepared(args, model, data, buffers, time.monotonic() - started)


class Records:
    """The per-rank JSON lines a test or a benchmark reads."""

    def __init__(self, out: Path, rank: int, world: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.node = os.environ.get("FTD_NODE_ID", "local")
        self.rank, self.world = rank, world
        name = f"{self.node}-{os.environ.get('LOCAL_RANK', '0')}.jsonl"
        self.file: IO[str] = open(out / name, "a")  # noqa: SIM115 - open for the whole run

    def emit(self, **record: Any) -> None:
        self.file.write(json.dumps({"t": time.time(), "node": self.node, "rank": self.rank, "world": self.world,
                                    "pid": os.getpid(), **record}) + "\n")
        self.file.flush()


def main(argv: list[str] | None = None, prepared: Prepared | None = None) -> int:
    booted = time.time()
    ctx = prepared if prepared is not None else prepare(argv)
    args, model, data = ctx.args, ctx.model, ctx.data
    cuda = args.backend == "nccl" or (args.backend == "auto" and torch.cuda.is_available())
    t0 = time.monotonic()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    pg_s = time.monotonic() - t0
    records = Records(args.out, rank, world)
    records.emit(event="boot", booted=booted, prepared=prepared is not None, prepare_s=round(ctx.prepare_s, 4))

    t0 = time.monotonic()
    mesh = init_device_mesh(device.type, (world,))
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_s = time.monotonic() - t0
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    app = AppState(model, optim)
    wrap_s = time.monotonic() - t0
    wrapped = time.time()

    torch.manual_seed(args.seed + 1 + rank)  # dropout's draws, per rank; a restore brings back the saved states
    t0 = time.monotonic()
    state: dict[str, Any] = {"app": app}
    ckpt = None
    start, restored_from, ckpt_init_s = 0, "", 0.0
    if not args.no_ftd:
        ckpt = Checkpointer(args.job, format="dcp", cadence=CadencePolicy(args.memory_every, args.persist_every),
                            dataloader=data, buffers=ctx.buffers)
        ckpt_init_s = time.monotonic() - t0
        restored = ckpt.restore(state)  # in place, DCP; the RNG states and the loader's position too
        if restored is not None:
            start, restored_from = restored + 1, ckpt.restored_from
    elif args.plain_dcp is not None:
        plain_state: dict[str, Any] = {"app": app, "data": data}
        start = plain_dcp_restore(args.plain_dcp, plain_state) + 1
        restored_from = str(args.plain_dcp) if start > 0 else ""
    restore_s = time.monotonic() - t0
    t0 = time.monotonic()
    if ckpt is not None:
        ckpt.prepare(state)  # the snapshot buffers laid out (allocated unless prepare() reserved them)
    buffers_s = time.monotonic() - t0
    records.emit(event="start", restored_step=start - 1, restored_from=restored_from, params_crc=params_crc(model),
                 ddp_ready=wrapped, pg_s=round(pg_s, 4), wrap_s=round(wrap_s, 4), shard_s=round(shard_s, 4),
                 restore_s=round(restore_s, 4), ckpt_init_s=round(ckpt_init_s, 4),
                 restore_phases={k: round(v, 4) for k, v in (ckpt.restore_timings if ckpt else {}).items()},
                 buffers_s=round(buffers_s, 4),
                 params=sum(p.numel() for p in model.parameters()), position=data.position)
    # The straggler detector's evidence: only the optimizer step is this rank's own compute; FSDP's
    # all-gathers and reduce-scatters run inside forward and backward, where a fast rank waits for a
    # slow one (docs/operations.md, "Slow nodes").
    timing = ckpt.timing if ckpt is not None else None
    for step in range(start, args.steps):
        began = time.monotonic()
        x, y = data.next_batch(rank)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        if step == args.nan_at and rank == args.nan_rank and not (args.out / "nan-fired").exists():
            (args.out / "nan-fired").write_text(f"{step}\n")
            records.emit(event="nan_injected", step=step)
            loss = loss * float("nan")
        forward = time.monotonic()
        loss.backward()  # type: ignore[no-untyped-call]
        backward = time.monotonic()
        with timing.compute() if timing is not None else contextlib.nullcontext():
            optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()
        done = time.monotonic()
        records.emit(event="step", step=step, loss=value, params_crc=params_crc(model),
                     phases_s=[round(forward - began, 4), round(backward - forward, 4), round(done - backward, 4)])
        if ckpt is not None:
            ckpt.report_step(step, loss=value)
            ckpt.step_end(step, lambda: state)
        elif args.plain_dcp is not None and (step + 1) % args.persist_every == 0:
            plain_dcp_save(args.plain_dcp, step, {"app": app, "data": data})
        if args.step_time > 0:
            time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    records.emit(event="done", step=args.steps - 1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
