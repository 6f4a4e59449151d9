"""How many agents one coordinator holds: lightweight simulated agents over real gRPC, a real etcd and
a real coordinator process.

    python bench/coordinator_scale.py --agents 1000 --duration 30 [--agents 2000,5000 ...] [--json]
    python bench/coordinator_scale.py --agents 1000 --duration 10 --compare-tls   # plaintext, then mTLS

Simulated agents run as asyncio tasks in ``--procs`` worker processes: each registers (1 % as
spares), opens a heartbeat stream and sends at ``--hz``. During the measured window ``--kills``
agents "die": half close their stream (what a SIGKILL looks like to the coordinator), half go
silent with the stream open (a hung node). Detection latency = the coordinator's ``node_dead`` event
time minus the death time (same host clock). Any other node declared dead is a false positive.

Prints, per N: {"agents", "heartbeat_hz", "p99_detection_s", "false_positives", "etcd_writes_per_s",
"coordinator_cpu_pct", "tick_p99_ms", ...}.

``--tls``: the coordinator serves mutual TLS with the authorization table enforced (every heartbeat
message is checked), and every simulated agent has its own ``node/<id>`` certificate of a fresh PKI and
its own channel, as real agents do. ``--compare-tls`` runs each N plaintext and then with ``--tls`` in
the same invocation, both with one channel per agent, and adds the relative cost
(``tls_cpu_us_per_heartbeat_ratio``). The etcd is plaintext in both: heartbeats never touch it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from ftd import rpc
from ftd.ca import bootstrap, issue
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.ftctl.localcluster import _spawn, _wait_file
from ftd.identity import DEFAULT_OPERATOR, IdentityFiles, paths
from ftd.v1 import cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

from _common import cpu_seconds, delta, emit, percentile, scrape

CLUSTER = "bench"
_OPTIONS = [("grpc.max_concurrent_streams", 100_000)]


async def _agents(endpoint: str, ids: list[str], spares: set[str], hz: float, start_at: float, kill_at: float,
                  victims: dict[str, str], stop_at: float, out: Any, pki_dir: str | None = None,
                  per_agent: bool = False) -> None:
    shared = aio.insecure_channel(endpoint, options=_OPTIONS)
    channels: list[aio.Channel] = [shared]
    died: dict[str, float] = {}
    errors = 0
    kinds: dict[str, int] = {}

    def count(phase: str, exc: BaseException) -> None:
        nonlocal errors
        errors += 1
        code = rpc.rpc_code(exc)
        key = f"{phase}:{code.name if code else type(exc).__name__}"
        if key not in kinds:  # the first of each kind, with its details
            print(f"simulated agent {phase} failed: {rpc.describe(exc)}", file=sys.stderr)
        kinds[key] = kinds.get(key, 0) + 1

    def stub_for(node_id: str) -> coordinator_pb2_grpc.CoordinatorStub:
        if not per_agent and pki_dir is None:
            return coordinator_pb2_grpc.CoordinatorStub(shared)
        tls = IdentityFiles(Path(pki_dir), "node", node_id) if pki_dir is not None else None
        channels.append(rpc.aio_channel(endpoint, _OPTIONS, tls=tls))
        return coordinator_pb2_grpc.CoordinatorStub(channels[-1])

    async def one(node_id: str) -> None:
        stub = stub_for(node_id)
        inc = f"sim-{node_id}"
        role = cluster_pb2.ROLE_SPARE if node_id in spares else cluster_pb2.ROLE_ACTIVE
        for _ in range(20):
            try:
                await stub.Register(coordinator_pb2.RegisterRequest(
                    node_id=node_id, host="127.0.0.1", role=role, agent_address="127.0.0.1:1", pid=1,
                    incarnation=inc), timeout=30)
                break
            except grpc.RpcError as exc:
                count("register", exc)
                await asyncio.sleep(0.5)
        await asyncio.sleep(random.random() / hz)  # spread the phases; heartbeat from registration on
        call = stub.Heartbeat()

        async def read() -> None:
            try:
                async for _ in call:
                    pass
            except (grpc.RpcError, asyncio.CancelledError):
                pass

        reader = asyncio.create_task(read())
        seq = 0
        mode = victims.get(node_id)
        try:
            while time.time() < stop_at:
                if mode and time.time() >= kill_at:
                    died[node_id] = time.time()
                    if mode == "close":
                        call.cancel()
                        return
                    await asyncio.sleep(max(0.0, stop_at - time.time()))  # hung: silent, stream open
                    return
                seq += 1
                await call.write(coordinator_pb2.HeartbeatRequest(node_id=node_id, incarnation=inc, seq=seq,
                                                                  known_epoch=0))
                await asyncio.sleep(1.0 / hz)
        except (grpc.RpcError, asyncio.CancelledError) as exc:
            count("heartbeat", exc)
        finally:
            reader.cancel()
            if not call.done():
                call.cancel()

    await asyncio.gather(*(one(n) for n in ids))
    for channel in channels:
        await channel.close()
    out.put({"died": died, "errors": errors, "kinds": kinds})


def _worker(*args: Any) -> None:
    asyncio.run(_agents(*args))


def run_one(n: int, duration: float, hz: float, procs: int, kills: int, work: Path, tls: bool = False,
            per_agent: bool = False) -> dict[str, Any]:
    mode = "tls" if tls else "plaintext"
    ids = [f"sim-{i:05d}" for i in range(n)]
    pki_dir: Path | None = None
    tls_args: list[str] = []
    if tls:
        pki_dir = work / f"pki-{n}"
        bootstrap(pki_dir, CLUSTER, nodes=(), coordinators=["c0"])
        for node_id in ids:
            if not paths(pki_dir, "node", node_id)[0].exists():
                issue(pki_dir, "node", node_id)
        tls_args = ["--pki-dir", str(pki_dir), "--replica-id", "c0", "--cluster", CLUSTER]
    etcd = EtcdCluster(work / f"etcd-{n}-{mode}", size=1).start()
    ready = work / f"coord-{n}-{mode}.json"
    log = work / f"coord-{n}-{mode}.log"
    coord = _spawn([sys.executable, "-m", "ftd.coordinator.main", "--etcd-endpoints", etcd.endpoints,
                    "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready),
                    "--log-level", "WARNING", "--failover-grace-s", "2", *tls_args], log)
    operator = IdentityFiles(pki_dir, "operator", DEFAULT_OPERATOR) if pki_dir is not None else None
    try:
        info = _wait_file(ready, coord, time.monotonic() + 30, log)
        spares = set(ids[:: 100])
        candidates = [i for i in ids if i not in spares]
        chosen = random.sample(candidates, min(kills, len(candidates)))
        victims = {node: ("close" if k % 2 == 0 else "hang") for k, node in enumerate(chosen)}
        warmup = max(10.0, n / 500.0)  # registration of N agents is N guarded etcd writes
        start_at = time.time() + warmup
        kill_at = start_at + 5.0 + duration / 2
        stop_at = start_at + 5.0 + duration
        queue: Any = mp.Queue()
        workers = [mp.Process(target=_worker, args=(info["address"], ids[i::procs], spares, hz, start_at, kill_at,
                                                     victims, stop_at, queue,
                                                     str(pki_dir) if pki_dir is not None else None, per_agent))
                   for i in range(procs)]
        for w in workers:
            w.start()
        time.sleep(max(0.0, start_at + 5.0 - time.time()))  # all streams up, steady state
        m0, c0, t0 = scrape(info["metrics"]), cpu_seconds(coord.pid), time.monotonic()
        time.sleep(max(0.0, stop_at - time.time() - 0.5))
        m1, c1, t1 = scrape(info["metrics"]), cpu_seconds(coord.pid), time.monotonic()
        events = _events(info["address"], operator)  # before the simulated agents stop (then all would die)
        results = [queue.get(timeout=120) for _ in workers]
        for w in workers:
            w.join(timeout=30)
        died: dict[str, float] = {}
        for r in results:
            died.update(r["died"])
        dead_at = {e.node_id: e.at_unix_s for e in reversed(events) if e.kind == "node_dead"}
        latencies = [dead_at[v] - died[v] for v in victims if v in dead_at and v in died]
        missed = [v for v in victims if v not in dead_at]
        false_pos = [nid for nid in dead_at if nid not in victims]
        window = t1 - t0
        hb = delta(m0, m1, "ftd_coordinator_heartbeats_received_total")
        writes = delta(m0, m1, "ftd_coordinator_etcd_writes_total")
        ticks = delta(m0, m1, "ftd_coordinator_tick_duration_seconds_count")
        tick_sum = delta(m0, m1, "ftd_coordinator_tick_duration_seconds_sum")
        return {
            "agents": n, "transport": "mTLS + authorization" if tls else "plaintext",
            "channels": "one per agent" if per_agent or tls else "one per process",
            "target_hz": hz, "heartbeat_hz": round(hb / window, 1),
            "heartbeat_ratio": round(hb / window / (n * hz), 3),
            "p50_detection_s": _r(percentile(latencies, 50)), "p99_detection_s": _r(percentile(latencies, 99)),
            "detected": len(latencies), "missed": len(missed), "false_positives": len(false_pos),
            "etcd_writes_per_s": round(writes / window, 3), "etcd_writes_in_window": writes,
            "coordinator_cpu_pct": round(100 * (c1 - c0) / window, 1),
            "coordinator_cpu_us_per_heartbeat": round(1e6 * (c1 - c0) / hb, 1) if hb else None,
            "tick_mean_ms": round(1000 * tick_sum / ticks, 2) if ticks else None,
            "stalls": m1.get("ftd_coordinator_detector_stalls_total", 0),
            "sim_errors": sum(r["errors"] for r in results),
            "sim_error_kinds": _merged([r["kinds"] for r in results]),
            "rpc_denied": delta(m0, m1, "ftd_coordinator_rpc_denied_total"),
        }
    finally:
        coord.terminate()
        coord.wait(timeout=20)
        etcd.stop()


def _events(address: str, tls: IdentityFiles | None) -> list[Any]:
    with rpc.channel(address, tls=tls) as ch:
        return list(coordinator_pb2_grpc.CoordinatorStub(ch).ListEvents(
            coordinator_pb2.ListEventsRequest(limit=1000), timeout=30).events)


def _merged(counts: list[dict[str, int]]) -> str:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return ",".join(f"{k}={v}" for k, v in sorted(total.items())) or "-"


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default="1000", help="N, or a comma-separated list of N to try in turn")
    ap.add_argument("--duration", type=float, default=30.0, help="measured window per N [s]")
    ap.add_argument("--hz", type=float, default=1.0, help="heartbeats per agent per second")
    ap.add_argument("--procs", type=int, default=2, help="processes simulating agents")
    ap.add_argument("--kills", type=int, default=10, help="agents that die during the window")
    ap.add_argument("--tls", action="store_true", help="mTLS + authorization, a certificate per simulated agent")
    ap.add_argument("--compare-tls", action="store_true",
                    help="run each N plaintext and then with --tls, one channel per agent in both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-scale-"))
    results = []
    modes = [False, True] if args.compare_tls else [args.tls]
    for n in (int(x) for x in args.agents.split(",")):
        pair = []
        for tls in modes:
            r = run_one(n, args.duration, args.hz, args.procs, args.kills, work, tls=tls,
                        per_agent=args.compare_tls)
            pair.append(r)
            results.append(r)
            if not args.json:
                emit(r, False)
                print(flush=True)
        if len(pair) == 2:
            plain, secure = pair
            cost = {"agents": n, "comparison": "mTLS / plaintext"}
            for key in ("coordinator_cpu_pct", "coordinator_cpu_us_per_heartbeat", "heartbeat_hz",
                        "p99_detection_s"):
                a, b = plain.get(key), secure.get(key)
                cost[f"tls_{key}_ratio"] = round(b / a, 2) if a and b else None
            results.append(cost)
            if not args.json:
                emit(cost, False)
                print(flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))


if __name__ == "__main__":
    main()
