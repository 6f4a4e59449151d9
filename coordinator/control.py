"""One coordinator replica: the leadership (lease) loop, the reconciliation tick loop, and the wiring
of the parts that do the work.

* :class:`~.committer.Committer` holds the leader's state and commits every change (guarded).
* :class:`~.membership.Membership` registers nodes, takes heartbeats and runs the detect → plan →
  commit tick; :class:`~.jobs.JobKeeper` and :class:`~.catalog.CatalogKeeper` keep the job rounds
  and the checkpoint catalog. All three see the leader only through :class:`~.leader_state.LeaderState`.

Rules the lease loop keeps:

* A leader that cannot confirm its lease within its TTL suspends itself: it drops every heartbeat
  stream so that agents cannot keep a deposed leader's picture alive while another replica leads.
* A new (or resumed) leader reloads state from etcd and gives every node ``failover_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from ftd import systemd
from ftd.logs import set_identity
from ftd.throttle import LogThrottle
from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors, rate_limits, validation
from .anomaly_log import AnomalyLog
from .catalog import CatalogKeeper
from .committer import Committer
from .drains import DrainKeeper
from .event_log import EventLog
from .fingerprint_watch import FingerprintWatch
from .gauges import AlarmWatch, Gauges
from .goodput_watch import GoodputWatch, goodput_proto
from .guard_metrics import guard_metrics
from .jobs import JobKeeper, JobPolicy
from .lease_keeper import LeaseKeeper
from .membership import Membership
from .memory_mirror import MirrorFeed, MirrorFollower
from .metrics import CoordinatorMetrics
from .revocations import AccessKeeper
from .rollbacks import RollbackKeeper
from .settings import CoordinatorSettings
from .store import Lease, StateStore, StoreRejected, StoreUnavailable
from .store_calls import StoreCalls
from .straggler_watch import StragglerWatch

log = logging.getLogger("ftd.coordinator")

STANDBY_POLL_S = 0.2  # how often a standby (or a leader that could not confirm its lease) tries again
ALARM_POLL_S = 5.0  # how often every replica reads etcd's alarms
MIN_KEEP_ALIVE_WAIT_S = 0.25  # the least a keep-alive is waited for, even past the trusted part of the lease
MAX_PROBLEM_EVENTS = 20  # corrupt records named one by one in the event log at election
MIRROR_SLACK_S = 1.0  # beyond the lease's TTL: a followed memory ledger this fresh at an election is kept
LOOP_LAG_TTLS = 2.0  # the lease keeper renews while the loop ran a tick within this many lease TTLs


class Controller:
    def __init__(
        self,
        store: StateStore,
        settings: CoordinatorSettings,
        address: str,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings
        self.replica_id = settings.effective_replica_id
        self.address = address
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock  # monotonic: liveness, leases, timing
        self.wall = wall  # unix time: what records and events say
        self.calls = StoreCalls(self.metrics)
        self.committer = Committer(store, self.calls, settings, self.metrics, clock, wall)
        self.security = guard_metrics(self.metrics.registry)
        self.limiter = rate_limits.WriteLimiter(
            settings.write_rate_per_node_s, settings.write_burst_per_node,
            clock=clock, on_limited=self.security.count_limited)
        self.membership = Membership(self.committer, settings, self.metrics, self.wake, clock, wall, self.limiter)
        self.jobs = JobKeeper(self.committer, round_started=self._round_started,
                              push_all=self.membership.push_all, wake=self.wake, wall=wall, limiter=self.limiter,
                              policy=JobPolicy(settings.job_min_nodes, settings.job_max_restarts,
                                               settings.job_on_no_spare))
        self.catalog = CatalogKeeper(self.committer, self.metrics, wall, self.limiter, settings.commit_step_slack,
                                     settings.unmanaged_jobs, settings.memory_report_deadline_s, clock)
        self.catalog.buddy_of = self.membership.buddy_of
        self.catalog.address = self.catalog.floors.address = address
        self.catalog.memory_in_etcd = settings.memory_snapshots_in_etcd
        self.membership.on_memory = self._take_memory  # memory snapshots: soft state (memory_ledger.py)
        self.mirror_feed = MirrorFeed(self.replica_id, lambda node: node in self.catalog.memory.reports, wall=wall)
        self.catalog.memory.on_forget = self.mirror_feed.forget
        self.mirror = MirrorFollower(self.replica_id, self.catalog.memory, self.mirror_feed, settings.identity, clock,
                                     self.metrics.mirrored)
        self.membership.memory_holders = self.catalog.memory.holders
        self.drains = DrainKeeper(self.committer, push_all=self.membership.push_all, wake=self.wake, wall=wall)
        self.access = AccessKeeper(self.committer, wall)  # the deny list and the operator's admissions
        self.stragglers = StragglerWatch(self.committer, settings.straggler, self.metrics, self.drains.drain, clock,
                                         wall)
        self.rollbacks = RollbackKeeper(self.committer, settings.rollback, self.jobs, self.catalog,
                                        self.metrics.rollbacks, clock, wall)
        self.catalog.held = self.rollbacks.held
        self.rollbacks.wake = self.wake
        self.fingerprints = FingerprintWatch(self.committer, self.rollbacks, self.metrics.fingerprint_checks,
                                             settings.fingerprint_confirmations, clock)
        self.anomalies = AnomalyLog(self.committer, self.metrics.step_anomalies, self.rollbacks.observe)
        self.membership.on_progress = self._on_progress
        self.goodput = GoodputWatch(self.committer, wall)
        self.membership.on_failure = self.goodput.failure
        self.jobs.on_round = self.goodput.round_started
        self.metrics.job_goodput.source = self.goodput.samples
        self.membership.also_unfit = self.stragglers.unfit
        self.gauges = Gauges(self.committer, self.membership, self.catalog, self.metrics, self.security, clock)
        self.alarms = AlarmWatch(store, self.calls, self.committer, self.security)
        self.event_log = EventLog(store, self.calls)
        self._alarms_at = -1e9
        self._errors = LogThrottle(log)
        self.last_tick_at = self.clock()
        self._last_confirmed = 0.0
        # renews the lease from a thread while the loop is busy (lease_keeper.py); run() turns it on, so
        # that tests driving the controller by hand on a fake clock see only the leases they renew
        self.keeper = LeaseKeeper(lambda lease: self.calls.lease_now(self.store.keep_alive, lease),
                                  settings.leader_ttl_s, clock, lambda: self.last_tick_at,
                                  LOOP_LAG_TTLS * settings.leader_ttl_s)
        self._keeper_on = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self.committer.is_leader

    def leader_address(self) -> str:
        return self.committer.leader_address()

    def wake(self) -> None:
        """Runs the reconciliation tick now rather than at the next period."""
        self._wake.set()

    # ---- leadership --------------------------------------------------------------------------

    async def leadership_step(self) -> float:
        """One turn of the lease loop: a standby looks for (or campaigns for) the leadership, a leader
        refreshes its lease. Returns the seconds until the next turn."""
        if self.committer.lease is None:
            await self._standby_step()
            return STANDBY_POLL_S
        confirmed = await self._leader_step()
        return STANDBY_POLL_S if self.committer.suspended or not confirmed else self.settings.leader_ttl_s / 3

    async def _become_leader(self, lease: Lease) -> None:
        state = self.committer
        state.lease, state.known_leader = lease, lease.leader
        self._last_confirmed = self.clock()
        if self._keeper_on:
            self.keeper.start(lease)
        try:
            state.view = await state.load()
        except StoreUnavailable:
            state.suspended = True  # hold the lease; the next keep-alive retries the load
            return
        state.suspended = False
        self.membership.new_term()
        # The agents re-announce their memory snapshots; until then the ledger followed from the last
        # leader stands in for them if it is fresh (memory_mirror.py).
        now = self.clock()
        keep = self.mirror.usable(now, self.settings.leader_ttl_s + MIRROR_SLACK_S)
        if keep:
            log.info("memory ledger: %d nodes' reports followed from leader %s (heard %.1fs ago) kept until each "
                     "node reports here", len(self.catalog.memory.reports), self.mirror.source,
                     now - self.mirror.heard_at)
        self.mirror.forget()
        self.catalog.memory.new_term(now, state.view.nodes, keep)
        self.mirror_feed.reset(keep)
        self.stragglers.new_term()
        self.rollbacks.new_term()
        self.fingerprints.new_term()
        self.goodput.new_term()
        self.metrics.is_leader.set(1)
        set_identity(role="leader", epoch=state.view.world.epoch)
        state.view.etcd_alarms = list(self.alarms.raised)
        problems = state.view.problems
        for problem in problems[:MAX_PROBLEM_EVENTS]:
            log.error("%s (skipped: the leader goes on without it; ftctl status lists it)", problem)
        self.security.corrupt_records.set(len(problems))
        self.gauges.publish()
        log.info("elected leader at %s: epoch %d, %d nodes known, grace %.1fs", self.address,
                 state.view.world.epoch, len(state.view.nodes), self.settings.failover_grace_s)
        events = [("leader_elected", "", f"{self.replica_id} leads at {self.address}")]
        events += [("corrupt_record", "", f"skipped: {p}") for p in problems[:MAX_PROBLEM_EVENTS]]
        if len(problems) > MAX_PROBLEM_EVENTS:
            events.append(("corrupt_record", "", f"... and {len(problems) - MAX_PROBLEM_EVENTS} more corrupt records"))
        # The events are informational; if they cannot be written the keep-alive loop sorts leadership out.
        with contextlib.suppress(errors.StateUnavailable, errors.StateRejected):
            await state.commit("leader", events=events)

    async def _step_down(self, reason: str) -> None:
        log.warning("stepping down: %s", reason)
        self.keeper.stop()
        state = self.committer
        state.lease, state.view, state.suspended, state.known_leader = None, None, False, None
        self.metrics.is_leader.set(0)
        self.metrics.recovery_open.set(0)
        set_identity(role="standby")
        self.membership.close_streams(errors.NotLeader(self.replica_id, "", f"stepped down ({reason})"))
        self.mirror_feed.close()

    async def _suspend(self, reason: str) -> None:
        log.warning("suspending leadership: %s", reason)
        self.committer.suspended = True
        self.metrics.is_leader.set(0)
        self.metrics.recovery_open.set(0)
        self.membership.close_streams(
            errors.NotLeader(self.replica_id, "", "cannot confirm its leadership (etcd unreachable)"))
        self.mirror_feed.close()

    async def _standby_step(self) -> None:
        state = self.committer
        try:
            leader = await self.calls.lease("current_leader", self.store.current_leader)
            if leader is None:
                lease = await self.calls.lease("campaign", self.store.campaign,
                                               self.replica_id, self.address, self.settings.leader_ttl_s,
                                               self.committer.wall())
                if lease is not None:
                    await self._become_leader(lease)
                    return
                leader = await self.calls.lease("current_leader", self.store.current_leader)
            if leader != state.known_leader and leader is not None:
                log.info("following leader %s at %s", leader.replica_id, leader.address)
            state.known_leader = leader
        except StoreUnavailable:
            pass
        except StoreRejected as exc:  # a full etcd (NOSPACE) refuses new leases: nobody can campaign
            self._errors.log(logging.ERROR, "campaign_rejected", "cannot campaign for the leadership: %s", exc)

    async def _leader_step(self) -> bool:
        """Refreshes the lease; returns whether it was confirmed (if not, the loop retries soon)."""
        state = self.committer
        assert state.lease is not None
        sent = self.clock()
        # Lead only while the lease is surely ours: a keep-alive confirmed at ``sent`` keeps the lease
        # in etcd until at least sent + ttl (an etcd leader change even renews it), so this replica
        # stops leading a sixth of the ttl before that (and does not wait out a hung call past it): a
        # standby can only campaign after the expiry, so two replicas never act as leader at once. The
        # margin stays small so that an etcd leader election (about a second) does not suspend it.
        trust = self.settings.leader_ttl_s * 5 / 6
        if self.keeper.lost:
            await self._step_down("leader lease expired or was taken over (seen by the lease keeper)")
            return False
        self._last_confirmed = max(self._last_confirmed, self.keeper.confirmed)
        budget = max(MIN_KEEP_ALIVE_WAIT_S, self._last_confirmed + trust - sent)
        try:
            still = await asyncio.wait_for(self.calls.lease("keep_alive", self.store.keep_alive, state.lease), budget)
        except (StoreUnavailable, StoreRejected, asyncio.TimeoutError):
            unconfirmed = self.clock() - self._last_confirmed
            if not state.suspended and unconfirmed >= trust:
                await self._suspend(f"lease unconfirmed for {unconfirmed:.1f}s (ttl {self.settings.leader_ttl_s}s: "
                                    f"leading stops after {trust:.1f}s)")
            return False
        if not still:
            await self._step_down("leader lease expired or was taken over")
            return False
        self._last_confirmed = sent
        if state.suspended or state.view is None or state.reload_wanted:
            state.reload_wanted = False
            log.info("leadership confirmed again; reloading state from etcd")
            await self._become_leader(state.lease)
        return True

    def _take_memory(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport) -> None:
        """A node's memory report: into the ledger, and as taken to the standbys following it."""
        self.catalog.take_report(node, incarnation, report)
        kept = self.catalog.memory.taken_as(node, incarnation, report)
        if kept is not None:
            self.mirror_feed.add(node, incarnation, kept)

    def _follow_target(self) -> tuple[str, str] | None:
        """The leader a standby follows the memory ledger of (none while this replica holds the lease)."""
        leader = self.committer.known_leader
        if self.committer.lease is not None or leader is None or leader.replica_id == self.replica_id:
            return None
        return leader.replica_id, leader.address

    async def _follow_loop(self) -> None:
        """A standby follows the leader's memory ledger (memory_mirror.py), again after every end."""
        task: asyncio.Task[None] | None = None
        following: tuple[str, str] | None = None
        try:
            while not self._stopping.is_set():
                want = self._follow_target()
                if want != following or (task is not None and task.done()):
                    if task is not None:
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
                    task = asyncio.create_task(self.mirror.follow(*want)) if want is not None else None
                    following = want
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), STANDBY_POLL_S)
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _leadership_loop(self) -> None:
        while not self._stopping.is_set():
            period = await self.leadership_step()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)

    # ---- reconciliation ----------------------------------------------------------------------

    async def tick(self) -> None:
        """One detection + reconciliation tick (a no-op on a standby), then the gauges when due; every
        replica polls etcd's alarms."""
        now = self.clock()
        if now - self._alarms_at >= ALARM_POLL_S:
            self._alarms_at = now
            await self.alarms.poll()
        if not self.is_leader:
            return
        await self.membership.tick()
        if self.committer.view is not None:
            await self.stragglers.tick(self.membership.healthy_spares)
            await self.anomalies.flush()
            await self.rollbacks.tick()
            await self.fingerprints.tick()
            await self.goodput.tick()
        if self.membership.changed or now - self.gauges.published_at >= 1.0:
            self.gauges.publish()

    async def _tick_loop(self) -> None:
        watchdog = systemd.Watchdog()  # pinged from this loop: a wedged event loop gets restarted
        while not self._stopping.is_set():
            watchdog.tick()
            self.last_tick_at = self.clock()
            started = time.perf_counter()  # the tick's real duration, whatever the injected clock says
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
        view = self.committer.require_leader()
        assert self.committer.lease is not None
        status = view.status(self.replica_id, self.address, self.committer.lease.leader.since_unix_s,
                             self.calls.etcd_ok)
        status.stragglers.extend(f"{j.node_id}: {j.reason}"[:300] for j in self.stragglers.judged.values()
                                 if j.straggler)
        status.straggler_decision = self.stragglers.decision[:300]
        status.rollback_decision = (self.rollbacks.decision or self.fingerprints.decision)[:300]
        return status

    def _on_progress(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        self.stragglers.observe(node_id, progress)
        self.anomalies.observe(node_id, progress)
        self.fingerprints.observe(node_id, progress)
        self.goodput.observe(node_id, progress)

    def goodput_report(self, request: coordinator_pb2.GetGoodputRequest) -> coordinator_pb2.GoodputReport:
        """``GetGoodput``: the job's ledger (the current job when none is named) over the window asked."""
        view = self.committer.require_leader()
        if not math.isfinite(request.since_s) or request.since_s < 0:
            raise errors.InvalidArgument("since_s", f"must be a finite number of seconds >= 0, got {request.since_s}")
        job = request.job
        if not job:
            current = view.current_job()
            if current is None:
                raise errors.JobNotFound("(current)")
            job = current.job
        validation.check_id("job", job)
        return goodput_proto(self.goodput, job, request.since_s)

    def _round_started(self, restore_step: int) -> None:
        self.membership.round_started(restore_step)
        self.stragglers.round_started()
        self.fingerprints.round_started()

    def nodes(self, request: coordinator_pb2.ListNodesRequest | None = None) -> coordinator_pb2.ListNodesResponse:
        """A page of nodes (the first, of the default size, without a request), with what the straggler
        watch says of each."""
        request = request or coordinator_pb2.ListNodesRequest()
        page = self.committer.require_leader().node_page(self.clock(), request.page_size, request.page_token)
        for info in page.nodes:
            judged = self.stragglers.judged.get(info.node_id)
            if judged is not None:
                info.straggler_score, info.straggler_reason = judged.score, judged.reason[:300]
            slow = self.stragglers.slow.get(info.node_id)
            if slow is not None:
                info.slow = slow[1]
        return page

    async def event_page(self, request: coordinator_pb2.ListEventsRequest) -> coordinator_pb2.ListEventsResponse:
        view = self.committer.require_leader()
        return await self.event_log.page(request, view.last_event_seq)

    # ---- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        set_identity(replica=self.replica_id, role="standby")
        self.metrics.is_leader.set(0)
        self.metrics.recovery_open.set(0)
        self._keeper_on = True
        await asyncio.gather(self._leadership_loop(), self._tick_loop(), self._follow_loop())

    async def stop(self) -> None:
        """Graceful stop: resign so a standby takes over at once instead of after the lease TTL."""
        self._stopping.set()
        self.keeper.stop()
        lease = self.committer.lease
        self.committer.lease, self.committer.view = None, None
        self.membership.close_streams(errors.NotLeader(self.replica_id, "", "is shutting down"))
        self.mirror_feed.close()
        if lease is not None:
            try:
                await self.calls.lease("resign", self.store.resign, lease)
                log.info("resigned leadership")
            except StoreUnavailable:
                log.warning("could not resign; the lease will expire within %ss", self.settings.leader_ttl_s)
        self.calls.shutdown()
