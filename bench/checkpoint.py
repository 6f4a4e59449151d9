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

The memory tier (``--memory-only`` for just these): a second cluster whose node directories are on
tmpfs (``--mem-dir``, default /dev/shm) with node-0 (rack r0), node-1 (r1) and a spare. Per round:
a memory snapshot on node-0 (``mem_snapshot_blocked_s``: the training loop's stall;
``mem_write_commit_s``: torch.save into the memory tier, CRC32C, publish, commit), its replication to
node-1 (``mem_replication_s``/``_gbps``: from the commit until node-1 held and recorded its copy,
polled on node-0's count, which node-1's answer moves; node-1 pulls it over node-0's bulk port,
``mem_replication_bulk_share`` 1 when it did; ``mem_replication_visible_s``: until the coordinator's
catalog lists the copy, which comes with node-1's next heartbeat, every 0.5 s by default), raw
loopback TCP of the same bytes (``tcp_loopback_gbps``: a plain socket into a buffer touched
beforehand; ``tcp_loopback_fresh_gbps``: into memory mapped as the bytes come), and a restore by the
spare, which holds no copy, from node-0's memory (``mem_restore_peer_s``/``_gbps``: catalog, the
agent's pull over the fast peer copy path, load; ``mem_restore_peer_vs_tcp``: the ratio per round,
median). Like the pre-touched TCP buffer, the spare's agent prepares the room its pull lands in
ahead (its landing reserve, ``ftd.agent.landing``); each restore is timed once that room is ready,
and ``mem_restore_peer_landed_in_reserve`` counts the files that landed in it. Then the step-time
overhead of a memory snapshot every step (``bench/_memory.py``, ``step_overhead``): a ``--step-s``
(1 s) step of single-threaded compute on a ``--overhead-mib`` (256 MiB) state, without and with
snapshots in interleaved phases of the same run: ``mem_step_without_s``, ``mem_step_with_s``,
``mem_step_overhead`` (their medians' ratio minus one), ``mem_save_stall_s`` and
``mem_save_stall_max_vs_median`` (every stall after the first against their median).

Both are CPU-bound on a small box, so the CPU seconds they take are reported next to them
(``tcp_loopback_cpu_s``: both ends of the raw copy; ``mem_restore_peer_cpu_s``: the holder's agent,
the spare's agent and the restoring process) with ``cores``. The restore does work the raw copy does
not and may not skip: AES-GCM on both ends, the holder's CRC32C check of its copy, and landing the
bytes in pages the spare did not hold (tmpfs, which the restoring process then maps). On a box with
fewer cores than those stages, the ratio to the pre-touched TCP copy is bound by the ratio of the
CPU seconds, not by the network.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _memory import make_state, memory_figures, touch

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
    from ftd.waiting import wait_for

    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import boto3

    s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    wait_for(lambda: s3.list_buckets() is not None, 30, "moto server", not_yet=(Exception,))  # still starting
    s3.create_bucket(Bucket="ftd-bench")
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on /tmp's disk)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; every figure is the median of its rounds")
    ap.add_argument("--no-s3", action="store_true", help="skip the cold tier")
    ap.add_argument("--memory-only", action="store_true", help="only the memory tier's figures")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory tier's figures")
    ap.add_argument("--mem-dir", type=Path, default=Path("/dev/shm"),
                    help="a tmpfs where the memory tier's cluster runs (its nodes' memory tiers)")
    ap.add_argument("--no-overhead", action="store_true", help="skip the step-time overhead of snapshots")
    ap.add_argument("--step-s", type=float, default=1.0, help="the simulated training step (compute, one core)")
    ap.add_argument("--overhead-mib", type=int, default=256, help="the state per rank for the step-time overhead")
    ap.add_argument("--overhead-steps", type=int, default=8, help="steps per phase (without, with snapshots)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    state = make_state(int(args.size_gib * (1 << 30)))
    size_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    rounds: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rounds.setdefault(name, []).append(value)

    if not args.memory_only:
        disk_figures(args, state, size_bytes, record)
    if not args.no_memory:
        memory_figures(args, state, record)
    out: dict[str, Any] = {"size_bytes": size_bytes, "rounds": args.repeat, "cores": os.cpu_count()}
    out.update({k: statistics.median(v) for k, v in rounds.items()})
    gb = size_bytes / 1e9
    targets: dict[str, bool] = {}
    if not args.memory_only:
        out["ftd_persist_gbps"] = gb / out["ftd_persist_s"]
        out["ftd_restore_ssd_gbps"] = gb / out["ftd_restore_ssd_s"]
        out["blocked_vs_torch_save"] = out["ftd_save_blocked_s"] / out["torch_save_fsync_s"]
        out["persist_vs_dd_write"] = out["ftd_persist_gbps"] / out["dd_write_gbps"]
        out["restore_ssd_vs_dd_read"] = out["ftd_restore_ssd_gbps"] / out["dd_read_gbps"]
        # The same per round (dd and the restore read back to back: the shared disk's drift cancels), median.
        out["restore_ssd_vs_dd_read_per_round"] = statistics.median(
            gb / s / d for s, d in zip(rounds["ftd_restore_ssd_s"], rounds["dd_read_gbps"], strict=True))
        targets.update({"blocked<=10%": out["blocked_vs_torch_save"] <= 0.10,
                        "persist>=80%dd": out["persist_vs_dd_write"] >= 0.8,
                        "restore>=80%dd": out["restore_ssd_vs_dd_read"] >= 0.8})
    if not args.no_memory:
        # Ratios per round (TCP and the restore measured back to back), then their median.
        out["mem_restore_peer_vs_tcp"] = statistics.median(
            r / t for r, t in zip(rounds["mem_restore_peer_gbps"], rounds["tcp_loopback_gbps"], strict=True))
        out["mem_restore_peer_vs_tcp_fresh"] = statistics.median(
            r / t for r, t in zip(rounds["mem_restore_peer_gbps"], rounds["tcp_loopback_fresh_gbps"], strict=True))
        out["mem_replication_vs_tcp"] = statistics.median(
            r / t for r, t in zip(rounds["mem_replication_gbps"], rounds["tcp_loopback_gbps"], strict=True))
        targets["restore_peer_memory>=70%tcp"] = out["mem_restore_peer_vs_tcp"] >= 0.7
        targets["replication>=1GB/s_or_50%tcp"] = out["mem_replication_gbps"] >= 1.0 or \
            out["mem_replication_vs_tcp"] >= 0.5
        if "mem_step_with_s" in rounds:
            out["mem_step_overhead"] = out["mem_step_with_s"] / out["mem_step_without_s"] - 1
            out["mem_save_stall_max_vs_median"] = max(rounds["mem_save_stall_s"]) / out["mem_save_stall_s"]
            targets["step_overhead<=10%"] = out["mem_step_overhead"] <= 0.10
            targets["save_stall_max<=2x_median"] = out["mem_save_stall_max_vs_median"] <= 2.0
    out["targets_met"] = targets
    out["spread"] = {k: [round(x, 3) for x in v] for k, v in rounds.items()}
    emit(out, args.json)


def disk_figures(args: argparse.Namespace, state: dict[str, Any], size_bytes: int,
                 record: Callable[[str, float], None]) -> None:
    """ftd's save and restore on disk next to dd, torch.save and DCP (one node: SSD, HDD, S3)."""
    from ftd.checkpoints.catalog import from_info
    from ftd.client import CoordinatorClient
    from ftd.ftctl.localcluster import stop, up
    from ftd.training import Checkpointer
    from ftd.v1 import checkpoint_pb2
    from ftd.waiting import wait_for

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-ckpt-", dir=args.dir))
    moto, url = (None, "") if args.no_s3 else start_moto(work)
    cluster = up(work / "cluster", nodes=1, spares=0, s3_endpoint=url, s3_bucket="ftd-bench", unmanaged_jobs=True,
                 extra_agent_args=["--tiering-interval-s", "0.5"])
    client = CoordinatorClient(cluster.coordinator_endpoints, tls=cluster.operator)

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
                rec = from_info(info)
                state2 = ck.restorer.read(s3, rec, rec.shards[0], "cpu", None, True)
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
