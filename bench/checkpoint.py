"""Checkpoint save/restore: ftd next to raw dd, torch.save and torch DCP, in one run, on the same state
dict (model + Adam-like optimizer state) and the same disk.

    python bench/checkpoint.py --size-gib 1 [--dir DIR] [--json]

Starts a real local cluster (etcd, coordinator, one agent whose SSD tier is under --dir) and moto's
S3 server for the cold tier. Reads are made cold by evicting the files from the page cache
(posix_fadvise DONTNEED) before each timed read, for dd and ftd alike. The disk here is noisy (2x):
every figure is the median of ``--repeat`` interleaved rounds, and the timed ftd save starts only
once the background tiering of the previous step has finished (on this box SSD, HDD and S3 share
one disk; on a real node they do not).
Prints {"size_bytes", "dd_write_gbps", "dd_read_gbps", "torch_save_fsync_s", "dcp_save_s",
"dcp_async_blocked_s", "ftd_save_blocked_s", "ftd_save_total_s", "ftd_restore_ssd_s",
"ftd_restore_s3_s", ...} plus the derived ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import emit


def evict(path: Path) -> None:
    """Drops a file's (or a tree's) clean pages from the page cache so the next read hits the disk."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_state(size_bytes: int) -> dict[str, Any]:
    n = size_bytes // 4 // 3  # float32 params + exp_avg + exp_avg_sq
    chunk = 16 << 20
    params = {f"layer{i}.weight": torch.randn(min(chunk, n - i * chunk)) for i in range((n + chunk - 1) // chunk)}
    adam = {k: {"step": torch.tensor(100.0), "exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
            for k, v in params.items()}
    optim = {"state": adam, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}]}
    return {"model": params, "optim": optim, "step": 100}


def touch(obj: Any) -> float:
    """Reads every byte of every tensor (a restore is only done when the data is in memory)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.float().sum()) if obj.numel() else 0.0
    if isinstance(obj, dict):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch(v) for v in obj)
    return 0.0


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd(work: Path, size_bytes: int) -> tuple[float, float]:
    f = work / "dd.bin"
    count = max(1, size_bytes // (16 << 20))
    w = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fsync"],
                                     check=True, capture_output=True))
    evict(f)
    r = timed(lambda: subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M"], check=True, capture_output=True))
    f.unlink()
    gb = count * (16 << 20) / 1e9
    return gb / w, gb / r


def torch_save_fsync(work: Path, state: Any) -> float:
    f = work / "torch.pt"

    def save() -> None:
        with open(f, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())

    s = timed(save)
    f.unlink()
    return s


def dcp_times(work: Path, state: Any) -> tuple[float, float, float]:
    from torch.distributed.checkpoint import state_dict_saver

    d = work / "dcp"
    sync_s = timed(lambda: state_dict_saver.save(state, checkpoint_id=str(d), no_dist=True))
    shutil.rmtree(d)
    d2 = work / "dcp_async"
    t = time.perf_counter()
    future = state_dict_saver.async_save(state, checkpoint_id=str(d2), no_dist=True)
    blocked = time.perf_counter() - t
    (future.result() if hasattr(future, "result") else future.upload_completion.result())  # type: ignore[union-attr]
    total = time.perf_counter() - t
    shutil.rmtree(d2)
    return sync_s, blocked, total


def start_moto(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from ftd.ftctl.etcd_server import free_port
    from ftd.testing import wait_for

    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    wait_for(lambda: s3.list_buckets() is not None, 30, "moto server")
    s3.create_bucket(Bucket="ftd-bench")
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on /tmp's disk)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; every figure is the median of its rounds")
    ap.add_argument("--no-s3", action="store_true", help="skip the cold tier")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-ckpt-", dir=args.dir))
    state = make_state(int(args.size_gib * (1 << 30)))
    size_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    gb = size_bytes / 1e9

    from ftd.checkpoints.catalog import from_info
    from ftd.coordinator.client import CoordinatorClient
    from ftd.ftctl.localcluster import stop, up
    from ftd.testing import wait_for
    from ftd.training import Checkpointer
    from ftd.v1 import checkpoint_pb2

    moto, url = (None, "") if args.no_s3 else start_moto(work)
    cluster = up(work / "cluster", nodes=1, spares=0, s3_endpoint=url, s3_bucket="ftd-bench",
                 extra_agent_args=["--tiering-interval-s", "0.5"])
    client = CoordinatorClient(cluster.coordinator_endpoints)
    rounds: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rounds.setdefault(name, []).append(value)

    def settled(step: int) -> Any:
        """Background tiering of ``step`` finished: no migration competes with the timed runs."""
        infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="bench"),
                            idempotent=True).checkpoints
        info = next((i for i in infos if i.step == step), None)
        return info if info is not None and info.on_tier["hdd"] and (args.no_s3 or info.on_tier["s3"]) else None

    try:
        ck = Checkpointer("bench", rank=0, world_size=1, agent_socket=cluster.agents[0].info["socket"],
                          install_signal_handlers=False)
        record("ftd_save_blocked_first_s", timed(lambda: ck.save(1, state)))
        ck.wait()
        wait_for(lambda: settled(1), 900, "step 1 tiered", interval_s=0.2)
        for r in range(args.repeat):
            w, rd = dd(work, size_bytes)
            record("dd_write_gbps", w)
            record("dd_read_gbps", rd)
            record("torch_save_fsync_s", torch_save_fsync(work, state))
            sync_s, blocked_s, total_s = dcp_times(work, state)
            record("dcp_save_s", sync_s)
            record("dcp_async_blocked_s", blocked_s)
            record("dcp_async_total_s", total_s)
            step = 2 + r
            t = time.perf_counter()
            ck.save(step, state)
            record("ftd_save_blocked_s", time.perf_counter() - t)
            result = ck.wait()
            record("ftd_save_total_s", time.perf_counter() - t)
            assert result is not None and result.ok, result
            record("ftd_persist_s", result.persist_s)
            evict(ck.ssd.backend.root / "bench" / f"step-{step:012d}")  # type: ignore[attr-defined]
            t = time.perf_counter()
            loaded = ck.load_latest()
            record("ftd_restore_ssd_s", time.perf_counter() - t)
            assert loaded is not None and loaded[0] == step
            t = time.perf_counter()
            touch(loaded[1])  # the mapped tensors read from memory: part of "restored", reported apart
            record("ftd_restore_ssd_touch_s", time.perf_counter() - t)
            del loaded
            info = wait_for(lambda: settled(step), 900, f"step {step} tiered", interval_s=0.2)  # noqa: B023
            if not args.no_s3:
                s3 = next(tier for tier in ck.tiers if tier.name == "s3")
                t = time.perf_counter()
                record = from_info(info)
                state2 = ck._read(s3, record, record.shards[0], "cpu", None, True)
                record("ftd_restore_s3_s", time.perf_counter() - t)
                del state2
        ck.close()
    finally:
        client.close()
        stop(cluster)
        if moto is not None:
            moto.kill()
            moto.wait()
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"size_bytes": size_bytes, "rounds": args.repeat}
    out.update({k: statistics.median(v) for k, v in rounds.items()})
    out["ftd_persist_gbps"] = gb / out["ftd_persist_s"]
    out["ftd_restore_ssd_gbps"] = gb / out["ftd_restore_ssd_s"]
    out["blocked_vs_torch_save"] = out["ftd_save_blocked_s"] / out["torch_save_fsync_s"]
    out["persist_vs_dd_write"] = out["ftd_persist_gbps"] / out["dd_write_gbps"]
    out["restore_ssd_vs_dd_read"] = out["ftd_restore_ssd_gbps"] / out["dd_read_gbps"]
    out["targets_met"] = {"blocked<=10%": out["blocked_vs_torch_save"] <= 0.10,
                          "persist>=80%dd": out["persist_vs_dd_write"] >= 0.8,
                          "restore>=80%dd": out["restore_ssd_vs_dd_read"] >= 0.8}
    out["spread"] = {k: [round(x, 3) for x in v] for k, v in rounds.items()}
    emit(out, args.json)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
