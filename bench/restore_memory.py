"""Restore from the node's own memory at the training shape: a gloo FSDP2 job (a residual MLP,
``fully_shard`` per block, Adam), ``--nproc`` ranks on one node whose memory tier is on tmpfs, saves a
memory snapshot through ftd's Checkpointer (``format="dcp"``, the state as ``get_state_dict`` gives
it); a fresh world (new model, an optimizer that never stepped) then restores it in place.

    python bench/restore_memory.py [--params 38M] [--nproc 2] [--trials 3] [--json]

Per rank and trial:

* ``restore_s``: ``Checkpointer.restore(state)`` end to end (the catalog's target, every file's
  CRC32C, DCP's in-place load, the agreement of the ranks), the optimizer's state already created
  (``get_state_dict`` beforehand, timed apart as ``optim_init_s``); ``restore_gbps``: the shard's
  bytes over it, the figure the issue's target (>= 1 GB/s per rank) is about; ``restore_cpu_s`` /
  ``restore_cpu_gbps``: the CPU time the restoring process spent (on a shared box, what the restore
  costs when it has a core to itself);
* ``verify_s`` / ``signature_s`` / ``load_s``: its parts (:func:`ftd.training.restore.load_shard`:
  the CRC32Cs of the mapped files, left out when the signature's BLAKE3 covers them, i.e. with mTLS;
  the signature check; DCP's load copying straight from them);
* ``local_cpu_gbps`` / ``stock_cpu_gbps``: the same shard read again into the same state (no
  catalog, no agreement; in alternating order), bytes per CPU-second, by ftd (``load_shard``: mapped
  CRC32Cs, mapped DCP load) and by DCP's stock reading (``crc32c_file`` reads, then
  ``FileSystemReader``, which reads every tensor into a fresh allocation before copying it);
* ``optim_init_s``: what ``get_state_dict`` costs on an optimizer that never stepped (torch's
  zero-lr step creating Adam's moments), which a restore into a fresh optimizer pays on top.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, percentile

JOB = "bench-restore"


def parse_params(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def worker(args: argparse.Namespace) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* and FTD_AGENT_SOCKET set by :func:`main`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader, state_dict_loader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from ftd.storage_backends.base import crc32c_file
    from ftd.training import Checkpointer, corruption
    from ftd.training import restore as restore_mod
    from ftd.training.agent_link import AgentUnavailable
    from ftd.waiting import wait_for

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    width = 1024
    blocks = max(1, round(parse_params(args.params) / (width * width + width)))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.linear(x))

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[Block() for _ in range(blocks)])
        for b in model:
            fully_shard(b)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    class AppState:
        def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
            self.model, self.optim = model, optim

        def state_dict(self) -> dict[str, Any]:
            m, o = get_state_dict(self.model, self.optim)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    timed: dict[str, float] = {}
    real_load, real_crc = restore_mod.load_dcp, corruption.crc32c_mapped

    def load_dcp(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_load(*a, **kw)
        finally:
            timed["load_s"] = timed.get("load_s", 0.0) + time.perf_counter() - t

    def crc(path: Path) -> str:
        t = time.perf_counter()
        try:
            return real_crc(path)
        finally:
            timed["verify_s"] = timed.get("verify_s", 0.0) + time.perf_counter() - t

    from ftd.training.checkpoint_signing import ShardSigner

    real_verify = ShardSigner.verify

    def signature(self: ShardSigner, *a: Any, **kw: Any) -> None:
        t = time.perf_counter()
        try:
            real_verify(self, *a, **kw)
        finally:
            timed["signature_s"] = timed.get("signature_s", 0.0) + time.perf_counter() - t

    restore_mod.load_dcp, corruption.crc32c_mapped = load_dcp, crc  # type: ignore[assignment]
    ShardSigner.verify = signature  # type: ignore[method-assign]
    def read_again(how: str, folder: Path, expected: dict[str, tuple[int, str]], app: AppState) -> None:
        """The shard read into ``app`` without the catalog or the agreement: by ftd or by DCP's stock reader."""
        if how == "local":
            restore_mod.load_shard(folder, expected, "dcp", "cpu", {"app": app}, True, in_memory=True)
            return
        for p in folder.iterdir():
            crc32c_file(p)
        state_dict_loader.load({"app": app}, storage_reader=FileSystemReader(str(folder)), no_dist=True)

    model, optim = build()
    model(torch.randn(8, width)).square().mean().backward()  # type: ignore[no-untyped-call]
    optim.step()
    ckpt = wait_for(lambda: Checkpointer(JOB, format="dcp", install_signal_handlers=False), 120,
                    "the agent answering (a loaded box)", not_yet=(AgentUnavailable,))
    results = []
    for trial in range(args.trials):
        saved = ckpt.save(trial, {"app": AppState(model, optim)}, memory=True, durable=False).result()
        assert saved.ok, saved
        # The agent answers a memory commit at once; the coordinator learns of it with the node's next
        # heartbeat (soft state): the restore is timed once the target is this step.
        def target() -> int:
            return int(ckpt.agent.restore_target(JOB, world_size=dist.get_world_size(), fmt="dcp").checkpoint.step)

        wait_for(lambda: target() == trial, 30, f"step {trial} in the restore target")  # noqa: B023
        dist.barrier()
        fresh, fresh_optim = build()
        app = AppState(fresh, fresh_optim)
        t = time.perf_counter()
        app.state_dict()  # creates the optimizer's state (a zero-lr step): timed apart
        optim_init_s = time.perf_counter() - t
        timed.clear()
        dist.barrier()
        t, cpu = time.perf_counter(), time.process_time()
        step = ckpt.restore({"app": app})
        restore_s, restore_cpu_s = time.perf_counter() - t, time.process_time() - cpu
        parts = dict(timed)
        assert step == trial and ckpt.restored_from.startswith("mem@"), (step, ckpt.restored_from)
        folder = next(Path(ckpt.mem.backend.root).glob(f"{JOB}/step-{trial:012d}/rank-{rank:05d}"))  # type: ignore[union-attr]
        expected = {p.name: (p.stat().st_size, crc32c_file(p)) for p in folder.iterdir() if p.name != "SHARD.json"}
        cpu_s: dict[str, float] = {}
        for how in sorted(("stock", "local"), reverse=trial % 2 == 1):
            c = time.process_time()
            read_again(how, folder, expected, app)
            cpu_s[how] = time.process_time() - c
        results.append({"rank": rank, "bytes": saved.bytes, "restore_s": restore_s,
                        "restore_gbps": saved.bytes / restore_s / 1e9, "restore_cpu_s": restore_cpu_s,
                        "restore_cpu_gbps": saved.bytes / restore_cpu_s / 1e9, "optim_init_s": optim_init_s,
                        "stock_cpu_gbps": saved.bytes / cpu_s["stock"] / 1e9,
                        "local_cpu_gbps": saved.bytes / cpu_s["local"] / 1e9, **parts})
    ckpt.close()
    print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="38M", help="model parameters (K/M/G), sharded over the ranks")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--mem-dir", type=Path, default=Path("/dev/shm"), help="a tmpfs for the node's memory tier")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from ftd.ftctl.localcluster import stop, up

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-restore-", dir=args.mem_dir))
    cluster = up(work / "cluster", nodes=1, spares=0, shared_hdd=False, unmanaged_jobs=True)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sock = cluster.agents[0].info["socket"]
        procs = [subprocess.Popen(
            [sys.executable, __file__, "--worker", "--params", args.params, "--trials", str(args.trials)],
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "FTD_AGENT_SOCKET": sock},
            stdout=subprocess.PIPE, text=True) for r in range(args.nproc)]
        rows: list[dict[str, Any]] = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
            rows += json.loads(out.strip().splitlines()[-1])
    finally:
        stop(cluster)
        shutil.rmtree(work, ignore_errors=True)  # tmpfs: memory until removed
    result: dict[str, Any] = {"params": args.params, "nproc": args.nproc, "trials": args.trials,
                              "shard_mb_per_rank": round(rows[0]["bytes"] / 1e6, 1)}
    for key in ("restore_s", "restore_gbps", "restore_cpu_s", "restore_cpu_gbps", "verify_s", "signature_s", "load_s",
                "local_cpu_gbps", "stock_cpu_gbps", "optim_init_s"):
        values = [r[key] for r in rows if key in r]
        result[f"{key}_p50"] = percentile(values, 50)
        result[f"{key}_best"] = (max(values) if key.endswith("gbps") else min(values)) if values else None
    result["load_avg_1m"] = os.getloadavg()[0]  # a shared box: what else ran
    emit(result, args.json)


if __name__ == "__main__":
    main()
