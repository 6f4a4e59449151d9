"""What the coordinator publishes about itself on every replica's ``/metrics``, kept out of the
control loop: the leader's view as gauges (nodes by state, the world, spares, the open recovery, job
rounds, the catalog), and etcd's alarms, which every replica polls so that a full database is visible
even while no leader can commit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from .catalog import CatalogKeeper
from .committer import Committer
from .guard_metrics import ALARMS, GuardMetrics
from .membership import Membership
from .metrics import CoordinatorMetrics
from .store import StateStore, StoreRejected, StoreUnavailable
from .store_calls import StoreCalls
from .view import ALARM_HINTS

log = logging.getLogger("ftd.coordinator")


class Gauges:
    def __init__(self, committer: Committer, membership: Membership, catalog: CatalogKeeper,
                 metrics: CoordinatorMetrics, security: GuardMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.committer, self.membership, self.catalog = committer, membership, catalog
        self.metrics, self.security, self.clock = metrics, security, clock
        self.published_at = -1e9
        self._job_series: set[str] = set()  # jobs whose ftd_coordinator_job_* series are published

    def publish(self) -> None:
        view = self.committer.view
        if view is None:
            return
        self.published_at = self.clock()
        self.membership.changed = False
        for state, count in view.counts().items():
            self.metrics.nodes.labels(state).set(count)
        self.metrics.epoch.set(view.world.epoch)
        self.metrics.world_size.set(len(view.world.ranks))
        self.metrics.world_target_size.set(view.world.target_size)
        self.metrics.spares.set(len(view.spares()))
        incident, job = self.membership.recovery.open, view.current_job()
        open_s = self.clock() - incident.last_heartbeat if incident and job is not None and not job.closed else 0.0
        self.metrics.recovery_open.set(open_s)
        # At most validation.MAX_JOBS jobs (JobKeeper removes closed ones, refuses more); a removed job's
        # series go with it, so job ids from requests cannot grow the series without bound.
        for gone in self._job_series - set(view.jobs):
            for gauge in (self.metrics.job_round, self.metrics.job_restarts):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
        self._job_series = set(view.jobs)
        for job in view.jobs.values():
            self.metrics.job_round.labels(job.job).set(job.round)
            self.metrics.job_restarts.labels(job.job).set(job.restarts)
        self.catalog.publish_gauges()


class AlarmWatch:
    """etcd's raised alarms, as last polled."""

    def __init__(self, store: StateStore, calls: StoreCalls, committer: Committer, security: GuardMetrics) -> None:
        self.store, self.calls, self.committer, self.security = store, calls, committer, security
        self.raised: list[str] = []

    async def poll(self) -> None:
        """Reads etcd's alarms into ``ftd_coordinator_etcd_alarm`` and the status. While NOSPACE is
        raised every commit is refused (with a message saying how to free space); the tick keeps
        planning, so fencing and promotion resume by themselves once the alarm is disarmed."""
        try:
            alarms = await self.calls.data("alarms", self.store.alarms)
        except (StoreUnavailable, StoreRejected):
            return
        if alarms != self.raised:
            if alarms:
                log.error("etcd raised alarm(s) %s: %s", ", ".join(alarms),
                          "; ".join(ALARM_HINTS.get(a, "see etcdctl alarm list") for a in alarms))
            else:
                log.warning("etcd alarm(s) %s cleared: commits resume", ", ".join(self.raised))
        self.raised = alarms
        for alarm in ALARMS:
            self.security.etcd_alarm.labels(alarm).set(1 if alarm in alarms else 0)
        view = self.committer.view
        if view is not None:
            view.etcd_alarms = list(alarms)
