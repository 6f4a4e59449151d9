"""The leader's answer to step anomalies with ``anomaly_action = "rollback"`` (rules in
:mod:`.rollback_rules`): the job's checkpoints from the first bad step on marked suspect and a new
round of the same members, committed in **one** etcd transaction with the event.

The marks and the round land under the catalog's lock: a shard of the old round is either committed
before them (and marked with the rest) or refused after them (its round is over), so no checkpoint
of the poisoned timeline is ever offered; the new round's ranks ask for their restore target only
after the agents abort the old workers, when the marks are in. A failed commit (etcd unreachable)
leaves the anomalies pending: the next tick tries again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from prometheus_client import Counter

from ftd.checkpoints import catalog as catalog_rules
from ftd.v1 import cluster_pb2

from . import errors
from . import rendezvous as job_rules
from . import rollback_rules as rules
from .catalog import CatalogKeeper
from .jobs import JobKeeper
from .leader_state import LeaderState

log = logging.getLogger("ftd.coordinator.rollbacks")
MAX_PENDING = 256


class RollbackKeeper:
    def __init__(self, state: LeaderState, config: rules.RollbackConfig, jobs: JobKeeper, catalog: CatalogKeeper,
                 counter: Counter, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.state, self.config, self.jobs, self.catalog = state, config, jobs, catalog
        self.counter = counter  # ftd_coordinator_rollbacks_total{outcome}
        self.clock, self.wall = clock, wall
        self.pending: dict[str, list[rules.Seen]] = {}  # job -> anomalies gathered for it
        self.fence_holds: dict[str, tuple[int, int]] = {}  # job -> (first suspect step, the world epoch fenced in)
        self.wake: Callable[[], None] = lambda: None  # the reconciliation tick, now (a fence to act on)
        self.decision = ""  # the newest decision and why (ftctl status)

    def observe(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        """A new anomaly in ``progress`` (the anomaly log passes each once); kept for the job whose
        round has the node."""
        anomaly = progress.anomaly
        view = self.state.view
        if self.config.action != rules.ROLLBACK or view is None:
            return
        job = rules.job_of(node_id, view.jobs.values())
        if job is None:
            return
        seen = rules.Seen(node_id, anomaly.step, anomaly.rank, anomaly.kind,
                          anomaly.round if anomaly.HasField("round") else None, anomaly.reason, self.clock(),
                          progress.restored.step if progress.HasField("restored") else None)
        got = self.pending.setdefault(job.job, [])
        if len(got) < MAX_PENDING:
            got.append(seen)

    def held(self, job: str, epoch: int, round_: int | None) -> int | None:
        """The first step of ``job`` whose checkpoints are not recorded now (a shard saved in ``epoch``
        and round ``round_``): the earliest anomaly gathered for a rollback, in that round or one not
        known; or, after a corruption's fence, the first suspect step until the world changed."""
        steps = [s.step for s in self.pending.get(job, ()) if s.round is None or round_ is None or s.round == round_]
        fence = self.fence_holds.get(job)
        if fence is not None and fence[1] == epoch:
            steps.append(fence[0])
        return min(steps, default=None)

    async def act_on_corruption(self, job_name: str, seen: rules.Seen, nodes: tuple[str, ...]) -> str:
        """A confirmed silent data corruption (coordinator/fingerprints.py): with a majority, the
        suspects' nodes are fenced (the spares take their ranks, the new world restores a checkpoint
        before ``seen.step``, the later ones marked suspect in the same transaction); without one,
        a plain rollback. Returns "acted", "declined" (the policy, the budget, no checkpoint) or
        "retry" (etcd unreachable)."""
        if not nodes:  # nobody to blame: a plain rollback (a new round of the same members)
            self.pending.setdefault(job_name, []).append(seen)
            return await self._answer(job_name)
        async with self.catalog.lock, self.jobs.lock:
            view = self.state.require_leader()
            job = view.jobs.get(job_name)
            if job is None:
                return "declined"
            records = self.catalog.merged(job_name)  # memory-only steps too (see _answer)
            plan, why = rules.rollback_due([seen], job, records, self.config, self.catalog.unreachable(job_name))
            if plan is None:
                self.decision = f"{job_name}: corruption on {', '.join(nodes)} not acted on: {why}"
                log.warning("job %s", self.decision)
                return "declined"
            try:
                if plan.close:
                    await self._commit(plan, job, records)
                    self.decision = f"{job_name}: {plan.reason}"
                    return "acted"
                after = replace(job, rollbacks=job.rollbacks + 1, last_rollback=seen.key,
                                suspect_from=plan.first_bad, suspect_unix_s=self.wall())
                marked = self._suspects(plan, records)
                puts = {job_rules.key(after.job): job_rules.encode(after)}
                for record in marked:
                    puts.update(catalog_rules.encode(record, []))
                text = f"{job_name}: fenced {', '.join(nodes)}: {plan.reason}"[:400]
                await self.state.commit("rollback", events=[("replica_fenced", n, text) for n in nodes], kv_puts=puts)
            except (errors.StateUnavailable, errors.StateRejected) as exc:
                self.decision = f"{job_name}: corruption fence pending: {exc}"
                return "retry"
            self.catalog.applied(marked)
            self.jobs.applied(job, after)
            for node_id in nodes:
                view.forced_dead[node_id] = seen.reason[:300]  # "silent data corruption: ..."
            self.fence_holds[job_name] = (plan.first_bad, view.world.epoch)
            self.decision = text
            self.counter.labels("rolled_back").inc()
            log.warning("job %s", text)
            self.wake()
            return "acted"

    def _suspects(self, plan: rules.RollbackPlan,
                  records: list[catalog_rules.CheckpointRecord]) -> list[catalog_rules.CheckpointRecord]:
        """The durable records of the plan's suspect steps, marked (etcd keeps the mark); memory-only
        steps have no record to mark: JobState.suspect_from leaves their snapshots out."""
        why = rules.suspect_reason(plan)
        durable = self.state.require_leader().catalog
        return [replace(durable[(r.job, r.step)], invalid_reason=why) for r in records
                if r.step in set(plan.suspects) and (r.job, r.step) in durable]

    def new_term(self) -> None:
        self.pending.clear()  # a new leader starts from the reports (the job record says what was answered)
        self.fence_holds.clear()

    async def tick(self) -> None:
        view = self.state.view
        for job_name, (_, epoch) in list(self.fence_holds.items()):
            if view is None or view.world.epoch > epoch:
                del self.fence_holds[job_name]  # the new world's commits carry the new epoch
        for job_name in list(self.pending):
            if rules.due(self.pending[job_name], self.clock(), self.config):
                await self._answer(job_name)

    async def _answer(self, job_name: str) -> str:
        """"acted", "declined" or "retry" (the anomalies stay pending)."""
        async with self.catalog.lock, self.jobs.lock:
            view = self.state.require_leader()
            job = view.jobs.get(job_name)
            pending = self.pending.get(job_name, [])
            if job is None:
                self.pending.pop(job_name, None)
                return "declined"
            # The plan sees memory-only steps too (a job may checkpoint to memory only between persists);
            # only the durable records are marked suspect in etcd, the memory ones by JobState.suspect_from.
            records = self.catalog.merged(job_name)
            plan, why = rules.rollback_due(pending, job, records, self.config, self.catalog.unreachable(job_name))
            if plan is None:
                self.pending.pop(job_name, None)
                self.decision = f"{job_name}: {why}"
                log.info("job %s: no rollback: %s", job_name, why)
                return "declined"
            try:
                await self._commit(plan, job, records)
            except errors.NotLeader:
                self.pending.clear()
                return "declined"
            except (errors.StateUnavailable, errors.StateRejected) as exc:
                self.decision = f"{job_name}: rollback pending: {exc}"
                log.warning("job %s: rollback not committed (%s); retried on the next tick", job_name, exc)
                return "retry"
            self.pending.pop(job_name, None)
            self.decision = f"{job_name}: {plan.reason}"
            return "acted"

    async def _commit(self, plan: rules.RollbackPlan, job: job_rules.JobState,
                      records: list[catalog_rules.CheckpointRecord]) -> None:
        if plan.close:
            after = job_rules.close(job, plan.reason)
            marked: list[catalog_rules.CheckpointRecord] = []
        else:
            skip = plan.first_bad if self.config.skip_batches else -1
            after = job_rules.rolled_back(self.wall(), job, plan.anomaly.key, plan.reason, skip, plan.first_bad)
            marked = self._suspects(plan, records)
        puts = {job_rules.key(after.job): job_rules.encode(after)}
        for record in marked:
            puts.update(catalog_rules.encode(record, []))
        kind = "rollback_budget_spent" if plan.close else "rollback"
        await self.state.commit("rollback", events=[(kind, plan.anomaly.node_id, f"{plan.job}: {plan.reason}"[:400])],
                                kv_puts=puts)
        self.catalog.applied(marked)
        self.jobs.applied(job, after)
        self.counter.labels("closed" if plan.close else "rolled_back").inc()
        log.warning("job %s: %s", plan.job, plan.reason)


__all__ = ["RollbackKeeper"]
