"""Who is in the cluster: registration, heartbeat streams, and the detect → plan → commit tick.

* Heartbeats touch memory only (:class:`~.detector.Liveness`); etcd sees membership changes only.
* Decisions are pure functions (:func:`~.admission.decide_registration`, :func:`~.detector.judge`,
  :func:`~.placement.plan`, :func:`~.buddies.choose_buddies`); this class feeds them the clocks and
  the view, commits what they decided through :class:`~.leader_state.LeaderState`, and only then
  believes it.
* Every node's buddy and peer addresses (:mod:`.buddies`) are chosen again when the world or the set
  of alive nodes changed, and pushed to the nodes whose choice changed (``Assignment.peers``).
* Liveness also comes as UDP beacons (:mod:`.beacon_listener`): each stream gets a key on its first
  answer; a beaconing node that falls silent is probed on its stream before the detector may act.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ftd.beacons import Beacon, encode_echo
from ftd.logs import set_identity
from ftd.promotion_fitness import eligible_for_promotion
from ftd.v1 import cluster_pb2, coordinator_pb2

from . import buddies, errors, handover_rules, rate_limits, validation
from .admission import check_heartbeat, decide_registration, validate_register
from .beacon_listener import BeaconBook, BeaconKey, admit, answer_due, echo_due, judged_on_beacons, probe_due
from .detector import RECONNECT_MAX, Hold, Liveness, Reconnects, State, Verdict, judge, mass_hold
from .guard_metrics import guard_metrics
from .leader_state import LeaderState
from .metrics import CoordinatorMetrics
from .placement import collectable, plan, replan_due
from .recovery import RecoveryTracker
from .revocations import admitted
from .settings import CoordinatorSettings
from .view import ClusterView, Runtime

log = logging.getLogger("ftd.coordinator")

ACK, PUSH = "ack", "push"
GC_PERIOD_S = 30.0  # how often the tick looks for fenced node records past their retention
GC_MAX_PER_COMMIT = 50
GONE = Liveness(last_seen=0.0)  # a stream's node the view no longer knows: not connected


@dataclass(eq=False)
class Stream:
    """One agent's open heartbeat stream. The handler writes whenever ``queue`` yields; ``None``
    closes the stream, with ``close_error`` as its status if set."""

    node_id: str
    incarnation: str
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    sent_epoch: int = -1
    sent_peers: buddies.PeerSet | None = None  # what the last Assignment.peers on this stream said
    last_write: float = -1e9  # monotonic time of the last answer written
    close_error: errors.CoordinatorError | None = None
    beacon: BeaconKey | None = None  # this stream's beacon key (None: this leader takes no beacons)
    beacon_sent: bool = False  # the BeaconTarget rode on an answer
    beaconing: bool = False  # the agent's latest message says it sends beacons (its stream carries changes only)
    quiet: bool = False  # ... and its beacons are confirmed, no probe pending (answered less often: ack_due)
    probed_at: float | None = None  # monotonic time of the last probe pushed
    probe_pending: bool = False  # the next answer carries probe=true

    def close(self, error: errors.CoordinatorError | None = None) -> None:
        self.close_error = error
        self.queue.put_nowait(None)


class Membership:
    def __init__(self, state: LeaderState, settings: CoordinatorSettings, metrics: CoordinatorMetrics,
                 wake: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, limiter: rate_limits.WriteLimiter | None = None) -> None:
        self.state = state
        self.limiter = limiter or rate_limits.WriteLimiter(clock=clock)
        self.fenced_node_retention_s = settings.fenced_node_retention_s
        self._gc_at = -1e18
        self.settings = settings
        self.metrics = metrics
        self.wake = wake  # runs the next tick now
        self.clock = clock  # monotonic: liveness, detection, recovery timing
        self.wall = wall  # unix time: registration and fence records
        self.streams: dict[str, Stream] = {}
        self.beacons: BeaconBook | None = None  # set once the beacon port is bound (None: beacons off)
        # Set by main: reads every beacon waiting on the port, so that a tick never judges a silence
        # whose beacons are queued in the socket (the loop was busy with other work).
        self.drain_beacons: Callable[[], None] = lambda: None
        self.beacons_lost: Callable[[], bool] = lambda: True  # set by main: the port dropped datagrams since asked
        self.recovery = RecoveryTracker()
        self.changed = False  # membership changed since the gauges were last published
        self._lock = asyncio.Lock()
        self._last_judged: float | None = None
        self._transitions = 0  # verdict state changes: part of the key of the placement's inputs
        self._planned: tuple[object, float] | None = None  # the key and time of the last plan that found nothing
        self._hold: Hold | None = None  # the last mass silence's hold (detector.mass_hold)
        self._declared: deque[float] = deque()  # when this leader declared deaths, lately (one entry each)
        self._reconnects = Reconnects(-1e18, 0.0)  # this term's reconnect storm (detector.reconnect_grace_until)
        self._peers_stale = True  # the world or the alive set may have changed since the buddies were chosen
        self._ring: list[buddies.Peer] = []  # the alive nodes the buddies were chosen among, by node id
        self._ring_ids: list[str] = []
        self._reachable: dict[str, buddies.Listed] = {}  # nodes neither dead nor fenced, with an agent address
        self._every: tuple[buddies.Listed, ...] = ()  # _reachable in node id order: the complete listing
        self._buddies: dict[str, buddies.Buddy] = {}
        self._mirrors: dict[str, tuple[str, ...]] = {}  # buddy -> the nodes whose replicas it keeps
        # Set by the controller: each heartbeat's progress goes to the straggler watch, which also
        # names spares not to promote (replaced as stragglers, no passing health check since).
        self.on_progress: Callable[[str, cluster_pb2.Progress], None] = lambda node_id, progress: None
        # a node's memory report (node, incarnation, report): the catalog's ledger (memory_ledger.py)
        self.on_memory: Callable[[str, str, coordinator_pb2.MemoryReport], None] = lambda n, i, r: None
        self.memory_holders: Callable[[str, int], set[str]] = lambda job, rank: set()  # nodes with it in memory
        # Set by the controller: each committed failure of a node of the job (cause, node, since: its last
        # sign of life, unix s; None: not known) goes to the goodput ledger.
        self.on_failure: Callable[[str, str, float | None], None] = lambda cause, node_id, since: None
        self.also_unfit: Callable[[dict[str, cluster_pb2.HealthVerdict | None]], dict[str, str]] = lambda v: {}
        # Who may register as active (coordinator/admission.py): with no identities (no pki_dir), everyone.
        trusted = settings.identity is None or "*" in settings.admitted_nodes
        self._preadmitted = None if trusted else frozenset(settings.admitted_nodes)

    def new_term(self) -> None:
        """A new leadership term: the first judgement has no previous one to measure a stall from, and
        the buddies are chosen afresh from the reloaded view."""
        self._last_judged, self._planned = None, None
        self._hold = None
        self._declared.clear()
        self._reconnects = Reconnects(self.clock(), self.settings.failover_grace_s)
        self._peers_stale = True

    # ---- registration ------------------------------------------------------------------------

    async def register(self, req: coordinator_pb2.RegisterRequest) -> coordinator_pb2.RegisterResponse:
        validate_register(req)
        self.limiter.check("Register", req.node_id)
        async with self._lock:
            view = self.state.require_leader()
            now = self.clock()
            decision = decide_registration(view, req, self.wall(), admitted(view, req.node_id), self._preadmitted)
            if isinstance(decision, errors.CoordinatorError):
                raise decision
            if decision.record is None:
                return coordinator_pb2.RegisterResponse(assignment=self.assignment(view, req.node_id, True),
                                                        message=decision.message)
            message = decision.message
            event = ("node_registered", req.node_id, f"{req.node_id} on {req.host}: {message}")
            await self.state.commit("register", nodes=[decision.record], events=[event])
            view.liveness[req.node_id] = Liveness(last_seen=now)
            view.runtime[req.node_id] = Runtime(incarnation=req.incarnation)
            view.verdicts.pop(req.node_id, None)
            old = self.streams.pop(req.node_id, None)
            if old is not None and old.incarnation != req.incarnation:
                old.close(errors.StaleIncarnation(f"node {req.node_id} re-registered as a new incarnation"))
            log.info("node %s registered from %s (%s)", req.node_id, req.host, message)
            self.changed = self._peers_stale = True
            self.wake()
            return coordinator_pb2.RegisterResponse(assignment=self.assignment(view, req.node_id, True),
                                                    message=message)

    # ---- heartbeats (the hot path: memory only) ----------------------------------------------

    def open_stream(self, req: coordinator_pb2.HeartbeatRequest) -> Stream:
        view = self.state.require_leader()
        node = check_heartbeat(view, req)
        stream = Stream(req.node_id, req.incarnation)
        if self.beacons is not None:
            stream.beacon = self.beacons.issue(req.node_id)  # a fresh key per stream: a new leader, a new key
        old = self.streams.get(req.node_id)
        if old is not None:
            old.close()
        self.streams[req.node_id] = stream
        self.metrics.heartbeat_streams.set(len(self.streams))
        live = view.liveness.setdefault(node.node_id, Liveness(last_seen=self.clock()))
        live.connected, live.disconnected_at = True, None
        self.on_heartbeat(stream, req)
        return stream

    def on_heartbeat(self, stream: Stream, req: coordinator_pb2.HeartbeatRequest) -> None:
        view = self.state.require_leader()
        if req.node_id != stream.node_id:
            raise errors.InvalidArgument("node_id", f"changed within one stream ({stream.node_id} -> {req.node_id})")
        if req.incarnation != stream.incarnation:
            raise errors.InvalidArgument("incarnation", f"changed within the stream of node {stream.node_id}")
        validation.validate_heartbeat_payload(req)
        live = view.liveness.get(req.node_id)
        runtime = view.runtime.get(req.node_id)
        if live is None or runtime is None:
            raise errors.NodeNotFound(req.node_id)
        now = self.clock()
        live.last_seen = now
        live.connected, live.disconnected_at = True, None
        self._reconnects.arrived(req.node_id, now, live)  # its grace runs on: a storm delays its next ones too
        runtime.last_heartbeat = now
        runtime.known_epoch = req.known_epoch
        runtime.seq = req.seq
        stream.beaconing = req.beaconing
        stream.quiet = req.quiet and req.beaconing
        if req.HasField("health"):
            runtime.health = req.health
        if req.HasField("progress"):
            runtime.progress = req.progress
            self.on_progress(req.node_id, req.progress)
            if self.recovery.open is not None:
                self._recovery_progress(now, req.progress.step)
        if req.HasField("memory"):
            self.on_memory(req.node_id, req.incarnation, req.memory)
        self.metrics.heartbeats.inc()

    def on_beacon(self, beacon: Beacon) -> str | None:
        """One decoded beacon (the UDP handler's; keep it tiny): a valid one refreshes its node's
        liveness as a stream heartbeat does (not health, not progress). Returns the drop reason, if any."""
        view, book = self.state.view, self.beacons
        if view is None or book is None:
            return "not_leader"
        entry = book.keys.get(beacon.key_id)
        reason = admit(beacon, entry)
        if reason is not None or entry is None:
            return reason or "unknown_key"
        live = view.liveness.get(entry.node_id)
        if live is None:
            return "unknown_key"
        entry.seq_seen = beacon.seq
        now = self.clock()
        live.last_seen = now
        runtime = view.runtime.get(entry.node_id)
        if runtime is not None:
            runtime.last_heartbeat = now
        return None

    def echo(self, beacon: Beacon) -> bytes | None:
        """The echo an accepted beacon gets, if one is due (:func:`~.beacon_listener.echo_due`)."""
        book = self.beacons
        entry = book.keys.get(beacon.key_id) if book is not None else None
        if book is None or entry is None or not echo_due(entry.seq_seen, entry.echoed, book.interval_s):
            return None
        entry.echoed = entry.seq_seen
        return encode_echo(entry.key_id, entry.seq_seen, entry.key)

    def _probe(self, node_id: str, last_seen: float, now: float) -> None:
        """Asks a suspect beaconing node on its stream instead of letting its silence speak
        (:func:`~.beacon_listener.probe_due`): a live agent answers at once."""
        stream = self.streams.get(node_id)
        if stream is None or stream.beacon is None:
            return
        why = probe_due(now, last_seen, stream.beaconing, stream.probed_at, self.settings.suspect_after_s)
        if why is None:
            return
        stream.probed_at, stream.probe_pending = now, True
        stream.queue.put_nowait(PUSH)
        self.metrics.probes.inc()
        log.info("node %s: %s", node_id, why)

    def _recovery_progress(self, now: float, step: int) -> None:
        done = self.recovery.progress(now, step)
        if done is not None:
            self.metrics.recovery.observe(done.total_s)
            for phase, seconds in done.phases.items():
                self.metrics.recovery_phase.labels(phase).observe(seconds)
            log.warning("recovered: training steps again %.2fs after the node's last heartbeat (%s)",
                        done.total_s, ", ".join(f"{k} {v:.2f}s" for k, v in done.phases.items()))

    def round_started(self, restore_step: int) -> None:
        """The job started a round (after a death, it is the recovery's rendezvous phase ending)."""
        self.recovery.round_started(self.clock(), restore_step)

    def ack_due(self, stream: Stream) -> bool:
        """Answer a heartbeat only every ``heartbeat_ack_interval_s`` (or on news): each answer costs
        the leader as much as the heartbeat itself, and epoch changes are pushed anyway. A quiet
        stream (beacons carry its liveness, its messages are step reports) only every
        ``quiet_answer_interval_s``, which its agent was told (``BeaconTarget.answer_interval_s``)."""
        view = self.state.view
        if view is None or stream.sent_epoch != view.world.epoch:
            return True
        return answer_due(self.clock(), stream.last_write, stream.quiet and stream.beacon is not None,
                          self.settings.heartbeat_ack_interval_s, self.settings.quiet_answer_interval_s)

    def heartbeat_response(self, stream: Stream) -> coordinator_pb2.HeartbeatResponse:
        view = self.state.require_leader()
        stream.last_write = self.clock()
        with_world = stream.sent_epoch != view.world.epoch
        stream.sent_epoch = view.world.epoch
        response = coordinator_pb2.HeartbeatResponse(assignment=self.assignment(view, stream.node_id, with_world),
                                                     leader_id=self.settings.effective_replica_id)
        peers = self.peers_of(view, stream.node_id)
        if peers != stream.sent_peers:
            stream.sent_peers = peers
            response.assignment.peers.CopyFrom(buddies.peers_proto(peers))
        book = self.beacons
        if stream.beacon is not None and book is not None:
            if not stream.beacon_sent:
                stream.beacon_sent = True
                response.beacon.CopyFrom(book.target(stream.beacon))
            response.beacon_seq_seen = stream.beacon.seq_seen
        if stream.probe_pending:
            stream.probe_pending = False
            response.probe = True
        draining = [n for n in view.drains if view.rank_of(n) >= 0]
        if draining:
            response.draining.extend(sorted(draining))
            response.draining_reason = "; ".join(f"{n}: {view.drains[n].reason}" for n in sorted(draining))
        return response

    def assignment(self, view: ClusterView, node_id: str, with_world: bool) -> cluster_pb2.Assignment:
        """The node's assignment, with what its agent's data plane needs of this coordinator's settings."""
        out = view.assignment(node_id, with_world)
        out.unmanaged_jobs = self.settings.unmanaged_jobs
        return out

    # ---- buddies and peer addresses ----------------------------------------------------------

    def buddy_of(self, node_id: str) -> str | None:
        """The node mirroring ``node_id``'s memory snapshots as of the last tick (None: none chosen)."""
        buddy = self._buddies.get(node_id)
        return buddy.node_id if buddy is not None else None

    def peers_of(self, view: ClusterView, node_id: str) -> buddies.PeerSet:
        """What ``node_id`` is told in ``Assignment.peers``: its buddy and the addresses it needs."""
        label = self.settings.domain_label
        buddy = self._buddies.get(node_id)
        if buddy is None:  # dead, fenced, or registered since the last tick: chosen alone
            node = view.nodes.get(node_id)
            buddy = buddies.next_buddy(node_id, node.labels.get(label, "") if node is not None else "", self._ring,
                                       self._ring_ids, label)
        rank, job = view.rank_of(node_id), view.current_job()
        held: set[str] = set()
        if len(self._reachable) > buddies.INLINE_PEERS_MAX and rank >= 0 and job is not None:
            held = buddies.holders(view.catalog, job.job, rank) | self.memory_holders(job.job, rank)  # above the bound
        found = buddies.peers_for(node_id, buddy, self._reachable, view.world.ranks, held, every=self._every)
        return replace(found, mirrors=self._mirrors.get(node_id, ()))

    def _refresh_peers(self, view: ClusterView) -> None:
        """Chooses every node's buddy again once the world or the alive set changed, and pushes the
        answer to each connected node whose buddy or peer addresses changed."""
        if not self._peers_stale:
            return
        self._peers_stale = False
        label = self.settings.domain_label
        ring: list[buddies.Peer] = []
        reachable: dict[str, buddies.Listed] = {}
        for node_id in sorted(view.nodes):
            node = view.nodes[node_id]
            state, _ = view.state_of(node_id)
            # A suspect node is not acted on yet: it keeps holding replicas until it is declared dead.
            if not node.agent_address or state in (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED):
                continue
            reachable[node_id] = buddies.Listed(node_id, node.agent_address, view.rank_of(node_id))
            ring.append(buddies.Peer(node_id, node.labels.get(label, ""), True, node.agent_address))
        if ring == self._ring and reachable == self._reachable:
            return
        self._ring, self._reachable = ring, reachable
        self._ring_ids = [p.node_id for p in ring]  # sorted: view.nodes is walked in order
        self._every = tuple(reachable.values())
        self._buddies = buddies.choose_buddies(ring, label)
        self._mirrors = buddies.mirrored_by(self._buddies)
        for stream in self.streams.values():
            if self.peers_of(view, stream.node_id) != stream.sent_peers:
                stream.queue.put_nowait(PUSH)

    def close_stream(self, stream: Stream) -> None:
        if self.beacons is not None:
            self.beacons.revoke(stream.beacon)
        if self.streams.get(stream.node_id) is stream:
            del self.streams[stream.node_id]
            self.metrics.heartbeat_streams.set(len(self.streams))
            view = self.state.view
            if view is not None and stream.node_id in view.liveness:
                live, now = view.liveness[stream.node_id], self.clock()
                live.connected, live.disconnected_at = False, now
                # A closed stream is evidence even in a storm's grace: the node has the usual time to re-open it.
                live.grace_until = min(live.grace_until, now + self.settings.detector.disconnect_dead_after_s)

    def close_streams(self, error: errors.CoordinatorError | None) -> None:
        """Drops every stream, so agents cannot keep a deposed leader's picture alive."""
        for stream in list(self.streams.values()):
            stream.close(error)
        self.streams.clear()
        if self.beacons is not None:
            self.beacons.clear()
        self.metrics.heartbeat_streams.set(0)

    def push_all(self) -> None:
        """Sends every connected agent its assignment now (an epoch or a job round changed)."""
        for stream in self.streams.values():
            stream.queue.put_nowait(PUSH)

    # ---- detection and reconciliation --------------------------------------------------------

    async def tick(self) -> None:
        """Judges every node, commits the placement's next step, if any, then chooses the buddies again
        if the world or the alive set changed."""
        async with self._lock:
            view = self.state.require_leader()
            try:
                await self._reconcile(view)
            finally:
                if self.state.view is view:
                    self._refresh_peers(view)

    async def _reconcile(self, view: ClusterView) -> None:
        """Judges every node, then commits the placement's next step, if any."""
        self.drain_beacons()
        now = self.clock()
        self._judge(view, now)
        planned = self._handovers_due(view)
        inputs = (id(view), view.world_revision, view.last_event_seq, len(view.nodes), self._transitions,
                  tuple(view.forced_dead), tuple(sorted(planned)), tuple(view.drains))
        step = None
        if replan_due(now, inputs, self._planned):
            step = plan(self.wall(), view.world, view.nodes, view.verdicts, self.settings.domain_label,
                        self.settings.max_fences_per_epoch, self._unfit_spares(view), planned)
            self._planned = (inputs, now) if step is None else None
        if step is None:
            if now - self._gc_at >= GC_PERIOD_S:
                self._gc_at = now
                await self._collect(view)
            return
        handed = tuple(n for n in step.dead if n in planned)
        try:
            await self.state.commit("epoch" if step.world else "fence", nodes=step.nodes, world=step.world,
                                    events=step.events, kv_deletes=[handover_rules.key(n) for n in handed])
        except (errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
            self.changed = True  # publish the gauges now: they show what the leader could not fix
            return
        in_job = step.world is not None and view.current_job() is not None  # training was interrupted
        for node_id in handed:
            view.drains.pop(node_id, None)
            self.metrics.handovers.inc()
            log.warning("node %s handed over: %s", node_id, view.verdicts[node_id].reason)
            if in_job:
                self.on_failure("handed_over", node_id, None)
        for node_id in (n for n in step.dead if n not in planned):
            self.metrics.detection_latency.observe(view.verdicts[node_id].silent_s)
            self.metrics.nodes_declared_dead.inc()
            self._declared.append(now)
            log.warning("node %s fenced: %s", node_id, view.verdicts[node_id].reason)
            if in_job:
                verdict = view.verdicts[node_id]
                self.recovery.death_committed(self.clock(), verdict.silent_s, now)
                hung = verdict.reason.startswith("hung")  # it reported itself: its last step starts the incident
                self.on_failure("hung" if hung else "node_dead", node_id,
                                None if hung else self.wall() - verdict.silent_s)
        self.changed = self._peers_stale = True
        if step.world is not None:
            self.metrics.epoch_changes.inc()
            set_identity(epoch=step.world.epoch)
            size = len(step.world.ranks)
            shown = list(step.world.ranks) if size <= 16 else f"of {size} ranks"
            log.warning("epoch %d committed: world %s (%s)", step.world.epoch, shown, step.reason)
            self.push_all()

    async def _collect(self, view: ClusterView) -> None:
        """Removes the records of nodes fenced longer than the retention ago (and not back since), so
        that node ids that come and go do not pile up in etcd and in every ListNodes answer."""
        if self.fenced_node_retention_s <= 0:
            return
        keep = set(view.drains) | set(view.forced_dead) | set(self.streams)
        gone = collectable(self.wall(), view.world, view.nodes, self.fenced_node_retention_s, keep,
                           GC_MAX_PER_COMMIT)
        if not gone:
            return
        shown = ", ".join(gone[:8]) + (f" and {len(gone) - 8} more" if len(gone) > 8 else "")
        event = ("nodes_collected", gone[0] if len(gone) == 1 else "",
                 f"removed the records of {len(gone)} node(s) fenced more than "
                 f"{self.fenced_node_retention_s:.0f}s ago: {shown}")
        try:
            await self.state.commit("gc", node_deletes=gone, events=[event])
        except (errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
            return
        for node_id in gone:
            view.forget(node_id)
        guard_metrics(self.metrics.registry).nodes_collected.inc(len(gone))
        log.info("%s", event[2])
        self.changed = self._peers_stale = True

    def _handovers_due(self, view: ClusterView) -> set[str]:
        """Marks the drained nodes whose hand-over is due as leaving (a verdict the placement acts on)
        and returns them; a drain whose node is gone already is dropped."""
        due: set[str] = set()
        job = view.current_job()
        for node_id, drain in list(view.drains.items()):
            node = view.nodes.get(node_id)
            if node is None or node.fenced:
                view.drains.pop(node_id, None)
                continue
            in_job = job is not None and not job.closed and view.rank_of(node_id) >= 0
            restore = view.newest_restorable(job.job) if job is not None else -1
            parked = handover_rules.parked_step_of([
                rt.progress.parked_step for n in view.world.ranks
                if (rt := view.runtime.get(n)) is not None and rt.progress is not None
                and rt.progress.HasField("parked_step")]) if in_job else None
            ready, why = handover_rules.handover_due(self.wall(), drain, restore, in_job, self.settings.handover,
                                                     parked)
            if ready:
                view.verdicts[node_id] = Verdict(State.DEAD, f"planned hand-over ({drain.reason}): {why}", 0.0)
                due.add(node_id)
        return due

    def _unfit_spares(self, view: ClusterView) -> dict[str, str]:
        """Spares that may not take a rank now, with why: a failing (or stale) health verdict, or a
        pending drain of their own."""
        unfit = {n: f"draining ({d.reason})" for n, d in view.drains.items()}
        now = self.wall()
        for node_id in view.runtime.keys() - set(view.world.ranks):  # only a node out of the world is promoted
            runtime = view.runtime[node_id]
            health = runtime.health
            verdict = health.verdict if health is not None and health.HasField("verdict") else None
            ok, why = eligible_for_promotion(verdict, now, self.settings.spare_health_max_age_s,
                                             self.settings.require_spare_health)
            if not ok:
                unfit.setdefault(node_id, why)
        for node_id, why in self.also_unfit(self._verdicts(view)).items():
            unfit.setdefault(node_id, why)
        return unfit

    @staticmethod
    def _verdicts(view: ClusterView) -> dict[str, cluster_pb2.HealthVerdict | None]:
        return {n: rt.health.verdict if rt.health is not None and rt.health.HasField("verdict") else None
                for n, rt in view.runtime.items()}

    def healthy_spares(self) -> int:
        """Spares that could take a rank now: alive, out of the world, fit for promotion."""
        view = self.state.require_leader()
        unfit = self._unfit_spares(view)
        return sum(1 for n, node in view.nodes.items() if not node.fenced and view.rank_of(n) < 0 and n not in unfit
                   and view.state_of(n)[0] == cluster_pb2.NODE_STATE_ALIVE)

    def _judge(self, view: ClusterView, now: float) -> None:
        detector = self.settings.detector
        # Verdicts of nodes heard from lately are reused as they were (detector.judge's ``previous``):
        # only the silent ones are judged and compared afresh, so a tick is cheap at 10,000 nodes.
        before_all = view.verdicts
        storm = self._reconnects
        if storm.extend(now, view.liveness, detector.dead_after_s, storm.missing(
                now, view.liveness, view.nodes, self.settings.mass_silence)) and not storm.logged:
            storm.logged = True
            log.warning("nodes still re-open their streams %.1fs after the election: the unheard keep their grace "
                        "while nodes arrive (%.0fs at most)", now - storm.since, RECONNECT_MAX * storm.grace_s)
        watched = judged_on_beacons(now, self._last_judged, detector.stall_after_s, self.beacons_lost(), lambda: (
            n for n, s in self.streams.items() if s.beaconing and s.beacon and view.liveness.get(n, GONE).connected))
        judgement = judge(now, view.liveness, detector, self._last_judged, before_all, watched)
        self._last_judged = now
        changed = len(judgement.verdicts) != len(before_all)
        if judgement.stalled:
            self.metrics.stalls.inc()
            log.warning("%s; granting %d node(s) %.1fs of grace (%d judged on the beacons queued for it)",
                        judgement.stall_reason, len(view.liveness) - len(watched), detector.dead_after_s, len(watched))
            for node_id, live in view.liveness.items():
                if node_id not in watched:
                    live.grace_until = max(live.grace_until, now + detector.dead_after_s)
        for node_id in list(view.forced_dead):
            node = view.nodes.get(node_id)
            if node is None or node.fenced:
                del view.forced_dead[node_id]
        forced = view.forced_dead
        verdicts = dict(judgement.verdicts)
        self._hold_mass(view, now, verdicts)  # after a stall only the watched can be dying
        for node_id, verdict in verdicts.items():
            before = before_all.get(node_id)
            if before is verdict or node_id in forced:
                continue
            if verdict.state is State.SUSPECT and not judgement.stalled:  # a stall: silences are not evidence
                self._probe(node_id, view.liveness[node_id].last_seen, now)
            if before is None or before.state is not verdict.state:
                self._transitions += 1  # a placement input (placement.replan_due)
                # The buddy ring leaves out only dead and fenced nodes: a suspect coming and going (a
                # late beacon under load) changes nothing there, and the ring costs O(nodes) to rebuild.
                changed = changed or before is None or State.DEAD in (before.state, verdict.state)
                if before is not None or verdict.state is not State.ALIVE:
                    node = view.nodes.get(node_id)
                    if node is not None and not node.fenced:
                        log.info("node %s is %s: %s", node_id, verdict.state.value, verdict.reason)
        view.verdicts = verdicts
        for node_id, why in forced.items():
            previous = before_all.get(node_id)
            changed = changed or previous is None or previous.state is not State.DEAD
            view.verdicts[node_id] = Verdict(State.DEAD, why, 0.0)
        if changed:
            self._peers_stale = True  # the alive set may have changed: the buddies are chosen again

    def _hold_mass(self, view: ClusterView, now: float, verdicts: dict[str, Verdict]) -> None:
        """A mass silence's deaths become suspicions while its hold lasts (detector.mass_hold)."""
        dying = [n for n, v in verdicts.items() if v.state is State.DEAD and n not in view.forced_dead
                 and (node := view.nodes.get(n)) is not None and not node.fenced]
        while self._declared and now - self._declared[0] > self.settings.dead_after_s:
            self._declared.popleft()
        last = self._hold  # those heard during the last hold and silent again: still overloaded (mass_hold)
        back = sum(verdicts[n].silent_s < now - last.since for n in dying) if last is not None else 0
        hold = mass_hold(now, len(dying), len(self._declared), len(verdicts), last, self.settings.mass_silence, back)
        if hold is None:
            return
        if hold is not last:
            self._hold = hold
            self.metrics.mass_silence_holds.inc()
            log.warning("mass silence: %s", hold.reason)
        for n in (n for n in dying if verdicts[n].silent_s < hold.declare_over):
            v, left = verdicts[n], hold.until - now
            verdicts[n] = Verdict(State.SUSPECT, f"{v.reason}; held {left:.1f}s more: mass silence", v.silent_s)
