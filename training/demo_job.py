"""A small real DDP job for ``ftctl demo`` and the end-to-end tests (run under torchrun + ftd):
an MLP learning a fixed linear map from synthetic data, gloo on CPU, a checkpoint every K steps.

Every step each rank appends a JSON line to ``--out/<node>-<local rank>.jsonl``: the step, the loss,
a CRC32C of its parameters, its pid, the step it restored from. The tests read those lines to check
that training resumed at the latest valid step, that all ranks hold identical parameters, and that the
loss keeps decreasing.

**Exact recovery, checked**: the batches come from a Stateful loader (:class:`Batches`, its position
saved with every checkpoint: ``Checkpointer(dataloader=...)``) and are jittered with torch's global RNG
(its state saved and restored with the step), so a resumed run is bit-identical to an uninterrupted
one. The job checks it on itself: the steps a new world runs again (those after the step it restored,
which the old world had run) must give the same loss, parameters and RNG state as the old world's
lines in ``--out`` (each step line's ``replay``: ``null`` for a step run the first time, else whether
it matched; :func:`replay_mismatches` lists the ones that did not).

    torchrun ... -m ftd.training.demo_job --steps 400 --ckpt-every 10 --out /tmp/run

With ``--memory-every N`` the job follows a save cadence instead (:class:`ftd.training.cadence.CadencePolicy`,
through :meth:`Checkpointer.step_end`): a memory snapshot every N steps (replicated by the agent to its
buddy node) and a durable checkpoint every ``--persist-every`` steps or ``--persist-every-s`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ftd.training import Checkpointer, replica_fingerprint
from ftd.training.cadence import CadencePolicy

FEATURES = 32


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank starts from the same weights, as DDP expects
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(step: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank): a resumed run sees the same data it would have seen."""
    g = torch.Generator().manual_seed(1000 + step * 131 + rank)
    x = torch.randn(size, FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)
    return x, x @ w + 0.01 * torch.randn(size, 1, generator=g)


class Batches:
    """The job's data loader: batch ``position`` of this rank next, jittered with torch's global RNG
    (so that a resume is exact only if the RNG state came back with the step). A DCP Stateful."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(self.position, self.rank)
        self.position += 1
        return x + 0.001 * torch.randn_like(x), y

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def skip_batches(self, steps: int) -> None:
        """A rollback past a bad step skips the data that led to it (one batch per step here)."""
        self.position += steps


def rng_crc() -> str:
    """A fingerprint of torch's global RNG state."""
    state = torch.get_rng_state().to(torch.int64)
    return f"{int((state * torch.arange(1, state.numel() + 1)).sum()) & 0xFFFFFFFFFFFF:012x}"


def earlier_steps(out: Path, rank: int, world: int, restored: int,
                  restored_crc: str) -> dict[int, tuple[float, str, str]]:
    """step -> (loss, params_crc, rng) of the steps after ``restored`` that this rank already ran in an
    earlier world of this size *from the same point*: a process whose line for step ``restored`` has
    the parameters just restored (the lines in ``out``; the reference a replayed step must match)."""
    runs: dict[int, dict[int, tuple[float, str, str]]] = {}
    for path in out.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if r.get("event") == "step" and r.get("rank") == rank and r.get("world") == world and "rng" in r:
                runs.setdefault(r["pid"], {})[int(r["step"])] = (r["loss"], r["params_crc"], r["rng"])
    for steps in runs.values():
        if restored in steps and steps[restored][1] == restored_crc:
            return {s: v for s, v in steps.items() if s > restored}
    return {}


def replay_mismatches(records: list[dict[str, Any]]) -> list[str]:
    """The replayed steps (run again after a recovery) whose loss, parameters or RNG differed from
    the first run's: empty when every recovery was exact."""
    return [f"rank {r['rank']} step {r['step']} (pid {r['pid']})" for r in records
            if r.get("event") == "step" and r.get("replay") is False]


def params_crc(model: torch.nn.Module) -> str:
    """An exact fingerprint of the parameters' bits (torch alone: numpy is not a dependency)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).contiguous()
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64) % 1_000_003 + 1
    return f"{int((words * weights).sum()) & 0xFFFFFFFFFFFF:012x}"


def flip_a_bit(model: torch.nn.Module) -> None:
    """Flips bit 4 of the first parameter's first float32 (a relative change near 1e-6: silent)."""
    first = next(model.parameters())
    with torch.no_grad():
        first.view(-1)[:1].view(torch.int32).bitwise_xor_(16)


class NoTimer:
    """The plain baseline times nothing (it has no coordinator to tell)."""

    def compute(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def data(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


class PlainCheckpoints:
    """What a job without ftd does (the baseline of bench/recovery.py): every rank torch.saves its
    state to a shared directory; a step counts once every rank's file is there."""

    def __init__(self, root: Path, rank: int, world: int) -> None:
        self.root, self.rank, self.world = root, rank, world
        root.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        path = self.root / f"step-{step:09d}-rank-{self.rank}.pt"
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def load_latest(self, replicated: bool = True) -> tuple[int, Any] | None:
        steps: dict[int, int] = {}
        for p in self.root.glob("step-*-rank-*.pt"):
            step = int(p.name.split("-")[1])
            steps[step] = steps.get(step, 0) + 1
        complete = sorted(s for s, n in steps.items() if n >= self.world)
        if not complete:
            return None
        step = complete[-1]
        return step, torch.load(self.root / f"step-{step:09d}-rank-{self.rank % self.world}.pt", weights_only=True)

    def report_step(self, step: int, loss: float | None = None, fingerprint: int | None = None) -> None:
        pass

    @property
    def restored_from(self) -> str:
        return ""

    def should_stop(self, step: int) -> bool:
        return False  # no agent tells a plain job about a hand-over

    def step_end(self, step: int, state_fn: Any) -> None:
        pass

    def hand_over(self, step: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def finish_line(path: Path, default: int) -> int:
    """The step written in ``path`` (the same for every rank: written once, atomically, by whoever ends
    the job, above every rank's current step), or ``default`` while there is none."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return default


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--step-time", type=float, default=0.1, help="seconds per step (paces the demo)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plain-ckpt", type=Path, default=None,
                    help="baseline mode without ftd: per-rank torch.save under this dir (bench/recovery.py)")
    ap.add_argument("--memory-every", type=int, default=0,
                    help="a memory snapshot every N steps, by the save cadence (0: --ckpt-every saves only)")
    ap.add_argument("--persist-every", type=int, default=1000, help="with --memory-every: durable every N steps")
    ap.add_argument("--persist-every-s", type=float, default=0.0, help="with --memory-every: durable every S seconds")
    ap.add_argument("--work", type=int, default=0,
                    help="extra compute per step: this many 256x256 matmuls (about 0.5 ms each on one core), timed "
                         "as the step's compute with the forward pass (what the straggler detector compares)")
    ap.add_argument("--nan-at", type=int, default=-1,
                    help="a fault for tests: the loss of rank --nan-rank becomes NaN at this step (it poisons the "
                         "model from there on, as a real NaN does); a transient fault: once per job (a marker file "
                         "in --out), so a rollback's rerun of the step is clean")
    ap.add_argument("--nan-rank", type=int, default=0)
    ap.add_argument("--fingerprint-every", type=int, default=0,
                    help="report a replica fingerprint of the parameters every N steps (0: never)")
    ap.add_argument("--bitflip-at", type=int, default=-1,
                    help="a fault for tests: a silent data corruption; one low mantissa bit of a parameter of rank "
                         "--bitflip-rank flips after this step's update (once per job: a marker file in --out); the "
                         "loss stays plausible, only the replica fingerprints can tell")
    ap.add_argument("--bitflip-rank", type=int, default=0)
    ap.add_argument("--finish-file", type=Path, default=None,
                    help="a finish line: once this file holds a step number, every rank stops after that step "
                         "(a test or chaos scenario ends the job when it has seen what it needs)")
    args = ap.parse_args(argv)
    cadence = CadencePolicy(args.memory_every, args.persist_every, args.persist_every_s) if args.memory_every else None
    booted = time.time()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node = os.environ.get("FTD_NODE_ID", "local")
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / f"{node}-{local_rank}.jsonl", "a")  # noqa: SIM115 - open for the whole run

    def emit(**record: Any) -> None:
        log_file.write(json.dumps({"t": time.time(), "node": node, "rank": rank, "world": world,
                                   "pid": os.getpid(), **record}) + "\n")
        log_file.flush()

    emit(event="boot", booted=booted)
    model = model_of()
    ddp = DistributedDataParallel(model)
    ddp_ready = time.time()  # the constructor broadcasts the parameters (and may import torch._dynamo)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = Batches(rank)
    ckpt: Checkpointer | PlainCheckpoints = (
        PlainCheckpoints(args.plain_ckpt, rank, world) if args.plain_ckpt
        else Checkpointer(os.environ.get("FTD_JOB", "demo"), cadence=cadence, dataloader=batches))
    start = 0
    restored = ckpt.load_latest(replicated=True)  # the RNG states and the loader's position come back too
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = step + 1
        if args.plain_ckpt:
            batches.position = start  # a plain job keeps no loader position: the step is all it has
    earlier = earlier_steps(args.out, rank, world, start - 1, params_crc(model)) if restored is not None else {}
    emit(event="start", restored_step=restored[0] if restored else -1, params_crc=params_crc(model),
         restored_from=ckpt.restored_from, ddp_ready=ddp_ready, position=batches.position)
    last = args.steps - 1
    timing = ckpt.timing if isinstance(ckpt, Checkpointer) else NoTimer()
    work = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    for step in range(start, args.steps):
        if args.finish_file is not None and last == args.steps - 1:
            last = min(last, finish_line(args.finish_file, last))
        if step > last:
            break
        with timing.data():
            x, y = batches.next()
        with timing.compute():
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if step == args.nan_at and rank == args.nan_rank and not (args.out / "nan-fired").exists():
                (args.out / "nan-fired").write_text(f"{step}\n")
                emit(event="nan_injected", step=step)
                loss = loss * float("nan")
            for _ in range(args.work):
                work @ work  # the compute a GPU kernel would do
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step == args.bitflip_at and rank == args.bitflip_rank and not (args.out / "bitflip-fired").exists():
            (args.out / "bitflip-fired").write_text(f"{step}\n")
            flip_a_bit(model)
            emit(event="bitflip_injected", step=step)
        due = args.fingerprint_every > 0 and step % args.fingerprint_every == 0
        ckpt.report_step(step, loss=loss.item(), fingerprint=replica_fingerprint(model.parameters()) if due else None)
        mine = (loss.item(), params_crc(model), rng_crc())
        timed = getattr(timing, "last", None)
        emit(event="step", step=step, loss=mine[0], params_crc=mine[1], rng=mine[2],
             replay=None if step not in earlier else earlier[step] == mine,
             compute_ms=round(timed.compute_s * 1e3, 2) if timed is not None else None)
        if ckpt.should_stop(step):  # a planned hand-over: a final checkpoint of this very step
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
            emit(event="handover", step=step)
            ckpt.hand_over(step)  # the agent stops this process once the new world is committed
        if cadence is not None:
            ckpt.step_end(step, lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})  # noqa: B023
        elif step % args.ckpt_every == 0:
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
        time.sleep(args.step_time)
    ckpt.wait()
    emit(event="done", step=last)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
