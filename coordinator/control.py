"""The control loop of one coordinator replica: leadership, registration, heartbeat streams, and
the detect → plan → commit → apply cycle.

Rules this module keeps:

* Durable state changes only after a guarded commit succeeded (``_commit``); a failed commit leaves
  memory as it was, so the coordinator never acts on state it could not commit.
* Heartbeats touch memory only (:class:`~.detector.Liveness`); etcd sees membership changes only.
* A leader that cannot confirm its lease within its TTL suspends itself: it drops every heartbeat
  stream so that agents cannot keep a deposed leader's picture alive while another replica leads.
* A new (or resumed) leader reloads state from etcd and gives every node ``failover_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ftd import systemd
from ftd.logs import set_identity
from ftd.v1 import coordinator_pb2

from . import errors
from .catalog import CatalogKeeper
from .detector import Liveness, State, Verdict, judge
from .jobs import JobKeeper
from .metrics import CoordinatorMetrics
from .model import Event, LeaderInfo, NodeRecord, Role, valid_node_id
from .placement import plan
from .recovery import RecoveryTracker
from .settings import CoordinatorSettings
from .store import CommitResult, Guard, Lease, StaleStateError, StateStore, StoreRejected, StoreUnavailable
from .view import ClusterView, Runtime

log = logging.getLogger("ftd.coordinator")
T = TypeVar("T")

_ACK, _PUSH = "ack", "push"


@dataclass(eq=False)
class Stream:
    """One agent's open heartbeat stream. The handler writes whenever ``queue`` yields; ``None``
    closes the stream, with ``close_error`` as its status if set."""

    node_id: str
    incarnation: str
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    sent_epoch: int = -1
    last_write: float = -1e9  # monotonic time of the last answer written
    close_error: errors.CoordinatorError | None = None

    def close(self, error: errors.CoordinatorError | None = None) -> None:
        self.close_error = error
        self.queue.put_nowait(None)


class Controller:
    def __init__(
        self,
        store: StateStore,
        settings: CoordinatorSettings,
        address: str,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings
        self.replica_id = settings.effective_replica_id
        self.address = address
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        self.view: ClusterView | None = None
        self.lease: Lease | None = None
        self.suspended = False
        self.known_leader: LeaderInfo | None = None
        self.etcd_ok = True
        self.streams: dict[str, Stream] = {}
        self._last_confirmed = 0.0
        self._last_judged: float | None = None
        self._membership = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self.catalog = CatalogKeeper(self)
        self.jobs = JobKeeper(self)
        self.recovery = RecoveryTracker()
        self.last_tick_at = self.clock()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._data_pool = ThreadPoolExecutor(4, thread_name_prefix="ftd-etcd")
        self._lease_pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-lease")
        self._outage_logged = False
        self._reload = False
        self._gauges_at = -1e9

    # ---- helpers -----------------------------------------------------------------------------

    async def _in(self, pool: ThreadPoolExecutor, op: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except StoreUnavailable as exc:
            self.metrics.etcd_errors.labels(op).inc()
            self.etcd_ok = False
            if not self._outage_logged:
                log.warning("etcd unreachable (%s); membership changes are on hold", exc)
                self._outage_logged = True
            raise
        if not self.etcd_ok:
            log.info("etcd reachable again")
        self.etcd_ok, self._outage_logged = True, False
        return result

    @property
    def is_leader(self) -> bool:
        return self.lease is not None and not self.suspended and self.view is not None

    def leader_address(self) -> str:
        if self.is_leader:
            return self.address
        if self.lease is not None:
            return ""  # we hold the lease but cannot confirm it: nobody is known to lead
        return self.known_leader.address if self.known_leader else ""

    def require_leader(self) -> ClusterView:
        if self.is_leader:
            assert self.view is not None
            return self.view
        why = "cannot confirm its leadership (etcd unreachable)" if self.lease else "is a standby"
        raise errors.NotLeader(self.replica_id, self.leader_address(), why)

    def _close_streams(self, error: errors.CoordinatorError | None) -> None:
        for stream in list(self.streams.values()):
            stream.close(error)
        self.streams.clear()
        self.metrics.heartbeat_streams.set(0)

    # ---- leadership --------------------------------------------------------------------------

    async def _load_view(self) -> ClusterView:
        snap = await self._in(self._data_pool, "load", self.store.load)
        return ClusterView.from_snapshot(snap, self.clock(), self.settings.failover_grace_s)

    async def _become_leader(self, lease: Lease) -> None:
        self.lease, self.known_leader = lease, lease.leader
        self._last_confirmed = self.clock()
        try:
            self.view = await self._load_view()
        except StoreUnavailable:
            self.suspended = True  # hold the lease; the next keep-alive retries the load
            return
        self.suspended = False
        self._last_judged = None
        self.metrics.is_leader.set(1)
        set_identity(role="leader", epoch=self.view.world.epoch)
        for problem in self.view.problems:
            log.error("%s (skipped; the step is treated as invalid)", problem)
        self._publish_gauges()
        log.info("elected leader at %s: epoch %d, %d nodes known, grace %.1fs", self.address,
                 self.view.world.epoch, len(self.view.nodes), self.settings.failover_grace_s)
        # The event is informational; if it cannot be written the keep-alive loop sorts leadership out.
        with contextlib.suppress(errors.StateUnavailable, StaleStateError):
            await self._commit("leader", events=[("leader_elected", "", f"{self.replica_id} leads at {self.address}")])

    async def _step_down(self, reason: str) -> None:
        log.warning("stepping down: %s", reason)
        self.lease, self.view, self.suspended, self.known_leader = None, None, False, None
        self.metrics.is_leader.set(0)
        set_identity(role="standby")
        self._close_streams(errors.NotLeader(self.replica_id, "", f"stepped down ({reason})"))

    async def _suspend(self, reason: str) -> None:
        log.warning("suspending leadership: %s", reason)
        self.suspended = True
        self.metrics.is_leader.set(0)
        self._close_streams(errors.NotLeader(self.replica_id, "", "cannot confirm its leadership (etcd unreachable)"))

    async def _standby_step(self) -> None:
        try:
            leader = await self._in(self._lease_pool, "current_leader", self.store.current_leader)
            if leader is None:
                lease = await self._in(self._lease_pool, "campaign", self.store.campaign,
                                       self.replica_id, self.address, self.settings.leader_ttl_s)
                if lease is not None:
                    await self._become_leader(lease)
                    return
                leader = await self._in(self._lease_pool, "current_leader", self.store.current_leader)
            if leader != self.known_leader and leader is not None:
                log.info("following leader %s at %s", leader.replica_id, leader.address)
            self.known_leader = leader
        except StoreUnavailable:
            pass

    async def _leader_step(self) -> bool:
        """Refreshes the lease; returns whether it was confirmed (if not, the loop retries soon)."""
        assert self.lease is not None
        sent = self.clock()
        try:
            still = await self._in(self._lease_pool, "keep_alive", self.store.keep_alive, self.lease)
        except StoreUnavailable:
            unconfirmed = self.clock() - self._last_confirmed
            if not self.suspended and unconfirmed > self.settings.leader_ttl_s:
                await self._suspend(f"lease unconfirmed for {unconfirmed:.1f}s (ttl {self.settings.leader_ttl_s}s)")
            return False
        if not still:
            await self._step_down("leader lease expired or was taken over")
            return False
        self._last_confirmed = sent
        if self.suspended or self.view is None or self._reload:
            self._reload = False
            log.info("leadership confirmed again; reloading state from etcd")
            await self._become_leader(self.lease)
        return True

    async def _leadership_loop(self) -> None:
        while not self._stopping.is_set():
            if self.lease is None:
                await self._standby_step()
                period = 0.2
            else:
                confirmed = await self._leader_step()
                period = 0.2 if self.suspended or not confirmed else self.settings.leader_ttl_s / 3
            await self._sleep(period)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # ---- commits -----------------------------------------------------------------------------

    async def _commit(self, kind: str, nodes: Sequence[NodeRecord] = (), world: Any = None,
                      events: Sequence[tuple[str, str, str]] = (), kv_puts: Mapping[str, bytes] | None = None,
                      kv_deletes: Sequence[str] = ()) -> CommitResult:
        """The only way durable state changes; one at a time (event sequence numbers are allocated
        here). Node records and the world are applied to memory on success; other records by the
        caller."""
        async with self._commit_lock:
            return await self._commit_locked(kind, nodes, world, events, kv_puts or {}, kv_deletes)

    async def _commit_locked(self, kind: str, nodes: Sequence[NodeRecord], world: Any,
                             events: Sequence[tuple[str, str, str]], kv_puts: Mapping[str, bytes],
                             kv_deletes: Sequence[str]) -> CommitResult:
        view = self.require_leader()
        assert self.lease is not None
        now = time.time()
        epoch = world.epoch if world is not None else view.world.epoch
        evs = [Event(view.last_event_seq + i + 1, now, k, msg, node_id, epoch)
               for i, (k, node_id, msg) in enumerate(events)]
        last_seq = view.last_event_seq + len(evs)
        guard = Guard(self.lease.leader, view.world_revision if world is not None else None)
        started = time.perf_counter()
        try:
            result = await self._in(self._data_pool, "commit", self.store.commit, guard, nodes, world, evs,
                                    max(0, last_seq + 1 - self.settings.max_events), kv_puts, kv_deletes)
        except StoreUnavailable as exc:
            raise errors.StateUnavailable(f"not committed, etcd unreachable: {exc}") from exc
        except StoreRejected as exc:
            self.metrics.etcd_errors.labels("commit_rejected").inc()
            log.error("etcd rejected a %s commit, nothing changed: %s", kind, exc)
            raise errors.StateRejected(f"not committed: {exc}") from exc
        except StaleStateError:
            self.metrics.etcd_errors.labels("commit_stale").inc()
            log.warning("commit refused by its guard; re-checking leadership and reloading state")
            self._reload = True
            raise
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        self.metrics.etcd_writes.labels(kind).inc()
        view.last_event_seq = last_seq
        for node in nodes:
            view.nodes[node.node_id] = node
        if world is not None:
            view.set_world(world, result.world_revision)
        return result

    # ---- registration ------------------------------------------------------------------------

    async def register(self, req: coordinator_pb2.RegisterRequest) -> coordinator_pb2.RegisterResponse:
        validate_register(req)
        async with self._membership:
            view = self.require_leader()
            now = self.clock()
            existing = view.nodes.get(req.node_id)
            role = Role.ACTIVE if req.role == 1 else Role.SPARE
            message = f"registered as {role.value}"
            registered_at = time.time()
            if existing is not None:
                verdict = view.verdicts.get(req.node_id)
                if not existing.fenced and existing.incarnation == req.incarnation and existing.host == req.host:
                    return coordinator_pb2.RegisterResponse(
                        assignment=view.assignment(req.node_id, True), message="already registered")
                if not existing.fenced and verdict is not None and verdict.state is State.DEAD:
                    raise errors.StateUnavailable(
                        f"node {req.node_id!r} was declared dead ({verdict.reason}) and is being fenced; "
                        "retry shortly to rejoin as a spare")
                if not existing.fenced and existing.host != req.host and view.is_live(req.node_id):
                    raise errors.NodeIdTaken(
                        f"node id {req.node_id!r} is held by a live node on host {existing.host!r} "
                        f"(registration came from host {req.host!r})")
                if existing.fenced:
                    assert existing.fence is not None
                    role = Role.SPARE
                    message = (f"node {req.node_id} was fenced at epoch {existing.fence.epoch} "
                               f"({existing.fence.reason}); it rejoins as a spare in epoch {view.world.epoch}")
                elif view.rank_of(req.node_id) >= 0:
                    message = f"re-registered; keeps rank {view.rank_of(req.node_id)} in epoch {view.world.epoch}"
                    registered_at = existing.registered_unix_s
            record = NodeRecord(
                node_id=req.node_id, host=req.host, requested_role=role, labels=dict(req.labels),
                agent_address=req.agent_address, pid=req.pid, incarnation=req.incarnation,
                registered_unix_s=registered_at,
            )
            await self._commit("register", nodes=[record],
                               events=[("node_registered", req.node_id, f"{req.node_id} on {req.host}: {message}")])
            view.liveness[req.node_id] = Liveness(last_seen=now)
            view.runtime[req.node_id] = Runtime(incarnation=req.incarnation)
            view.verdicts.pop(req.node_id, None)
            old = self.streams.pop(req.node_id, None)
            if old is not None and old.incarnation != req.incarnation:
                old.close(errors.StaleIncarnation(f"node {req.node_id} re-registered as a new incarnation"))
            log.info("node %s registered from %s (%s)", req.node_id, req.host, message)
            self._gauges_at = -1e9
            self._wake.set()
            return coordinator_pb2.RegisterResponse(assignment=view.assignment(req.node_id, True), message=message)

    # ---- heartbeats (the hot path: memory only) ----------------------------------------------

    def open_stream(self, req: coordinator_pb2.HeartbeatRequest) -> Stream:
        view = self.require_leader()
        node = self._check_heartbeat(view, req)
        stream = Stream(req.node_id, req.incarnation)
        old = self.streams.get(req.node_id)
        if old is not None:
            old.close()
        self.streams[req.node_id] = stream
        self.metrics.heartbeat_streams.set(len(self.streams))
        live = view.liveness.setdefault(node.node_id, Liveness(last_seen=self.clock()))
        live.connected, live.disconnected_at = True, None
        self.on_heartbeat(stream, req)
        return stream

    def _check_heartbeat(self, view: ClusterView, req: coordinator_pb2.HeartbeatRequest) -> NodeRecord:
        if not req.node_id:
            raise errors.InvalidArgument("node_id", "is required")
        if not valid_node_id(req.node_id):
            raise errors.InvalidArgument("node_id", f"{req.node_id[:200]!r} is not a valid node id")
        node = view.nodes.get(req.node_id)
        if node is None:
            raise errors.NodeNotFound(req.node_id)
        if req.incarnation != node.incarnation:
            raise errors.StaleIncarnation(
                f"node {req.node_id}: heartbeat from incarnation {req.incarnation!r}, but the registered "
                f"incarnation is {node.incarnation!r}; re-register")
        return node

    def on_heartbeat(self, stream: Stream, req: coordinator_pb2.HeartbeatRequest) -> None:
        view = self.require_leader()
        if req.node_id != stream.node_id:
            raise errors.InvalidArgument("node_id", f"changed within one stream ({stream.node_id} -> {req.node_id})")
        if req.incarnation != stream.incarnation:
            raise errors.InvalidArgument("incarnation", f"changed within the stream of node {stream.node_id}")
        live = view.liveness.get(req.node_id)
        runtime = view.runtime.get(req.node_id)
        if live is None or runtime is None:
            raise errors.NodeNotFound(req.node_id)
        now = self.clock()
        live.last_seen = now
        live.connected, live.disconnected_at = True, None
        live.grace_until = 0.0  # proven alive on this leader: from now on silence is evidence again
        runtime.last_heartbeat = now
        runtime.known_epoch = req.known_epoch
        runtime.seq = req.seq
        if req.HasField("health"):
            runtime.health = req.health
        if req.HasField("progress"):
            runtime.progress = req.progress
            if self.recovery.open is not None:
                done = self.recovery.progress(now, req.progress.step)
                if done is not None:
                    self.metrics.recovery.observe(done.total_s)
                    for phase, seconds in done.phases.items():
                        self.metrics.recovery_phase.labels(phase).observe(seconds)
                    log.warning("recovered: training steps again %.2fs after the node's last heartbeat (%s)",
                                done.total_s, ", ".join(f"{k} {v:.2f}s" for k, v in done.phases.items()))
        self.metrics.heartbeats.inc()

    def ack_due(self, stream: Stream) -> bool:
        """Answer a heartbeat only every ``heartbeat_ack_interval_s`` (or on news): each answer costs
        the leader as much as the heartbeat itself, and epoch changes are pushed anyway."""
        view = self.view
        if view is None or stream.sent_epoch != view.world.epoch:
            return True
        return self.clock() - stream.last_write >= self.settings.heartbeat_ack_interval_s

    def heartbeat_response(self, stream: Stream) -> coordinator_pb2.HeartbeatResponse:
        view = self.require_leader()
        stream.last_write = self.clock()
        with_world = stream.sent_epoch != view.world.epoch
        stream.sent_epoch = view.world.epoch
        leader = self.lease.leader.replica_id if self.lease else ""
        return coordinator_pb2.HeartbeatResponse(assignment=view.assignment(stream.node_id, with_world),
                                                 leader_id=leader)

    def close_stream(self, stream: Stream) -> None:
        if self.streams.get(stream.node_id) is stream:
            del self.streams[stream.node_id]
            self.metrics.heartbeat_streams.set(len(self.streams))
            if self.view is not None and stream.node_id in self.view.liveness:
                live = self.view.liveness[stream.node_id]
                live.connected, live.disconnected_at = False, self.clock()

    # ---- detection and reconciliation --------------------------------------------------------

    async def tick(self) -> None:
        if not self.is_leader:
            return
        async with self._membership:
            view = self.require_leader()
            now = self.clock()
            detector = self.settings.detector
            judgement = judge(now, view.liveness, detector, self._last_judged)
            self._last_judged = now
            if judgement.stalled:
                self.metrics.stalls.inc()
                log.warning("%s; granting every node %.1fs of grace", judgement.stall_reason, detector.dead_after_s)
                for live in view.liveness.values():
                    live.grace_until = max(live.grace_until, now + detector.dead_after_s)
            for node_id, verdict in judgement.verdicts.items():
                before = view.verdicts.get(node_id)
                if (before is None or before.state is not verdict.state) and not (
                        before is None and verdict.state is State.ALIVE):
                    node = view.nodes.get(node_id)
                    if node is not None and not node.fenced:
                        log.info("node %s is %s: %s", node_id, verdict.state.value, verdict.reason)
            view.verdicts = dict(judgement.verdicts)
            for node_id, why in list(view.forced_dead.items()):
                node = view.nodes.get(node_id)
                if node is None or node.fenced:
                    del view.forced_dead[node_id]
                else:
                    view.verdicts[node_id] = Verdict(State.DEAD, why, 0.0)
            step = plan(time.time(), view.world, view.nodes, view.verdicts, self.settings.domain_label,
                        self.settings.max_fences_per_epoch)
            if step is not None:
                try:
                    await self._commit("epoch" if step.world else "fence", nodes=step.nodes, world=step.world,
                                       events=step.events)
                except (errors.StateUnavailable, errors.StateRejected, StaleStateError, errors.NotLeader):
                    self._publish_gauges()
                    return
                for node_id in step.dead:
                    self.metrics.detection_latency.observe(view.verdicts[node_id].silent_s)
                    self.metrics.nodes_declared_dead.inc()
                    log.warning("node %s fenced: %s", node_id, view.verdicts[node_id].reason)
                    if step.world is not None and view.current_job() is not None:  # training was interrupted
                        self.recovery.death_committed(self.clock(), view.verdicts[node_id].silent_s, now)
                self._gauges_at = -1e9  # publish the change now
                if step.world is not None:
                    self.metrics.epoch_changes.inc()
                    set_identity(epoch=step.world.epoch)
                    size = len(step.world.ranks)
                    shown = list(step.world.ranks) if size <= 16 else f"of {size} ranks"
                    log.warning("epoch %d committed: world %s (%s)", step.world.epoch, shown, step.reason)
                    self.push_all()
            if now - self._gauges_at >= 1.0:
                self._publish_gauges()

    def push_all(self) -> None:
        """Sends every connected agent its assignment now (an epoch or a job round changed)."""
        for stream in self.streams.values():
            stream.queue.put_nowait(_PUSH)

    def wake(self) -> None:
        """Runs the reconciliation tick now rather than at the next period."""
        self._wake.set()

    def _publish_gauges(self) -> None:
        view = self.view
        if view is None:
            return
        self._gauges_at = self.clock()
        for state, count in view.counts().items():
            self.metrics.nodes.labels(state).set(count)
        self.metrics.epoch.set(view.world.epoch)
        self.metrics.world_size.set(len(view.world.ranks))
        self.metrics.world_target_size.set(view.world.target_size)
        self.metrics.spares.set(len(view.spares()))
        for job in view.jobs.values():
            self.metrics.job_round.labels(job.job).set(job.round)
            self.metrics.job_restarts.labels(job.job).set(job.restarts)
        self.catalog.publish_gauges()

    async def _tick_loop(self) -> None:
        watchdog = systemd.Watchdog()  # pinged from this loop: a wedged event loop gets restarted
        while not self._stopping.is_set():
            watchdog.tick()
            self.last_tick_at = self.clock()
            started = time.perf_counter()
            try:
                await self.tick()
                if self.is_leader:
                    self.metrics.tick_seconds.observe(time.perf_counter() - started)
            except Exception:  # the loop must survive any single bad tick
                log.exception("reconciliation tick failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.tick_s)
            self._wake.clear()

    # ---- queries -----------------------------------------------------------------------------

    def status(self) -> coordinator_pb2.ClusterStatus:
        view = self.require_leader()
        assert self.lease is not None
        return view.status(self.replica_id, self.address, self.lease.leader.since_unix_s, self.etcd_ok)

    def nodes(self) -> coordinator_pb2.ListNodesResponse:
        return coordinator_pb2.ListNodesResponse(nodes=self.require_leader().node_infos(self.clock()))

    async def events(self, limit: int) -> list[Event]:
        self.require_leader()
        try:
            return await self._in(self._data_pool, "list_events", self.store.list_events, limit)
        except StoreUnavailable as exc:
            raise errors.StateUnavailable(f"cannot read the event log: {exc}") from exc

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        set_identity(replica=self.replica_id, role="standby")
        self.metrics.is_leader.set(0)
        await asyncio.gather(self._leadership_loop(), self._tick_loop())

    async def stop(self) -> None:
        """Graceful stop: resign so a standby takes over at once instead of after the lease TTL."""
        self._stopping.set()
        lease = self.lease
        self.lease, self.view = None, None
        self._close_streams(errors.NotLeader(self.replica_id, "", "is shutting down"))
        if lease is not None:
            try:
                await self._in(self._lease_pool, "resign", self.store.resign, lease)
                log.info("resigned leadership")
            except StoreUnavailable:
                log.warning("could not resign; the lease will expire within %ss", self.settings.leader_ttl_s)
        self._data_pool.shutdown(wait=False, cancel_futures=True)
        self._lease_pool.shutdown(wait=False, cancel_futures=True)


def validate_register(req: coordinator_pb2.RegisterRequest) -> None:
    """Raises :class:`~.errors.InvalidArgument` naming the first malformed field."""
    if not req.node_id:
        raise errors.InvalidArgument("node_id", "is required")
    if not valid_node_id(req.node_id):
        raise errors.InvalidArgument(
            "node_id", f"{req.node_id[:200]!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    if not req.host or len(req.host) > 253 or any(c.isspace() or c == "/" for c in req.host):
        raise errors.InvalidArgument("host", f"{req.host[:200]!r} is not a host name or address")
    if req.role not in (1, 2):
        raise errors.InvalidArgument("role", f"must be ROLE_ACTIVE or ROLE_SPARE, got {req.role}")
    for key, value in req.labels.items():
        if not key or len(key) > 63 or not valid_node_id(key):
            raise errors.InvalidArgument("labels", f"label key {key[:80]!r} is not a valid label name")
        if len(value) > 253:
            raise errors.InvalidArgument("labels", f"label {key!r} value is longer than 253 characters")
    if req.agent_address:
        host, sep, port = req.agent_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise errors.InvalidArgument("agent_address", f"{req.agent_address[:200]!r} is not HOST:PORT")
    if req.pid < 0:
        raise errors.InvalidArgument("pid", f"must be >= 0, got {req.pid}")
    if not req.incarnation or len(req.incarnation) > 64:
        raise errors.InvalidArgument("incarnation", "is required (at most 64 characters)")

