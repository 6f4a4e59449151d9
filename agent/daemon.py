"""The agent daemon: wires the coordinator session, the local gRPC endpoint, supervision, health and
metrics together, and runs until SIGTERM."""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from ftd import metrics_http, rpc, systemd
from ftd.authz_interceptors import AuthzInterceptor, Guard
from ftd.checkpoints.catalog import CheckpointRecord, from_info
from ftd.client import CoordinatorClient
from ftd.deny_list import DenyListFollower
from ftd.identity import identity_of
from ftd.logs import set_identity
from ftd.storage_backends.memory import default_capacity
from ftd.storage_backends.tiers import open_tiers
from ftd.throttle import LogThrottle
from ftd.v1 import agent_pb2, cluster_pb2, coordinator_pb2

from . import landing, rtt, tiers_wire
from .beacon_sender import BeaconSender
from .bulk_copy import BulkServer
from .handover_relay import Handover, carry_parked
from .health_measure import GpuSampler
from .health_monitor import GpuFaults, HealthMonitor
from .health_rules import Measurements
from .heartbeat import Identity, Session
from .landing import LandingReserve
from .metrics import AgentMetrics
from .peer_copy import PeerFetcher
from .peer_limits import Limits, PeerLimiter
from .peer_rules import View, view_of
from .peers import Buddy, address_of, buddy_of
from .preemption import PreemptionWatcher
from .replicator import ReplicationMetrics, Replicator
from .restore_prefetch import Prefetcher
from .rtt import RttMetrics, RttProber
from .settings import AgentSettings
from .step_anomalies import NodeJudge
from .supervisor import Supervisor
from .tiering import Tiering
from .torchrun_supervisor import TrainingSupervisor, TrainSpec
from .warm_supervisor import WarmTrainingSupervisor

log = logging.getLogger("ftd.agent")
LANDING_PLAN_S = 5.0  # how often a spare sizes its landing reserve again from the catalog
MAX_SAVES_IN_FLIGHT = 64  # local ranks saving at once; more is a misbehaving client
MAX_FINGERPRINT_RANKS = 64  # local ranks whose replica fingerprints ride in the heartbeats
FINGERPRINTS_PER_RANK = 4  # x ranks: within the coordinator's MAX_FINGERPRINTS per heartbeat


def bind_private_socket(server: grpc.Server, path: Path) -> None:
    """Binds the training process's Unix socket with mode 0600 (owner only) from its creation on: the
    file mode is its access control (a peer on it is the ``local`` identity)."""
    old = os.umask(0o177)
    try:
        if rpc.add_port(server, f"unix:{path}") == 0:
            raise OSError(f"cannot bind the Unix socket {path}")
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


class AgentDaemon:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.node_id = settings.effective_node_id
        self.metrics = AgentMetrics()
        # mTLS: this node's certificate (a bad one fails the start here, naming the file: PkiError)
        self.identity = settings.identity
        self.guard: Guard | None = None
        if self.identity is not None:
            own = identity_of(self.identity.load().cert_pem)
            assert own is not None  # load() checked that the certificate names node/<node_id>
            self.guard = Guard(cluster=own.cluster, on_denied=self._denied)
        self.supervisor = Supervisor()
        self.gpu = GpuSampler()  # the one NVML client; only the health monitor's thread queries it
        self.health_monitor = HealthMonitor(settings.tiers, self.gpu, settings.health_thresholds,
                                            GpuFaults(settings.workdir / "gpu-faults.json"), settings.health_interval_s,
                                            settings.health_deadline_s, on_sample=self._on_health_sample)
        self._progress = cluster_pb2.Progress(step=-1)
        self.metrics.training_step.set(-1)
        self._progress_lock = threading.Lock()
        self._timings: dict[int, cluster_pb2.StepTiming] = {}  # each local rank's latest step timing
        self._anomalies = NodeJudge(settings.anomalies)  # each local rank's recent losses and gradient norms
        # rank -> its newest replica fingerprints (a few: a heartbeat may come after several fingerprint steps)
        self._fingerprints: dict[int, deque[cluster_pb2.Fingerprint]] = {}
        self._stop = threading.Event()
        # Each rank's durable hop (CommitShard from memory: a copy of its shard) holds a worker while it
        # runs: room for a node's ranks doing it at once, and the other calls beside them.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=24, thread_name_prefix="ftd-agent-rpc"),
                                  options=rpc.SERVER_OPTIONS,
                                  interceptors=[AuthzInterceptor(self.guard)] if self.guard is not None else None)
        # The training's own calls (the Unix socket) on a server and threads of their own: no peer's
        # streams can take them (agent.peer_limits bounds each peer on the TCP port).
        self.local_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_SAVES_IN_FLIGHT // 2, thread_name_prefix="ftd-agent-local"),
            options=rpc.SERVER_OPTIONS,
            interceptors=[AuthzInterceptor(self.guard)] if self.guard is not None else None)
        self.peer_limiter = PeerLimiter(Limits(settings.peer_max_streams, settings.peer_max_inflight_mb << 20,
                                               settings.peer_idle_timeout_s))
        self.denials = LogThrottle(logging.getLogger("ftd.rpc"), 10.0, max_kinds=256)
        self.address = ""
        self.metrics_address = ""
        self.client = CoordinatorClient(settings.coordinators, timeout_s=settings.coordinator_timeout_s,
                                        tls=self.identity)
        # The coordinator's deny list (ftctl certs revoke), fetched every few seconds: revoked peers are refused.
        self.deny = DenyListFollower(self.client.call)
        if self.guard is not None:
            self.guard.deny = self.deny.current
        self.session: Session  # created in start(), once the agent's own address is known
        self.tiering = Tiering(open_tiers(settings.tier_specs), self._catalog_call, settings.keep_per_tier,
                               settings.tier_bandwidth_mb_s * 1e6, settings.tiering_interval_s)
        self._tier_stats_seen: dict[str, dict[str, int]] = {}
        self.training: TrainingSupervisor | None = None
        self.prefetch: Prefetcher | None = None  # a promoted node's shards pulled ahead (agent.restore_prefetch)
        self._saves_in_flight: dict[tuple[int, int], float] = {}
        self._loop_at = time.monotonic()
        self.metrics.configure_mfu(settings.peak_flops_per_gpu, settings.mfu_floor)
        self.handover = Handover(self.node_id, lambda req: self.client.call("Drain", req, idempotent=True),
                                 self.metrics)
        self.preemption: PreemptionWatcher | None = None
        self.rtt = RttProber(RttMetrics(self.metrics.registry))
        self._rtt_key: tuple[str, int, bytes] | None = None  # (leader, epoch, peers) the targets were chosen for
        spool = settings.mem_path if self.tiering.mem is not None else settings.tiers["ssd"]
        listen_host = settings.listen.rpartition(":")[0].strip("[]")
        self.bulk = (BulkServer(listen_host, settings.peer_copy_port, idle_s=settings.peer_idle_timeout_s)
                     if settings.peer_copy_port >= 0 else None)
        # Room prepared in the memory tier for what a restore pulls (agent.landing): on a spare, by default.
        self.landing = (LandingReserve(spool / ".peer-copies" / ".landing", self.metrics.landing_ready.set,
                                       self.metrics.landing_used.inc)
                        if self.tiering.mem is not None and self.bulk is not None else None)
        self._landing_at = -1e9
        self._landing_busy = threading.Lock()
        self.peers = PeerFetcher(self._agent_of, self.peer_channel, spool / ".peer-copies", fast=self.bulk is not None,
                                 landing=self.landing)
        # Memory snapshots: pushed to the buddy (agent.replicator), a buddy's received (Agent.WriteShard).
        # Memory snapshots go over the bulk port when both ends serve it (PullReplica), else WriteShard.
        self.replicator = Replicator(
            self.tiering.mem, self.node_id, self._buddy, self.peer_channel, self._catalog_call,
            ReplicationMetrics(self.metrics.registry), bandwidth_bytes_s=settings.replication_bandwidth_mb_s * 1e6,
            bulk=self.bulk, node_agent=self._agent_of,
        ) if self.tiering.mem is not None else None

    def _agent_of(self, node_id: str) -> str:
        """The agent address of a node that is neither dead nor fenced (the peer copy path), as the
        coordinator's assignment names it; "" when unknown or gone."""
        session = getattr(self, "session", None)
        return address_of(session.assignment, node_id) if session is not None else ""

    def peer_view(self) -> View:
        """This node's view of the job for its data-plane rules (agent.peer_rules), from its assignment."""
        session = getattr(self, "session", None)
        if session is None:
            return View(self.node_id)
        return view_of(self.node_id, session.assignment, self.settings.nproc_per_node if self.settings.train_cmd else 0)

    def _buddy(self) -> Buddy:
        """The buddy the coordinator chose for this node (the replicator's target)."""
        session = getattr(self, "session", None)
        return buddy_of(session.assignment) if session is not None else Buddy(None, "not registered yet")

    def _maybe_plan_landing(self) -> None:
        """Plans the landing reserve again every :data:`LANDING_PLAN_S`, off the main loop (it reads
        the catalog from the coordinator)."""
        if self.landing is None or self._landing_busy.locked() or time.monotonic() - self._landing_at < LANDING_PLAN_S:
            return
        self._landing_at = time.monotonic()
        threading.Thread(target=self._plan_landing, name="ftd-landing-plan", daemon=True).start()

    def _plan_landing(self) -> None:
        assert self.landing is not None
        with self._landing_busy:
            wanted = self.settings.landing_reserve_mb
            if wanted >= 0:
                self.landing.set_target([landing.capacity_for(wanted << 20)] if wanted else [])
                return
            session = getattr(self, "session", None)
            if self.settings.role != "spare" or session is None or session.assignment.rank >= 0:
                self.landing.set_target([])  # only a spare waits to pull a node's share of the world
                return
            in_world = session.assignment.world_size
            try:
                records = [from_info(i) for i in self.client.checkpoints("")]
            except (grpc.RpcError, ConnectionError) as exc:
                log.debug("landing reserve kept: cannot read the catalog (%s)", exc)
                return
            mem = self.tiering.mem.memory if self.tiering.mem is not None else None
            capacity = (mem.capacity_bytes if mem is not None else 0) or default_capacity()
            room = capacity - ((mem.used_bytes() if mem is not None else 0) - self.landing.ready_bytes)
            target, why = landing.plan(records, in_world, max(0, room))
            if sorted(target) != sorted(self.landing.wanted):
                log.info("landing reserve: %d slot(s), %d MiB (%s)", len(target), sum(target) >> 20, why)
            self.landing.set_target(target)

    def peer_channel(self, address: str) -> grpc.Channel:
        """A channel to another node's agent, with this node's certificate under mTLS, accepting only the
        certificate of the node the coordinator lists at ``address`` (its ftd.identity.server_name)."""
        session = getattr(self, "session", None)
        listed = {p.node_id for p in session.assignment.peers.addresses if p.agent_address == address} \
            if session is not None else set()
        if len(listed) == 1:
            return rpc.agent_channel(address, listed.pop(), self.identity)
        return rpc.channel(address, tls=self.identity)

    def _denied(self, method: str, rule: str) -> None:
        self.metrics.rpc_denied.labels(method, rule).inc()

    def drill_token(self) -> str:
        """The second factor of Kill ("" = none), read afresh so that a replaced token file counts."""
        path = self.settings.drill_token_file
        if path is None:
            return self.settings.drill_token
        try:
            if path.stat().st_mode & 0o077:
                log.warning("drill token file %s is readable by group or others: chmod 600 it", path)
            token = path.read_text().strip()
        except OSError as exc:
            raise OSError(f"drill token file {path} is unreadable: {exc.strerror or exc}") from exc
        if not token:
            raise OSError(f"drill token file {path} is empty")
        return token

    def _catalog_call(self, method: str, request: Any) -> Any:
        return self.client.call(method, request, idempotent=True)

    def tiers_info(self) -> agent_pb2.Tiers:
        """The specs the tiering opened, for the training process to open the same tiers."""
        return tiers_wire.tiers_to_proto(self.node_id, (t.spec for t in self.tiering.tiers))

    def _publish_tier_metrics(self) -> None:
        st = self.tiering.stats
        for name, counter, values in (("bytes", self.metrics.bytes_written, st.migrated_bytes),
                                      ("migrations", self.metrics.tier_migrations, st.migrations),
                                      ("errors", self.metrics.tier_errors, st.errors),
                                      ("deleted", self.metrics.tier_deleted, st.deleted)):
            seen = self._tier_stats_seen.setdefault(name, {})
            for tier, value in values.items():
                if value > seen.get(tier, 0):
                    counter.labels(tier).inc(value - seen.get(tier, 0))
                    seen[tier] = value
        for tier, lag in st.lag_steps.items():
            self.metrics.tier_lag_steps.labels(tier).set(lag)
        for tier, pending in st.pending.items():
            self.metrics.tier_pending.labels(tier).set(pending)
        for job, step in st.last_valid_step.items():
            self.metrics.last_valid_step.labels(job).set(step)

    # ---- state shared with the service ------------------------------------------------------

    def report_progress(self, progress: cluster_pb2.Progress, rank: int = 0, round_: int | None = None) -> None:
        with self._progress_lock:
            if progress.reported_unix_s == 0:
                progress.reported_unix_s = time.time()
            previous = self._progress.step
            if not progress.HasField("restored") and self._progress.HasField("restored"):
                progress.restored.CopyFrom(self._progress.restored)  # kept until a newer restore is reported
            carry_parked(self._progress, progress)
            self._judge_anomaly(progress, rank, round_)
            if progress.step < previous:
                self._timings.clear()  # a new world restarted from an older step: other ranks, maybe
                self._fingerprints.clear()
            for mark in progress.fingerprints:  # this rank's own; the newest few per rank ride in the heartbeats
                if mark.rank in self._fingerprints or len(self._fingerprints) < MAX_FINGERPRINT_RANKS:
                    kept = self._fingerprints.setdefault(mark.rank, deque(maxlen=FINGERPRINTS_PER_RANK))
                    if not kept or kept[-1].step < mark.step:
                        kept.append(mark)
            del progress.fingerprints[:]
            progress.fingerprints.extend(m for r in sorted(self._fingerprints) for m in self._fingerprints[r])
            t = progress.timing
            if progress.HasField("timing") and not all(math.isfinite(v) and 0 <= v < 1e6
                                                       for v in (t.compute_s, t.wall_s, t.data_s)):
                progress.ClearField("timing")  # the coordinator refuses a heartbeat with nonsense times
            if progress.HasField("timing"):
                self._timings[progress.timing.rank] = progress.timing
                progress.timing.CopyFrom(slowest(self._timings))
            self._progress = progress
        if progress.step > previous >= 0:
            self.metrics.training_steps.inc(progress.step - previous)
        self.metrics.training_step.set(progress.step)
        if progress.HasField("loss"):
            self.metrics.training_loss.set(progress.loss)
        if progress.HasField("grad_norm"):
            self.metrics.grad_norm.set(progress.grad_norm)
        if progress.HasField("flops"):
            self.metrics.observe_flops(progress.step, progress.reported_unix_s, progress.flops)
        if self.training is not None:
            self.training.on_progress(progress.step)

    def _judge_anomaly(self, progress: cluster_pb2.Progress, rank: int, round_: int | None) -> None:
        found = self._anomalies.judge(self._progress, progress, rank, round_)  # under the progress lock
        if found is not None:
            self.metrics.step_anomalies.labels(found.kind).inc()
            log.warning("step anomaly: %s", found.reason)

    def report_restored(self, restored: cluster_pb2.Restored) -> None:
        """What the training restored when its world started: carried in the progress (heartbeats,
        ``GetInfo``) so that drills and the demo report what the new world resumed from."""
        restored.source = restored.source[:300]
        with self._progress_lock:
            progress = cluster_pb2.Progress()
            progress.CopyFrom(self._progress)
            progress.restored.CopyFrom(restored)
            self._progress = progress
        log.info("rank %d restored %s (epoch %d, world size %d)", restored.rank,
                 f"step {restored.step} from {restored.source}" if restored.step >= 0 else "nothing: a fresh start",
                 restored.epoch, restored.world_size)

    def checkpoint_event(self, rank: int, event: agent_pb2.CheckpointEvent) -> None:
        """A rank's save started, finished or failed: stall and persist histograms, bytes, saves in flight."""
        key = (rank, event.step)
        if event.phase == "started":
            self.metrics.save_blocked.observe(event.blocked_s)
            # One save in flight per rank (a new one supersedes an older step), and a bounded table:
            # the training side is not trusted to send "done" for everything it started.
            for old in [k for k in self._saves_in_flight if k[0] == rank]:
                del self._saves_in_flight[old]
            if len(self._saves_in_flight) >= MAX_SAVES_IN_FLIGHT:
                del self._saves_in_flight[min(self._saves_in_flight, key=self._saves_in_flight.__getitem__)]
            self._saves_in_flight[key] = time.monotonic()
        elif event.phase in ("done", "failed"):
            self._saves_in_flight.pop(key, None)
            if event.phase == "done":
                tier = event.tier if event.tier in ("mem", "ssd") else "ssd"
                self.metrics.bytes_written.labels(tier).inc(event.bytes)
                if tier == "ssd":  # a memory snapshot is no durable save: not in the persist and size figures
                    self.metrics.persist.observe(event.persist_s)
                    self.metrics.observe_save_done(event.step, event.bytes)

    def progress(self) -> cluster_pb2.Progress:
        with self._progress_lock:
            return self._progress

    def _on_health_sample(self, sample: Measurements) -> None:
        for tier, disk in sample.disks.items():
            if not disk.error:
                self.metrics.disk_free.labels(tier).set(disk.free_bytes)
        for device in sample.gpus.devices:
            if device.utilization_pct is not None:
                self.metrics.gpu_utilization.labels(str(device.index)).set(device.utilization_pct / 100.0)

    def health(self) -> cluster_pb2.Health:
        """The latest sample and its verdict, judged now: never waits on a measurement (heartbeats)."""
        sample = self.health_monitor.health()
        if sample.HasField("verdict"):
            sample.verdict.CopyFrom(self._verdict(sample.verdict))
        return sample

    def check_health(self) -> cluster_pb2.HealthVerdict:
        """A fresh sample judged (``CheckHealth``), waiting for it at most ``health_deadline_s``."""
        return self._verdict(self.health_monitor.check_now())

    def clear_gpu_faults(self, reason: str) -> tuple[tuple[str, ...], cluster_pb2.HealthVerdict]:
        cleared, verdict = self.health_monitor.clear_gpu_faults(reason)
        return cleared, self._verdict(verdict)

    def _verdict(self, verdict: cluster_pb2.HealthVerdict) -> cluster_pb2.HealthVerdict:
        """A node told it goes away (a preemption notice) is never healthy: it must not be promoted
        while going."""
        going = self.handover.going_away()
        if going:
            verdict.healthy, verdict.reason = False, going
        self.metrics.healthy.set(1 if verdict.healthy else 0)
        return verdict

    def info(self) -> agent_pb2.AgentInfo:
        s = self.session
        info = agent_pb2.AgentInfo(
            node_id=self.node_id, host=self.settings.effective_host, pid=os.getpid(), assignment=s.assignment,
            connected=s.connected, coordinator_address=s.leader_address, supervised_pids=self.supervisor.pids(),
            progress=self.progress(),
        )
        move = self.tiering.current
        if move is not None:
            info.migrations.append(agent_pb2.Migration(job=move.job, step=move.step, rank=move.rank, tier=move.tier,
                                                       done_bytes=move.done, total_bytes=move.total))
        return info

    def _on_assignment(self, assignment: cluster_pb2.Assignment) -> None:
        self.metrics.epoch.set(assignment.epoch)
        self.metrics.rank.set(assignment.rank)
        set_identity(epoch=assignment.epoch, rank=assignment.rank)
        if self.prefetch is not None:
            self.prefetch.on_assignment(assignment)
        if self.training is not None:
            self.training.on_assignment(assignment)

    def _restore_target(self, job: str, world_size: int) -> CheckpointRecord | None:
        from ftd.v1 import checkpoint_pb2

        got = self.client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(
            job=job, world_size=world_size), idempotent=True)
        return from_info(got.checkpoint) if got.found else None

    def _report_hang(self, culprit: bool, reason: str, step: int) -> None:
        from ftd.v1 import coordinator_pb2

        assert self.training is not None
        self.client.call("ReportHang", coordinator_pb2.ReportHangRequest(
            job=self.training.spec.job, node_id=self.node_id, culprit=culprit, reason=reason, last_step=step),
            idempotent=True)

    def _job_closed(self) -> bool:
        from ftd.v1 import coordinator_pb2

        assert self.training is not None
        try:
            info = self.client.call("GetRound", coordinator_pb2.GetRoundRequest(job=self.training.spec.job),
                                    idempotent=True)
        except grpc.RpcError:
            return False  # no round yet
        return bool(info.status == coordinator_pb2.RoundInfo.CLOSED)

    def _on_response(self, response: Any) -> None:
        self.handover.on_response(response)
        if isinstance(self.training, WarmTrainingSupervisor):
            self.training.on_response(response)

    def _on_connected(self, up: bool) -> None:
        self.metrics.connected.set(1 if up else 0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, add_services: Callable[[grpc.Server, AgentDaemon], None]) -> None:
        """Binds the ports, starts serving ``add_services``' gRPC services (``agent.service`` in the
        daemon; the service depends on the daemon, never the other way round) and the background work."""
        s = self.settings
        s.workdir.mkdir(parents=True, exist_ok=True)
        for path in s.tiers.values():
            path.mkdir(parents=True, exist_ok=True)
        sock = s.effective_socket
        if sock.exists():
            sock.unlink()  # a stale socket of a previous run; ours is created by bind below
        add_services(self.server, self)
        add_services(self.local_server, self)
        host, _, port = s.listen.rpartition(":")
        if self.identity is None:
            log.warning("no pki_dir: the agent's TCP port %s is PLAINTEXT without authorization; anyone who reaches "
                        "it may read its state (and run drills with the drill token)", s.listen)
        bound = rpc.add_port(self.server, f"{host}:{port}", self.identity)
        if bound == 0:
            raise OSError(f"cannot listen on {s.listen}")
        # Registered as the address others dial: a wildcard listen address means "reach me at my host".
        reach = s.effective_host if host.strip("[]") in ("0.0.0.0", "::", "") else host.strip("[]")
        self.address = f"{reach}:{bound}"
        bind_private_socket(self.local_server, sock)
        self.local_server.start()
        self.server.start()
        if s.metrics_listen:
            mhost, _, mport = s.metrics_listen.rpartition(":")
            server = metrics_http.serve(mhost, int(mport), self.metrics.registry, self._healthy, self._ready)
            self.metrics_address = f"{mhost}:{server.server_port}"
        self.health_monitor.start()  # the first heartbeat carries a verdict (its first sample waited for)
        role = cluster_pb2.ROLE_ACTIVE if s.role == "active" else cluster_pb2.ROLE_SPARE
        self.session = Session(
            self.client, Identity(self.node_id, s.effective_host, role, dict(s.labels), self.address),
            s.heartbeat_interval_s, s.coordinator_timeout_s, s.reconnect_max_backoff_s,
            health=self.health, progress=self.progress, on_assignment=self._on_assignment,
            on_heartbeat=self.metrics.heartbeats.inc, on_reconnect=self.metrics.reconnects.inc,
            on_connected=self._on_connected, on_response=self._on_response,
            beacons=BeaconSender(self.node_id, s.heartbeat_interval_s, s.beacon_port, self.metrics.beacons.inc)
            if s.beacons else None,
            keepalive_s=s.beacon_keepalive_s, progress_interval_s=s.progress_interval_s,
        )
        # memory snapshots ride on the heartbeat stream (agent.memory_report); no memory tier: an empty report
        self.session.memory = self.replicator.inventory.take if self.replicator is not None else \
            (lambda first: coordinator_pb2.MemoryReport() if first else None)
        if self.replicator is not None:  # with beacons, a changed report is what makes a stream message due
            self.session.memory_changed = self.replicator.inventory.changed
        set_identity(node=self.node_id)
        if s.train_cmd:
            spec = TrainSpec(
                job=s.train_job, cmd=tuple(shlex.split(s.train_cmd)), nproc_per_node=s.nproc_per_node,
                min_nodes=s.min_nodes, max_nodes=s.max_nodes, max_restarts=s.max_restarts,
                coordinators=s.coordinators, node_id=self.node_id, host=s.effective_host, socket=sock,
                log_path=s.workdir / "train.log", hang_timeout_s=s.hang_timeout_s,
                hang_startup_grace_s=s.hang_startup_grace_s, pki_dir=s.pki_dir, on_no_spare=s.on_no_spare)
            self.prefetch = Prefetcher(self.node_id, s.train_job, s.nproc_per_node, self._restore_target,
                                       self.peers.fetch)
            self.training = (WarmTrainingSupervisor(spec, self.supervisor, self.client, self._report_hang)
                             if s.launcher == "warm" else
                             TrainingSupervisor(spec, self.supervisor, self._report_hang, self._job_closed))
        self.rtt.start()
        if s.preemption.sources:
            self.preemption = PreemptionWatcher.from_config(s.preemption, self.handover.on_notice)
            self.preemption.start()
        threading.Thread(target=self.session.run, name="ftd-heartbeat", daemon=True).start()
        if self.session.beacons is not None:  # its own thread: nothing else can hold a beacon up
            threading.Thread(target=self.session.beacons.run, name="ftd-beacons", daemon=True).start()
        threading.Thread(target=self.tiering.run, args=(self._stop,), name="ftd-tiering", daemon=True).start()
        if self.guard is not None:
            threading.Thread(target=self.deny.run, args=(self._stop,), name="ftd-deny-list", daemon=True).start()
        if self.replicator is not None:
            threading.Thread(target=self.replicator.run, args=(self._stop,), name="ftd-replicator", daemon=True).start()
        log.info("agent %s serving on %s (%s) and unix:%s (metrics %s); coordinators %s", self.node_id,
                 self.address, f"mTLS as node/{self.node_id}" if self.identity else "PLAINTEXT", sock,
                 self.metrics_address or "off", s.coordinators)
        if s.ready_file:
            tmp = s.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "node_id": self.node_id, "address": self.address,
                                       "socket": str(sock), "metrics": self.metrics_address}))
            os.replace(tmp, s.ready_file)
        systemd.notify(f"READY=1\nSTATUS=node {self.node_id} serving on {self.address}")

    def _healthy(self) -> tuple[bool, str]:
        idle = time.monotonic() - self._loop_at
        return (idle < 10.0, f"main loop ran {idle:.1f}s ago")

    def _ready(self) -> tuple[bool, str]:
        session = getattr(self, "session", None)
        if session is None or not session.connected:
            return False, f"node {self.node_id} is not heartbeating to a coordinator leader"
        return True, f"node {self.node_id} heartbeating to {session.leader_address}, epoch {session.assignment.epoch}"

    def request_stop(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        watchdog = systemd.Watchdog()
        period = min(1.0, watchdog.period or 1.0)
        while not self._stop.wait(min(period, 0.5)):
            self._loop_at = time.monotonic()
            in_flight = list(self._saves_in_flight.values())
            self.metrics.save_in_progress.set(time.monotonic() - min(in_flight) if in_flight else 0.0)
            if self.training is not None:
                self.training.tick()
                self.metrics.standbys_ready.set(self.training.standbys_ready())
            self._maybe_retarget_rtt()
            self._maybe_plan_landing()
            self.supervisor.reap()
            self._publish_tier_metrics()
            watchdog.tick()

    def _maybe_retarget_rtt(self) -> None:
        """Chooses the RTT probe targets again when the leader, the epoch or the peers the coordinator
        named (``Assignment.peers``: the buddy, the addresses) changed; all of it is in the assignment."""
        session = getattr(self, "session", None)
        if session is None:
            return
        assignment = session.assignment
        key = (session.leader_address, assignment.epoch, assignment.peers.SerializeToString(deterministic=True))
        if key == self._rtt_key:
            return
        self._rtt_key = key
        self.rtt.set_targets(rtt.plan(self.node_id, assignment, session.leader_address))

    def stop(self) -> None:
        log.info("stopping agent %s", self.node_id)
        systemd.notify("STOPPING=1")
        self._stop.set()
        if self.training is not None:
            self.training.stop("the agent is stopping")
        self.session.stop()
        self.health_monitor.stop(timeout_s=2.0)
        self.rtt.stop(timeout_s=2.0)
        if self.preemption is not None:
            self.preemption.stop(timeout_s=2.0)
        self.server.stop(grace=1.0).wait(2.0)
        self.local_server.stop(grace=1.0).wait(2.0)
        if self.bulk is not None:
            self.bulk.close()
        if self.landing is not None:
            self.landing.close()
        self.client.close()


def slowest(timings: dict[int, cluster_pb2.StepTiming]) -> cluster_pb2.StepTiming:
    """The node's step timing: its slowest rank's latest (the rank that holds the others back)."""
    return max(timings.values(), key=lambda t: t.compute_s)
