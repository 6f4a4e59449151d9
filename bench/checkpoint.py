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
node-1 (``mem_replication_s``/``_gbps``: from the commit until node-1 recorded its copy, polled), raw
loopback TCP of the same bytes (``tcp_loopback_gbps``: a plain socket into a buffer touched
beforehand; ``tcp_loopback_fresh_gbps``: into memory mapped as the bytes come), and a restore by the
spare, which holds no copy, from node-0's memory (``mem_restore_peer_s``/``_gbps``: catalog, the
agent's pull over the fast peer copy path, load; ``mem_restore_peer_vs_tcp``: the ratio per round,
median). Like the pre-touched TCP buffer, the spare's agent prepares the room its pull lands in
ahead (its landing reserve, ``ftd.agent.landing``); each restore is timed once that room is ready,
and ``mem_restore_peer_landed_in_reserve`` counts the files that landed in it.

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
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
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
    cluster = up(work / "cluster", nodes=1, spares=0, s3_endpoint=url, s3_bucket="ftd-bench",
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


# ---- the memory tier -------------------------------------------------------------------------------------

_TCP_SENDER = """
import socket, sys, time
data = memoryview(open(sys.argv[1], "rb").read())
with socket.create_connection(("127.0.0.1", int(sys.argv[2]))) as s:
    cpu = time.process_time()
    for i in range(0, len(data), 1 << 20):
        s.sendall(data[i:i + (1 << 20)])
print(time.process_time() - cpu)
"""


def tcp_loopback_gbps(path: Path, fresh: bool = False) -> tuple[float, float]:
    """Raw loopback TCP of the same bytes: another process sends the file's bytes (read into its memory
    first, untimed) over a plain socket; this one receives them, from accept to the last byte, into a
    buffer allocated and touched beforehand (the network's ceiling) or, ``fresh``, into memory mapped
    when the bytes come (what any restore pays: its bytes land in memory it did not hold before).
    Returns (GB/s, CPU seconds both ends spent moving the bytes)."""
    size = path.stat().st_size
    buf: Any = None if fresh else bytearray(size)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        sender = subprocess.Popen([sys.executable, "-c", _TCP_SENDER, str(path), str(srv.getsockname()[1])],
                                  stdout=subprocess.PIPE)
        conn, _ = srv.accept()
        started, cpu = time.perf_counter(), time.process_time()
        if buf is None:
            buf = mmap.mmap(-1, size)
        view = memoryview(buf)
        got = 0
        with conn:
            while got < size:
                n = conn.recv_into(view[got:got + (1 << 20)])
                if not n:
                    break
                got += n
        took, cpu = time.perf_counter() - started, time.process_time() - cpu
        view.release()
    out, _ = sender.communicate()
    assert got == size, f"received {got} of {size} bytes"
    return size / took / 1e9, cpu + float(out or 0)


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (0 = this one)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        if pid == 0:
            t = os.times()
            total += t.user + t.system
            continue
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def memory_figures(args: argparse.Namespace, state: dict[str, Any], record: Callable[[str, float], None]) -> None:
    """The memory tier on a cluster whose node directories are on tmpfs: node-0 (rack r0) snapshots,
    its agent replicates to node-1 (r1); the spare node-2, holding no copy, restores from a peer's
    memory (FetchShard: its agent pulls the copy over gRPC with mTLS); raw loopback TCP of the same
    bytes in the same rounds."""
    from ftd.ftctl.localcluster import stop, up
    from ftd.training import Checkpointer
    from ftd.training.cadence import CadencePolicy
    from ftd.v1 import checkpoint_pb2
    from ftd.waiting import wait_for

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-mem-", dir=args.mem_dir))
    cluster = up(work / "cluster", nodes=2, spares=1, racks=2, shared_hdd=False,
                 extra_agent_args=["--tiering-interval-s", "5"])
    client = cluster.client()
    sockets = {a.name: a.info["socket"] for a in cluster.agents}
    mem0 = Path(next(a for a in cluster.agents if a.name == "node-0").info["workdir"]) / "mem"
    busy = [0, *(a.pid for a in cluster.agents if a.name in ("node-0", "node-2"))]

    metrics_url = f"http://{next(a for a in cluster.agents if a.name == 'node-2').info['metrics']}/metrics"

    def metric(name: str) -> float:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def landing_ready() -> float:
        return metric("ftd_agent_landing_reserve_bytes")

    def landing_used() -> float:
        return metric("ftd_agent_landing_slots_used_total")

    def copies(step: int) -> set[str]:
        infos = client.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job="bench-mem"),
                            idempotent=True).checkpoints
        info = next((i for i in infos if i.step == step), None)
        return {f"{c.tier}@{c.location}" for s in (info.shards if info else []) for c in s.copies}

    try:
        ck = Checkpointer("bench-mem", rank=0, world_size=1, agent_socket=sockets["node-0"],
                          install_signal_handlers=False, cadence=CadencePolicy())
        first = ck.save(1, state, memory=True, durable=False).result()  # maps the snapshot buffers
        assert first.ok, first
        wait_for(lambda: "mem@node-1" in copies(1), 300, "step 1 replicated", interval_s=0.05)
        for r in range(args.repeat):
            step = 2 + r
            t = time.perf_counter()
            result = ck.save(step, state, memory=True, durable=False).result()
            assert result.ok, result
            record("mem_snapshot_blocked_s", result.blocked_s)
            record("mem_write_commit_s", result.persist_s)  # torch.save into tmpfs + CRC32C + publish + commit
            wait_for(lambda: "mem@node-1" in copies(step), 300, f"step {step} replicated",  # noqa: B023
                     interval_s=0.01)
            replicated_s = time.perf_counter() - t - result.blocked_s - result.persist_s
            record("mem_replication_s", replicated_s)  # from the commit to the buddy's record (polled)
            record("mem_replication_gbps", result.bytes / replicated_s / 1e9)
            shard = mem0 / "bench-mem" / f"step-{step:012d}" / "rank-00000" / "state.pt"
            gbps, cpu = tcp_loopback_gbps(shard)
            record("tcp_loopback_gbps", gbps)
            record("tcp_loopback_cpu_s", cpu)
            record("tcp_loopback_fresh_gbps", tcp_loopback_gbps(shard, fresh=True)[0])
            # The spare prepares room for what it would pull (agent.landing), as the TCP baseline
            # lands in a buffer touched beforehand: the restore is timed once that room is ready.
            size = result.bytes
            wait_for(lambda: landing_ready() >= size, 120, "the spare's landing reserve", interval_s=0.1)  # noqa: B023
            used = landing_used()
            spare = Checkpointer("bench-mem", rank=0, world_size=1, agent_socket=sockets["node-2"],
                                 install_signal_handlers=False)
            t, cpu = time.perf_counter(), _cpu_s(busy)
            loaded = spare.load_latest()
            took, cpu = time.perf_counter() - t, _cpu_s(busy) - cpu
            assert loaded is not None and loaded[0] == step and "pulled" in spare.restored_from, spare.restored_from
            record("mem_restore_peer_s", took)  # catalog + pull (gRPC, mTLS) + CRC32C check + load (mmap)
            record("mem_restore_peer_gbps", result.bytes / took / 1e9)
            record("mem_restore_peer_cpu_s", cpu)  # the holder's agent, the spare's agent, the restoring process
            record("mem_restore_peer_landed_in_reserve", landing_used() - used)  # files received into prepared room
            t = time.perf_counter()
            touch(loaded[1])
            record("mem_restore_peer_touch_s", time.perf_counter() - t)
            del loaded
            spare.close()
        ck.close()
    finally:
        client.close()
        stop(cluster)
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
