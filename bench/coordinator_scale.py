"""How many agents one coordinator holds: lightweight simulated agents over real gRPC (and UDP), a real
etcd and real coordinator processes.

    python bench/coordinator_scale.py --agents 1000 --duration 30 [--agents 2000,5000 ...] [--json]
    python bench/coordinator_scale.py --agents 1000 --duration 10 --compare-tls   # plaintext, then mTLS
    python bench/coordinator_scale.py --agents 2000 --ranks-per-node 8 --memory-every-step --step-s 4 --tls
    python bench/coordinator_scale.py --agents 2000 --replicas 3 --kill-leader --memory-every-step --tls

The coordinators log at WARNING (their logs stay in the work folder); ``BENCH_LOG_LEVEL=INFO`` shows probes
and suspects too.

Simulated agents (bench/_scale_agents.py) run as asyncio tasks in ``--procs`` worker processes: each
registers (1 % as spares), opens a heartbeat stream and keeps it alive at ``--hz``. During the measured
window ``--kills`` agents (at most 5 % of N) "die": half close their stream (what a SIGKILL looks like to
the coordinator), half go silent with the stream open (a hung node). Detection latency = the leader's
``node_dead`` event time minus the death time (same host clock). Any other node declared dead is a
false positive.

``--memory-every-step --step-s S --ranks-per-node K``: every node also snapshots its K ranks every S s
and keeps its buddy's replicas, and the run is made twice in the same invocation, one per ``--paths``:
``rpc`` (before issue 19: stream heartbeats at ``--hz``, and per rank and step a CommitShard(mem) and
the buddy's RecordCopy(mem) RPC, each an etcd transaction: the coordinator's
``memory_snapshots_in_etcd``) and ``beacons`` (issue 19: UDP liveness beacons at ``--hz``, one stream
message per node and step with its whole memory report, kept by the leader in memory). ``leader CPU per
agent-second`` and the rest are compared side by side (``ratio_*``). Today's path saturates the leader's
core at this workload (``saturated``): its CPU per agent-second at N is then the core divided by N, a floor
of its cost, so ``--baseline-agents`` (default 20) first runs both paths where one core carries today's
(the same-size ratio there is exact), and each ratio says whether it is exact (``eq``) or an upper bound
(``le``, against a saturated floor).

``--replicas R`` runs R coordinator replicas (one leader, R-1 hot standbys); each one's CPU is printed.
``--kill-leader`` then SIGKILLs the leader after the window and measures until a standby answers a
complete restore target (memory copies included, a step no older than before the kill), from the kill
and from the new leader's takeover, and counts answers older than before (``went_backwards``).

Prints, per N and path: heartbeats/s, leader CPU and CPU per agent-second, each replica's CPU, etcd
writes/s (revisions) and DB growth, p99 detection, false positives, restore-target latency.

``--tls``: the coordinators serve mutual TLS with the authorization table enforced, and every simulated
agent has its own ``node/<id>`` certificate of a fresh PKI and its own channel, as real agents do.
``--compare-tls`` runs each N plaintext and then with ``--tls``. The etcd is plaintext: the bench reads
its revision and DB size from its /metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from _scale_agents import JOB, Plan, worker

from ftd import rpc
from ftd.ca import bootstrap, issue
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.ftctl.localcluster import _spawn, _wait_file
from ftd.identity import DEFAULT_OPERATOR, IdentityFiles, paths
from ftd.v1 import checkpoint_pb2, coordinator_pb2, coordinator_pb2_grpc

from _common import cpu_seconds, delta, emit, percentile, scrape

CLUSTER = "bench"
BEACONS_ACCEPTED = "ftd_coordinator_beacons_accepted_total"


class _Replica:
    def __init__(self, rid: str, proc: Any, info: dict[str, Any]) -> None:
        self.rid, self.proc, self.info = rid, proc, info
        self.address: str = info["address"]
        self.metrics: str = info["metrics"]


def _pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads started later inherit it)."""
    if cpus:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cpus)


def _cpus(spec: str) -> set[int]:
    """'0' or '0,1' or '0-3' as a CPU set."""
    out: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _start_replicas(r: int, etcd: EtcdCluster, work: Path, tag: str, tls_args: list[str],
                    config: Path, cpus: set[int] | None = None) -> list[_Replica]:
    replicas = []
    for i in range(r):
        rid = f"c{i}"
        ready, log = work / f"coord-{tag}-{rid}.json", work / f"coord-{tag}-{rid}.log"
        proc = _spawn([sys.executable, "-m", "ftd.coordinator.main", "--etcd-endpoints", etcd.endpoints,
                       "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--ready-file", str(ready),
                       "--log-level", os.environ.get("BENCH_LOG_LEVEL", "WARNING"), "--replica-id", rid,
                       "--config", str(config), *tls_args], log)
        _pin(proc.pid, cpus)
        replicas.append(_Replica(rid, proc, _wait_file(ready, proc, time.monotonic() + 30, log)))
        if i == 0:  # the first replica leads: wait for it before the standbys start
            _wait(lambda: scrape(replicas[0].metrics).get("ftd_coordinator_is_leader") == 1.0, 30, "a leader")
    return replicas


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout}s")


def _leader(replicas: list[_Replica]) -> _Replica | None:
    for rep in replicas:
        if rep.proc.poll() is None:
            try:
                if scrape(rep.metrics).get("ftd_coordinator_is_leader") == 1.0:
                    return rep
            except OSError:
                pass
    return None


def leader_udp_drops(pid: int) -> int | None:
    """Datagrams dropped at the UDP sockets of process ``pid`` (the leader's beacon port): the ``drops``
    column of /proc/net/udp{,6} for the sockets among its open files. The host's count below also has
    the simulator's sockets, which drop echoes when a simulator process is busy."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        rows = [line.split() for name in ("udp", "udp6") if Path(f"/proc/net/{name}").exists()
                for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]]
        return sum(int(row[-1]) for row in rows if len(row) >= 13 and row[9] in inodes)
    except (OSError, ValueError):
        return None


def udp_rcvbuf_errors() -> int | None:
    """The host's UDP datagrams dropped for a full receive buffer (/proc/net/snmp ``RcvbufErrors``): the
    leader's beacon port (:func:`leader_udp_drops`) and the simulator's echo sockets."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Udp:")]
        return int(lines[1][lines[0].index("RcvbufErrors")])
    except (OSError, ValueError, IndexError):
        return None


def _etcd_sample(etcd: EtcdCluster) -> dict[str, float]:
    return scrape(etcd.members[0].client_url.split("://", 1)[1])


def _restore_target(address: str, tls: IdentityFiles | None, timeout: float = 10) -> Any:
    with rpc.channel(address, tls=tls) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).GetRestoreTarget(
            checkpoint_pb2.GetRestoreTargetRequest(job=JOB), timeout=timeout)


def _has_memory(target: Any) -> bool:
    """Every rank of the target has a copy in some node's memory (a dead or hung buddy's replica aside:
    ``on_tier["mem"]``, own and buddy copies of every rank, is reported separately)."""
    return bool(target.found and all(any(c.tier == "mem" for c in sh.copies) for sh in target.checkpoint.shards))


def _restore_latency(address: str, tls: IdentityFiles | None, tries: int = 5) -> dict[str, Any]:
    took, target = [], None
    for _ in range(tries):
        t0 = time.perf_counter()
        try:
            target = _restore_target(address, tls)
        except grpc.RpcError as exc:
            return {"restore_target_error": rpc.describe(exc)[:200]}
        took.append(time.perf_counter() - t0)
    assert target is not None
    return {"restore_target_ms_p50": round(1000 * (percentile(took, 50) or 0), 1),
            "restore_target_ms_max": round(1000 * max(took), 1),
            "restore_target_step": target.checkpoint.step if target.found else None,
            "restore_target_memory": _has_memory(target),
            "restore_target_on_mem_tier": bool(target.found and target.checkpoint.on_tier.get("mem")),
            "restore_target_mem_copies_min": min((sum(c.tier == "mem" for c in sh.copies)
                                                  for sh in target.checkpoint.shards), default=0),
            "restore_target_reason": target.reason[:160]}


POLL_S = 0.2  # the failover's restore-target poll: the figures' resolution
COMPLETE_BEFORE_S = 20.0  # how long the failover waits for a complete memory target to compare against
FAILOVER_WATCH_S = 40.0  # a live node declared dead within this long after the kill is a false positive of it


def _complete_before(leader: _Replica, tls: IdentityFiles | None, restore: dict[str, Any]) -> dict[str, Any]:
    """The step the failover must not go below: the leader's complete restore target (every rank in
    memory). A death late in the window leaves a rank without its buddy's replica until the ring is
    re-formed; this waits for that (at most :data:`COMPLETE_BEFORE_S`), so that the failover has a
    complete target to serve again rather than none."""
    out: dict[str, Any] = {"failover_restore_step_before": None, "failover_waited_for_before_s": 0.0}
    if restore.get("restore_target_memory"):
        out["failover_restore_step_before"] = restore.get("restore_target_step")
        return out
    start = time.monotonic()
    while time.monotonic() - start < COMPLETE_BEFORE_S:
        try:
            target = _restore_target(leader.address, tls)
        except grpc.RpcError:
            target = None
        if target is not None and _has_memory(target):
            out["failover_restore_step_before"] = target.checkpoint.step
            break
        time.sleep(0.5)
    out["failover_waited_for_before_s"] = _r(time.monotonic() - start)
    return out


def _kill_leader(replicas: list[_Replica], leader: _Replica, tls: IdentityFiles | None,
                 before: int | None) -> dict[str, Any]:
    """SIGKILL the leader; poll the others until one answers a complete restore target, every
    :data:`POLL_S` over one channel each (a channel per poll cost the new leader a TLS handshake each)."""
    channels = {r.rid: rpc.channel(r.address, tls=tls) for r in replicas if r is not leader}
    killed_at = time.time()
    os.kill(leader.proc.pid, signal.SIGKILL)
    leader.proc.wait(timeout=10)
    others = [r for r in replicas if r is not leader]
    backwards, first_answer, complete_at, new, refusals, last_error = 0, None, None, None, 0, ""
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and complete_at is None:
        for rep in others:
            try:
                target = coordinator_pb2_grpc.CoordinatorStub(channels[rep.rid]).GetRestoreTarget(
                    checkpoint_pb2.GetRestoreTargetRequest(job=JOB), timeout=10)  # a first merge of 16,000 ranks
            except grpc.RpcError as exc:
                refusals += 1
                last_error = rpc.describe(exc)[:200]
                continue
            now = time.time()
            first_answer = first_answer or now
            if target.found and before is not None and target.checkpoint.step < before:
                backwards += 1
            if target.found and _has_memory(target) and (before is None or target.checkpoint.step >= before):
                complete_at, new = now, rep
                break
        time.sleep(POLL_S)
    for channel in channels.values():
        channel.close()
    out: dict[str, Any] = {"failover_killed_at_unix_s": killed_at,
                           "failover_restore_step_before": before, "failover_went_backwards": backwards,
                           "failover_first_answer_s": _r(first_answer - killed_at) if first_answer else None,
                           "failover_complete_target_s": _r(complete_at - killed_at) if complete_at else None,
                           "failover_refusals": refusals, "failover_last_refusal": last_error}
    for rep in [new] if new is not None else others:  # the takeover's time even when no target was complete
        try:
            with rpc.channel(rep.address, tls=tls) as ch:
                status = coordinator_pb2_grpc.CoordinatorStub(ch).GetStatus(coordinator_pb2.GetStatusRequest(),
                                                                            timeout=10)
        except grpc.RpcError:
            continue
        if status.leader_since_unix_s > killed_at:
            out["failover_takeover_s"] = _r(status.leader_since_unix_s - killed_at)
            out["failover_new_leader"] = rep.rid
            if complete_at is not None:
                out["failover_complete_after_takeover_s"] = _r(complete_at - status.leader_since_unix_s)
    return out


def _agents_back(up: dict[str, list[float]], killed_at: float, victims: set[str]) -> dict[str, Any]:
    """How long after the leader's SIGKILL each live simulated agent's stream was answered again (by
    the new leader): the reconnect storm's shape, which the complete restore target waits for."""
    back = sorted(min(t for t in times if t > killed_at) - killed_at
                  for node, times in up.items() if node not in victims and any(t > killed_at for t in times))
    live = len([n for n in up if n not in victims])
    return {"failover_agents_back_p50_s": _r(percentile(back, 50)),
            "failover_agents_back_p99_s": _r(percentile(back, 99)),
            "failover_agents_back_max_s": _r(back[-1]) if back else None,
            "failover_agents_not_back": live - len(back)}


def run_one(n: int, args: argparse.Namespace, work: Path, path: str, tls: bool = False,
            per_agent: bool = False) -> dict[str, Any]:
    mode = "tls" if tls else "plaintext"
    tag = f"{n}-{mode}-{path}"
    ids = [f"sim-{i:05d}" for i in range(n)]
    pki_dir: Path | None = None
    tls_args: list[str] = []
    coordinators = [f"c{i}" for i in range(args.replicas)]
    if tls:
        pki_dir = work / f"pki-{n}"
        bootstrap(pki_dir, CLUSTER, nodes=(), coordinators=coordinators)
        for node_id in ids:
            if not paths(pki_dir, "node", node_id)[0].exists():
                issue(pki_dir, "node", node_id)
        for c in coordinators:
            if not paths(pki_dir, "coordinator", c)[0].exists():
                issue(pki_dir, "coordinator", c)
        tls_args = ["--pki-dir", str(pki_dir), "--cluster", CLUSTER]
    config = work / f"coord-{tag}.yaml"  # JSON is YAML
    # The rpc path is the one before issue 19 all through: memory snapshots recorded in etcd, no beacons.
    config.write_text(json.dumps({"admitted_nodes": ids, "unmanaged_jobs": True,
                                  "memory_snapshots_in_etcd": path == "rpc"}))
    etcd = EtcdCluster(work / f"etcd-{tag}", size=1).start()
    operator = IdentityFiles(pki_dir, "operator", DEFAULT_OPERATOR) if pki_dir is not None else None
    replicas: list[_Replica] = []
    try:
        replicas = _start_replicas(args.replicas, etcd, work, tag, tls_args, config, args.coordinator_cpus)
        leader = replicas[0]
        spares = set(ids[:: 100])
        candidates = [i for i in ids if i not in spares]
        # At most 5 % of N: a small baseline run stays below the mass-silence fraction (10 %).
        chosen = random.sample(candidates, min(args.kills, max(1, n // 20), len(candidates)))
        victims = {node: ("close" if k % 2 == 0 else "hang") for k, node in enumerate(chosen)}
        warmup = max(10.0, n / 250.0)  # registration of N agents is N guarded etcd writes
        start_at = time.time() + warmup
        kill_at = start_at + 5.0 + args.duration / 2
        window_end = start_at + 5.0 + args.duration
        stop_at = window_end + (45.0 + COMPLETE_BEFORE_S if args.kill_leader else 0.0)
        plan = Plan(endpoints=[r.address for r in replicas], hz=args.hz, path=path,
                    ranks_per_node=args.ranks_per_node, memory=args.memory_every_step, step_s=args.step_s, n=n,
                    start_at=start_at, kill_at=kill_at, stop_at=stop_at, victims=victims, spares=spares,
                    pki_dir=str(pki_dir) if pki_dir is not None and (tls or per_agent) else None,
                    warm=not args.cold_standbys, window=(start_at + 5.0, window_end))
        queue: Any = mp.Queue()
        workers = [mp.Process(target=worker, args=(plan, ids[i::args.procs], queue)) for i in range(args.procs)]
        for w in workers:
            w.start()
        time.sleep(max(0.0, start_at + 5.0 - time.time()))  # all streams up, steady state
        m0, e0, t0 = scrape(leader.metrics), _etcd_sample(etcd), time.monotonic()
        u0, d0 = udp_rcvbuf_errors(), leader_udp_drops(leader.proc.pid)
        c0 = {r.rid: cpu_seconds(r.proc.pid) for r in replicas}
        time.sleep(max(0.0, window_end - time.time() - 0.5))
        m1, e1, t1 = scrape(leader.metrics), _etcd_sample(etcd), time.monotonic()
        u1, d1 = udp_rcvbuf_errors(), leader_udp_drops(leader.proc.pid)
        c1 = {r.rid: cpu_seconds(r.proc.pid) for r in replicas}
        # Before the simulated agents stop (then all would die); from whichever replica leads now: an
        # overloaded leader may have lost its lease in the window (the figures then say so).
        _wait(lambda: _leader(replicas) is not None, 30, "a leader at the window's end")
        leading = _leader(replicas) or leader
        events = _events(leading.address, operator)
        restore = _restore_latency(leading.address, operator) if args.memory_every_step else {}
        if leading is not leader:
            restore["leader_lost_in_window"] = f"{leader.rid} -> {leading.rid}"
        failover: dict[str, Any] = {}
        if args.kill_leader and len(replicas) > 1:
            before = _complete_before(leading, operator, restore)
            failover = _kill_leader(replicas, leading, operator, before.pop("failover_restore_step_before"))
            failover.update(before)
            new = next((r for r in replicas if r.rid == failover.get("failover_new_leader")), None)
            if new is not None:  # live nodes declared dead within FAILOVER_WATCH_S of the kill: the storm and after
                killed = failover["failover_killed_at_unix_s"]
                time.sleep(max(0.0, min(killed + FAILOVER_WATCH_S, stop_at - 2.0) - time.time()))
                u2 = udp_rcvbuf_errors()
                failover["failover_udp_rcvbuf_errors"] = u2 - u1 if u1 is not None and u2 is not None else None
                failover["failover_new_leader_beacon_drops"] = leader_udp_drops(new.proc.pid)  # since it started
                with contextlib.suppress(OSError):  # beacons it read and refused, by reason (unknown_key: a
                    # beacon under a stream's key it does not hold, e.g. sent before the agent's new stream's answer)
                    failover["failover_new_leader_beacons_refused"] = {
                        k.split('reason="', 1)[1].split('"', 1)[0]: int(v) for k, v in scrape(new.metrics).items()
                        if k.startswith("ftd_coordinator_beacons_dropped_total{") and 'reason="' in k and v}
                try:  # from whichever replica leads now: the new leader may have lost its lease again
                    seen = _events((_leader(replicas) or new).address, operator)
                except grpc.RpcError as exc:
                    seen, failover["failover_events_error"] = [], rpc.describe(exc)[:200]
                after = [e for e in seen if e.kind == "node_dead" and e.node_id not in victims
                         and window_end < e.at_unix_s <= killed + FAILOVER_WATCH_S]
                if _leader(replicas) not in (None, new):
                    failover["failover_leader_lost"] = f"{new.rid} -> {(_leader(replicas) or new).rid}"
                failover["failover_false_positives"] = len({e.node_id for e in after})
                failover["failover_false_positive_examples"] = [
                    f"{e.at_unix_s - killed:+.1f}s after the kill: {e.message}"[:200] for e in after[:3]]
        results = [queue.get(timeout=180) for _ in workers]
        for w in workers:
            w.join(timeout=30)
        died: dict[str, float] = {}
        sent: dict[str, int] = {}
        up: dict[str, list[float]] = {}
        for res in results:
            died.update(res["died"])
            up.update(res["up"])
            for k, v in res["sent"].items():
                sent[k] = sent.get(k, 0) + v
        if "failover_killed_at_unix_s" in failover:
            failover.update(_agents_back(up, failover.pop("failover_killed_at_unix_s"), set(victims)))
        dead_at = {e.node_id: e.at_unix_s for e in reversed(events) if e.kind == "node_dead"}
        latencies = [dead_at[v] - died[v] for v in victims if v in dead_at and v in died]
        missed = [v for v in victims if v not in dead_at]
        false_pos = [nid for nid in dead_at if nid not in victims]
        window = t1 - t0
        stream_hb = delta(m0, m1, "ftd_coordinator_heartbeats_received_total")
        beacons = delta(m0, m1, BEACONS_ACCEPTED)
        alive = beacons if path == "beacons" else stream_hb  # the liveness signal sent every 1/hz s
        ticks = delta(m0, m1, "ftd_coordinator_tick_duration_seconds_count")
        tick_sum = delta(m0, m1, "ftd_coordinator_tick_duration_seconds_sum")
        rev = "etcd_debugging_mvcc_current_revision"
        revisions = e1.get(rev, 0) - e0.get(rev, 0)
        leader_cpu = c1[leader.rid] - c0[leader.rid]
        return {
            "agents": n, "path": path, "ranks_per_node": args.ranks_per_node,
            "memory_every_step": args.memory_every_step, "step_s": args.step_s if args.memory_every_step else None,
            "replicas": args.replicas, "warm_standbys": not args.cold_standbys,
            "transport": "mTLS + authorization" if tls else "plaintext",
            "target_hz": args.hz, "heartbeat_hz": round(alive / window, 1),
            "heartbeat_ratio": round(alive / window / (n * args.hz), 3),
            "stream_messages_per_s": round(stream_hb / window, 1), "beacons_per_s": round(beacons / window, 1),
            "stream_answers_per_s": round(delta(m0, m1, "ftd_coordinator_heartbeat_answers_total") / window, 1),
            "probes_per_s": round(delta(m0, m1, "ftd_coordinator_probes_total") / window, 1),
            "echoes_per_s": round(delta(m0, m1, "ftd_coordinator_beacon_echoes_total") / window, 1),
            "p50_detection_s": _r(percentile(latencies, 50)), "p99_detection_s": _r(percentile(latencies, 99)),
            "detected": len(latencies), "missed": len(missed), "false_positives": len(false_pos),
            "missed_victims": sorted(f"{v} ({victims[v]}, {'died' if v in died else 'never stopped'}"
                                     f"{', registered' if v in up else ', never answered'})" for v in missed),
            "etcd_writes_per_s": round(revisions / window, 2),
            "udp_rcvbuf_errors": u1 - u0 if u0 is not None and u1 is not None else None,
            "leader_beacon_drops": d1 - d0 if d0 is not None and d1 is not None else None,
            "coordinator_etcd_writes_per_s": round(delta(m0, m1, "ftd_coordinator_etcd_writes_total") / window, 2),
            "etcd_db_growth_bytes": int(e1.get("etcd_mvcc_db_total_size_in_bytes", 0)
                                        - e0.get("etcd_mvcc_db_total_size_in_bytes", 0)),
            "leader_cpu_pct": round(100 * leader_cpu / window, 1),
            "leader_cpu_us_per_agent_s": round(1e6 * leader_cpu / (n * window), 1),
            # A saturated leader delivers a fraction of the heartbeats: its CPU per agent is capped, its
            # CPU per heartbeat delivered is what serving every agent would take.
            "leader_cpu_us_per_heartbeat": round(1e6 * leader_cpu / alive, 1) if alive else None,
            "replica_cpu_pct": {r.rid: round(100 * (c1[r.rid] - c0[r.rid]) / window, 1) for r in replicas},
            "tick_mean_ms": round(1000 * tick_sum / ticks, 2) if ticks else None,
            "stalls": m1.get("ftd_coordinator_detector_stalls_total", 0),
            **restore, **failover,
            "sim_sent": sent,
            "sim_errors": sum(res["errors"] for res in results),
            "sim_error_kinds": _merged([res["kinds"] for res in results]),
            "sim_error_kinds_in_window": _merged([res["in_window"] for res in results]),
            "rpc_denied": delta(m0, m1, "ftd_coordinator_rpc_denied_total"),
        }
    finally:
        for rep in replicas:
            if rep.proc.poll() is None:
                rep.proc.terminate()
                rep.proc.wait(timeout=20)
        etcd.stop()


SATURATED_CPU_PCT = 85.0  # of one core: the leader's event loop is one thread


def saturated(r: dict[str, Any]) -> bool:
    """Whether a run's leader was at its capacity: its CPU near a core, or heartbeats or memory RPCs
    not served in the measured window (a RecordCopy of a step already gone, NOT_FOUND, is an answer;
    a registration refused before a replica was elected is not the leader's capacity). Its CPU per
    agent-second is then the core divided by N: a floor of what the path costs, not its cost."""
    errors = [k for k in str(r.get("sim_error_kinds_in_window", "-")).split(",") if k not in ("-", "")]
    return (r["leader_cpu_pct"] >= SATURATED_CPU_PCT or r["heartbeat_ratio"] < 0.95
            or any(":NOT_FOUND=" not in k for k in errors))


def compare_to_baselines(old: dict[str, Any], new: dict[str, Any], baselines: list[dict[str, Any]]) -> dict[str, Any]:
    """The new path's CPU per agent-second against today's path at each size. Today's figure at a
    saturated size is a floor of its cost, so the ratio against it is an upper bound ("le"); against an
    unsaturated size it is the ratio ("eq")."""
    out: dict[str, Any] = {"rpc_saturated": old["saturated"], "beacons_saturated": new["saturated"]}
    b = new["leader_cpu_us_per_agent_s"]
    for r in [*baselines, old]:
        a = r["leader_cpu_us_per_agent_s"]
        out[f"ratio_leader_cpu_us_per_agent_s_vs_rpc_at_{r['agents']}"] = {
            "rpc_us_per_agent_s": a, "ratio": round(b / a, 3) if a else None,
            "bound": "le" if r["saturated"] else "eq"}
    return out


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
    ap.add_argument("--hz", type=float, default=2.0, help="heartbeats per agent per second (the agent's default: 2)")
    ap.add_argument("--procs", type=int, default=2, help="processes simulating agents")
    ap.add_argument("--kills", type=int, default=10, help="agents that die during the window (at most 5 %% of N)")
    ap.add_argument("--tls", action="store_true", help="mTLS + authorization, a certificate per simulated agent")
    ap.add_argument("--compare-tls", action="store_true",
                    help="run each N plaintext and then with --tls, one channel per agent in both")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--memory-every-step", action="store_true",
                    help="every node snapshots its ranks every --step-s and keeps its buddy's replicas")
    ap.add_argument("--step-s", type=float, default=4.0, help="the simulated job's step time [s]")
    ap.add_argument("--paths", default="",
                    help="rpc, beacons or rpc,beacons (default: both with --memory-every-step, else beacons)")
    ap.add_argument("--baseline-agents", default="",
                    help="with both paths: both also at these N first (comma-separated; default 20 with "
                         "--memory-every-step, 'none' for none), where today's (rpc) path keeps up on one core: "
                         "its per-agent cost there, and the same-size ratio, are exact")
    ap.add_argument("--replicas", type=int, default=1, help="coordinator replicas (one leads)")
    ap.add_argument("--kill-leader", action="store_true", help="SIGKILL the leader after the window (--replicas >= 2)")
    ap.add_argument("--cold-standbys", action="store_true",
                    help="agents connect to a standby only when they move to it (before: no warm connections)")
    ap.add_argument("--coordinator-cpus", type=_cpus, default=None,
                    help="CPUs of their own for the coordinator replicas, e.g. 0 (as deploy/ gives the coordinator "
                         "its own CPU); etcd, the simulator and the bench get the others")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.coordinator_cpus:
        rest = os.sched_getaffinity(0) - args.coordinator_cpus
        if not rest or not args.coordinator_cpus <= os.sched_getaffinity(0):
            ap.error(f"--coordinator-cpus {sorted(args.coordinator_cpus)}: must be some, not all, of "
                     f"{sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, rest)  # etcd and the simulating workers start from here and inherit it
    if args.kill_leader and args.replicas < 2:
        ap.error("--kill-leader needs --replicas 2 or more")
    paths_run = [p for p in (args.paths or ("rpc,beacons" if args.memory_every_step else "beacons")).split(",") if p]
    if any(p not in ("rpc", "beacons") for p in paths_run):
        ap.error(f"--paths: rpc and/or beacons, got {args.paths!r}")
    work = Path(tempfile.mkdtemp(prefix="ftd-bench-scale-"))
    results = []
    modes = [False, True] if args.compare_tls else [args.tls]
    base_arg = args.baseline_agents or ("20" if args.memory_every_step else "none")
    baseline_n = [] if base_arg == "none" or paths_run != ["rpc", "beacons"] else [int(x) for x in base_arg.split(",")]
    baselines: dict[bool, list[dict[str, Any]]] = {tls: [] for tls in modes}
    # Both paths first where one core carries today's (its per-agent cost, not a cap: the same-size
    # ratio there is exact), then at each --agents N.
    sizes = [(m, True) for m in baseline_n] + [(int(x), False) for x in args.agents.split(",")]
    for n, is_baseline in sizes:
        for tls in modes:
            by_path = {}
            for path in paths_run:
                r = run_one(n, args, work, path, tls=tls, per_agent=args.compare_tls)
                r["saturated"] = saturated(r)
                if is_baseline:
                    r["baseline"] = True
                by_path[path] = r
                results.append(r)
                if not args.json:
                    emit(r, False)
                    print(flush=True)
            if len(by_path) == 2:
                old, new = by_path["rpc"], by_path["beacons"]
                cmp = {"agents": n, "comparison": "beacons / rpc", "transport": old["transport"]}
                for key in ("leader_cpu_us_per_agent_s", "leader_cpu_us_per_heartbeat", "leader_cpu_pct",
                            "etcd_writes_per_s", "p99_detection_s"):
                    a, b = old.get(key), new.get(key)
                    cmp[f"ratio_{key}"] = round(b / a, 3) if a and b is not None else None
                cmp.update(compare_to_baselines(old, new, [] if is_baseline else baselines[tls]))
                if is_baseline:
                    baselines[tls].append(old)
                results.append(cmp)
                if not args.json:
                    emit(cmp, False)
                    print(flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))


if __name__ == "__main__":
    main()
