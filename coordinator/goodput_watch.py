"""The leader's goodput ledgers (:mod:`.goodput`), one per job: fed by the heartbeats' progress, the
deaths and hand-overs the membership commits and the rounds the job keeper starts; persisted in etcd
(``goodput/<job>``) when an incident opens or closes and every :data:`SAVE_EVERY_S` otherwise, so that
a new leader continues it; exported as ``ftd_job_goodput_ratio{job,window}`` and
``ftd_job_lost_seconds_total{job,cause}``; read by ``GetGoodput`` (``ftctl goodput``).

A leader failover costs the ledger at most the step reports of the last :data:`SAVE_EVERY_S`, which
change only the step-time samples: the steps kept are read again from the next report."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors
from . import goodput as gp
from .leader_state import LeaderState
from .rendezvous import JobState

log = logging.getLogger("ftd.coordinator.goodput")
SAVE_EVERY_S = 15.0
HOUR_S = 3600.0


def round_cause(before: JobState, after: JobState) -> str:
    """What started a round, for an incident no committed failure opened (rendezvous.py's reasons)."""
    why = after.round_reason
    if after.rollbacks > before.rollbacks:
        return "rolled_back"
    if "planned hand-over" in why:
        return "handed_over"
    if "left the world" in why:
        return "node_lost"
    if "the world changed" in why:
        return "rescaled"
    if "stalled" in why:
        return "stalled"
    return "worker_failed"


class GoodputWatch:
    def __init__(self, state: LeaderState, wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.wall = wall
        self.ledgers: dict[str, gp.Ledger] = {}
        self._urgent: set[str] = set()
        self._saved_at: dict[str, float] = {}
        self._counted: dict[tuple[str, str], float] = {}  # what the counter showed: never lower

    def new_term(self) -> None:
        """A new leader: the ledgers its predecessor persisted (a corrupt one starts afresh, logged)."""
        self.ledgers.clear()
        self._urgent.clear()
        view = self.state.view
        for job, raw in (view.goodput if view is not None else {}).items():
            try:
                self.ledgers[job] = gp.decode(raw)
            except (ValueError, TypeError, KeyError) as exc:
                log.error("goodput ledger of job %s is corrupt, starting a new one: %s", job, exc)
        now = self.wall()
        self._saved_at = dict.fromkeys(self.ledgers, now)

    def _job(self, node_id: str | None = None) -> JobState | None:
        view = self.state.view
        job = view.current_job() if view is not None else None
        if job is None or job.closed or (node_id is not None and node_id not in job.members):
            return None
        return job

    def _ledger(self, job: str) -> gp.Ledger:
        ledger = self.ledgers.get(job)
        if ledger is None:
            ledger = self.ledgers[job] = gp.Ledger(job)
            self._urgent.add(job)
        return ledger

    def observe(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        """One heartbeat's progress from a node of the job's round."""
        job = self._job(node_id)
        if job is None or progress.step < 0:
            return
        ledger, now = self._ledger(job.job), self.wall()
        if progress.HasField("restored") and ledger.open is not None and ledger.open.restored is None:
            ledger.apply(gp.Record(now, gp.RESTORED, progress.restored.step, progress.restored.at_unix_s))
        closed = ledger.apply(gp.Record(now, gp.STEP, progress.step, progress.reported_unix_s))
        if closed is not None:
            costs = closed.as_dict(now, ledger.step_time)
            log.info("job %s: incident closed (%s %s): detection %.2fs, recovery %.2fs, %d steps redone",
                     job.job, closed.kind, closed.node_id, costs["detection_s"], costs["recovery_s"],
                     closed.steps_redone)
            self._urgent.add(job.job)

    def failure(self, cause: str, node_id: str, since: float | None) -> None:
        """A failure committed: a node declared dead (``since`` its last heartbeat) or handed over."""
        job = self._job()
        if job is None:
            return
        self._ledger(job.job).apply(gp.Record(self.wall(), gp.FAILURE, cause=cause, node_id=node_id, since=since))
        self._urgent.add(job.job)

    def round_started(self, before: JobState, after: JobState, restore_step: int) -> None:
        if after.closed or before.round == after.round:
            return
        self._ledger(after.job).apply(gp.Record(self.wall(), gp.ROUND, restore_step, cause=round_cause(before, after)))
        self._urgent.add(after.job)

    async def tick(self) -> None:
        """Persists the ledgers due: at once after an incident changed, else every SAVE_EVERY_S."""
        now = self.wall()
        due = {j for j in self.ledgers if j in self._urgent or now - self._saved_at.get(j, 0.0) >= SAVE_EVERY_S}
        if not due:
            return
        puts = {gp.key(j): gp.encode(self.ledgers[j]) for j in sorted(due)}
        with contextlib.suppress(errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
            await self.state.commit("goodput", kv_puts=puts)
            self._urgent -= due
            self._saved_at.update(dict.fromkeys(due, now))

    def report(self, job: str, since: float | None = None) -> dict[str, Any]:
        ledger = self.ledgers.get(job)
        if ledger is None:
            raise errors.JobNotFound(job)
        return ledger.report(self.wall(), since)

    def samples(self) -> Iterator[tuple[str, dict[str, float], dict[str, float]]]:
        """(job, goodput by window, lost seconds by cause) of every ledger, for the metrics."""
        if self.state.view is None:
            return
        now = self.wall()
        for job, ledger in sorted(self.ledgers.items()):
            ratios = {}
            for window, since in (("all", None), ("1h", now - HOUR_S)):
                ratio = ledger.report(now, since)["goodput_ratio"]
                if ratio is not None:
                    ratios[window] = ratio
            lost = {}
            for cause, seconds in ledger.lost_total(now).items():
                shown = max(seconds, self._counted.get((job, cause), 0.0))
                self._counted[(job, cause)] = lost[cause] = shown
            yield job, ratios, lost


def goodput_proto(watch: GoodputWatch, job: str, since_s: float) -> coordinator_pb2.GoodputReport:
    """``GetGoodput``'s answer: the ledger's report over the last ``since_s`` (0: since the first step)."""
    now = watch.wall()
    report = watch.report(job, now - since_s if since_s > 0 else None)
    out = coordinator_pb2.GoodputReport(job=job, now_unix_s=now)
    if not report["started"]:
        return out
    out.since_unix_s, out.wall_s, out.step, out.steps_kept = (report["since_unix_s"], report["wall_s"], report["step"],
                                                              report["steps_kept"])
    out.step_time_s, out.productive_s = report["step_time_s"], report["productive_s"]
    out.failures, out.steps_redone = report["failures"], report["steps_redone"]
    if report["goodput_ratio"] is not None:
        out.goodput_ratio = report["goodput_ratio"]
    hour = watch.report(job, now - HOUR_S)["goodput_ratio"]
    if hour is not None:
        out.goodput_1h_ratio = hour
    out.lost_s.update(report["lost_s"])
    for i in report["incidents"]:
        out.incidents.add(kind=i["kind"], node_id=i["node_id"], started_unix_s=i["started_unix_s"],
                          declared_unix_s=i["declared_unix_s"], detection_s=i["detection_s"],
                          recovery_s=i["recovery_s"], steps_redone=i["steps_redone"], redone_s=i["redone_s"],
                          lost_s=i["lost_s"], open=i["open"], step_before=i["step_before"],
                          restored_step=i["restored_step"], also=i["also"])
    return out
