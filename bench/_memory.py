"""The memory tier's figures of ``bench/checkpoint.py`` (``--memory-only``): a cluster whose node
directories are on tmpfs, node-0 (rack r0) snapshotting, its buddy node-1 (r1), and a spare.

* per round (:func:`memory_figures`): a memory snapshot on node-0, its replication to node-1 (over
  the bulk path, ``PullReplica``, with the WriteShard stream as the fallback:
  ``mem_replication_bulk_share`` says which was used), raw loopback TCP of the same bytes, and a
  restore by the spare from node-0's memory;
* the training's step time with and without a memory snapshot every step (:func:`step_overhead`):
  a step of ``--step-s`` (1 s) of single-threaded compute — the host side of a GPU step, one core per
  rank — on a state of ``--overhead-mib`` (256 MiB), phases without and with snapshots interleaved in
  the same run (``mem_step_overhead``: the ratio of the medians, minus one), and the save stalls
  after the first (``mem_save_stall_max_vs_median``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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
    its agent replicates to node-1 (r1), which pulls it over node-0's bulk port; the spare node-2,
    holding no copy, restores from a peer's memory (FetchShard: its agent pulls the copy over the
    fast peer copy path); raw loopback TCP of the same bytes in the same rounds; then
    :func:`step_overhead` on the same cluster."""
    from ftd.ftctl.localcluster import stop, up
    from ftd.training import Checkpointer
    from ftd.training.cadence import CadencePolicy
    from ftd.v1 import checkpoint_pb2
    from ftd.waiting import wait_for

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-mem-", dir=args.mem_dir))
    cluster = up(work / "cluster", nodes=2, spares=1, racks=2, shared_hdd=False, unmanaged_jobs=True,
                 extra_agent_args=["--tiering-interval-s", "5"])
    client = cluster.client()
    sockets = {a.name: a.info["socket"] for a in cluster.agents}
    mem0 = Path(next(a for a in cluster.agents if a.name == "node-0").info["workdir"]) / "mem"
    busy = [0, *(a.pid for a in cluster.agents if a.name in ("node-0", "node-2"))]

    metrics_at = {a.name: f"http://{a.info['metrics']}/metrics" for a in cluster.agents}

    def metric(name: str, node: str = "node-2") -> float:
        text = urllib.request.urlopen(metrics_at[node], timeout=5).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def by_path(path: str) -> float:
        return metric(f'ftd_agent_memory_replicated_by_path_total{{path="{path}"}}', "node-0")

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
            bulk_before, stream_before = by_path("bulk"), by_path("stream")
            t = time.perf_counter()
            result = ck.save(step, state, memory=True, durable=False).result()
            assert result.ok, result
            record("mem_snapshot_blocked_s", result.blocked_s)
            record("mem_write_commit_s", result.persist_s)  # torch.save into tmpfs + CRC32C + publish + commit
            # The buddy records its copy (checked, in its memory inventory) before it answers the
            # holder, which counts the path then: replicated. The coordinator learns it with the
            # buddy's next heartbeat (the report is soft state: docs/checkpoints.md), timed apart.
            wait_for(lambda: by_path("bulk") + by_path("stream") > bulk_before + stream_before,  # noqa: B023
                     300, f"step {step} replicated (the holder's count)", interval_s=0.01)
            replicated_s = time.perf_counter() - t - result.blocked_s - result.persist_s
            record("mem_replication_s", replicated_s)  # from the commit to the buddy's record (polled)
            record("mem_replication_gbps", result.bytes / replicated_s / 1e9)
            record("mem_replication_bulk_share", by_path("bulk") - bulk_before)  # 1: pulled over the bulk path
            wait_for(lambda: "mem@node-1" in copies(step), 300, f"step {step}'s copy in the catalog",  # noqa: B023
                     interval_s=0.01)
            record("mem_replication_visible_s", time.perf_counter() - t - result.blocked_s - result.persist_s)
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
        if not args.no_overhead:
            step_overhead(args, sockets["node-0"], record,
                          [0, *(a.pid for a in cluster.agents if a.name in ("node-0", "node-1"))])
    finally:
        client.close()
        stop(cluster)
        shutil.rmtree(work, ignore_errors=True)




def step_overhead(args: argparse.Namespace, agent_socket: str, record: Callable[[str, float], None],
                  pids: list[int]) -> None:
    """A training loop of ``args.step_s`` steps of single-threaded compute (the host side of a GPU
    step: one core per rank), on node-0, with a state of ``args.overhead_mib``: phases of
    ``args.overhead_steps`` steps without snapshots and with a memory snapshot every step (written,
    committed and replicated to the buddy), interleaved ``args.repeat`` times in one run. A step is
    timed whole: the compute, then the save's stall. The first steps of each phase are left out (the
    previous phase's snapshot work is still draining; the first snapshot maps its buffers). The CPU
    seconds per step of this process and the agents of node-0 and node-1 (``pids``), with and
    without snapshots, say what a snapshot costs the box (``mem_step_cpu_with_s``/``_without_s``)."""
    from ftd.training import Checkpointer
    from ftd.training.cadence import CadencePolicy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    out = torch.empty(384, 384)

    def cpu_now() -> list[float]:
        return [_cpu_s([pid]) for pid in pids]

    def record_cpu(phase: str, before: list[float]) -> None:
        """CPU seconds per step of the phase: all of ``pids`` together, then each (training, agents)."""
        after = cpu_now()
        record(f"mem_step_cpu_{phase}_s", (sum(after) - sum(before)) / args.overhead_steps)
        for name, a, b in zip(("training", "holder_agent", "buddy_agent"), after, before, strict=False):
            record(f"mem_step_cpu_{phase}_{name}_s", (a - b) / args.overhead_steps)

    def compute(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            torch.mm(a, b, out=out)
        return time.perf_counter() - started

    try:
        state = make_state(args.overhead_mib << 20)
        n = 20
        for _ in range(3):  # calibrated idle: n matrix products take step_s
            n = max(1, round(n * args.step_s / compute(n)))
        ck = Checkpointer("bench-step", rank=0, world_size=1, agent_socket=agent_socket,
                          install_signal_handlers=False, cadence=CadencePolicy(probe_every_steps=0))
        step = 0
        assert ck.save(step, state, memory=True, durable=False).result().ok  # maps the buffers: not timed
        for _ in range(args.repeat):
            for i in range(args.overhead_steps + 2):
                if i == 2:
                    before = cpu_now()
                took = compute(n)
                if i >= 2:
                    record("mem_step_without_s", took)
            record_cpu("without", before)
            for i in range(args.overhead_steps + 1):
                if i == 1:
                    before = cpu_now()
                started = time.perf_counter()
                compute(n)
                step += 1
                ck.save(step, state, memory=True, durable=False)
                if i >= 1:
                    record("mem_step_with_s", time.perf_counter() - started)
                    record("mem_save_stall_s", ck.last_blocked_s)
            record_cpu("with", before)
        result = ck.wait()
        assert result is not None and result.ok, result
        ck.close()
    finally:
        torch.set_num_threads(threads)
