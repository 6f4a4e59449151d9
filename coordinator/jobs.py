"""The coordinator's side of the training job's rendezvous and hang handling: RPC translation plus
guarded commits of :class:`~.rendezvous.JobState` (rules in :mod:`.rendezvous`).

It needs the leader's state (:class:`~.leader_state.LeaderState`) and three signals, passed in as
callables so that it depends on neither the control loop nor the membership: a round started (for the
recovery timing), push assignments to every agent, run the reconciliation tick now."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ftd.checkpoints.layout import BadIdentifier, check_job
from ftd.v1 import coordinator_pb2

from . import errors, rate_limits, validation
from . import rendezvous as rules
from .detector import State
from .leader_state import LeaderState

log = logging.getLogger("ftd.coordinator.jobs")
_STATUS = {rules.READY: coordinator_pb2.RoundInfo.READY, rules.WAIT: coordinator_pb2.RoundInfo.WAIT,
           rules.CLOSED: coordinator_pb2.RoundInfo.CLOSED}


def _job(job: str) -> str:
    try:
        return check_job(job)
    except BadIdentifier as exc:
        raise errors.InvalidArgument.naming(exc) from exc


def _node(node_id: str) -> str:
    return validation.check_id("node_id", node_id)


def round_info(state: rules.JobState, reply: rules.Reply | None = None) -> coordinator_pb2.RoundInfo:
    status = reply.status if reply else (rules.CLOSED if state.closed else rules.READY)
    return coordinator_pb2.RoundInfo(
        status=_STATUS[status], job=state.job, round=state.round, epoch=max(state.epoch, 0),
        rank=reply.rank if reply else -1, world_size=reply.world_size if reply else len(state.members),
        store_address=state.store_address, message=reply.message if reply else state.closed_reason,
        restarts=state.restarts, max_restarts=state.max_restarts, spare=reply.spare if reply else False)


def _existing(state: rules.JobState | None, job: str) -> rules.JobState:
    if state is None:
        raise errors.JobNotFound(job)
    return state


@dataclass(frozen=True)
class JobPolicy:
    """A job's parameters, from the coordinator's settings (the operator's): a join's own values are
    not used, so the first node to join (a compromised one) cannot fix ``min_nodes = 2^32 - 1`` or a
    budget of 0 for everybody."""

    min_nodes: int = 1
    max_restarts: int = 10
    on_no_spare: str = rules.SHRINK


class JobKeeper:
    def __init__(self, state: LeaderState, *, round_started: Callable[[int], None], push_all: Callable[[], None],
                 wake: Callable[[], None], wall: Callable[[], float] = time.time,
                 limiter: rate_limits.WriteLimiter | None = None, policy: JobPolicy | None = None) -> None:
        self.state = state
        self.policy = policy or JobPolicy()
        self.limiter = limiter or rate_limits.WriteLimiter()
        self.round_started = round_started  # called with the step the new round restores from (-1: none)
        self.on_round: Callable[[rules.JobState, rules.JobState, int], None] = lambda before, after, step: None
        self.push_all = push_all
        self.wake = wake
        self.wall = wall
        self._lock = asyncio.Lock()

    def _room_for(self, job: str) -> list[str]:
        """Before a new job's first record: the closed jobs to remove (oldest first) so that at most
        :data:`~.validation.MAX_JOBS` records are kept; :class:`~.errors.TooMany` when every one is open."""
        jobs = self.state.require_leader().jobs
        if job in jobs or len(jobs) < validation.MAX_JOBS:
            return []
        closed = sorted((j for j in jobs.values() if j.closed), key=lambda j: (j.round_unix_s, j.job))
        excess = len(jobs) + 1 - validation.MAX_JOBS
        if len(closed) < excess:
            raise errors.TooMany(f"{len(jobs)} jobs are open (at most {validation.MAX_JOBS}); close one "
                                 f"(ftctl) before job {job} can rendezvous")
        return [j.job for j in closed[:excess]]

    async def _save(self, before: rules.JobState | None, after: rules.JobState, event: str,
                    evict: Sequence[str] = ()) -> None:
        if before == after:
            return
        await self.state.commit("job", events=[("job", "", event)], kv_puts={rules.key(after.job): rules.encode(after)},
                                kv_deletes=[rules.key(j) for j in evict])
        self.applied(before, after, evict)

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a job record changes (a rollback commits one with the catalog's marks)."""
        return self._lock

    def applied(self, before: rules.JobState | None, after: rules.JobState, evict: Sequence[str] = ()) -> None:
        """The view and the agents once ``after`` is committed (by :meth:`_save` or with other records)."""
        view = self.state.require_leader()
        for job in evict:
            view.jobs.pop(job, None)
        view.jobs[after.job] = after
        if before is None or after.round != before.round:
            # The first round too: its warm-up (imports, compilation, caches) is the job's longest,
            # and the straggler watch must not take it as evidence.
            restore_step = view.newest_restorable(after.job)
            self.round_started(restore_step)
            if before is not None:
                self.on_round(before, after, restore_step)
        if before is None or before.round != after.round or before.closed != after.closed:
            log.warning("job %s: round %d (%s)%s", after.job, after.round, after.round_reason,
                        f"; CLOSED: {after.closed_reason}" if after.closed else "")
            self.push_all()

    async def join(self, req: coordinator_pb2.JoinRoundRequest) -> coordinator_pb2.RoundInfo:
        job, node = _job(req.job), _node(req.node_id)
        validation.validate_join_round(req)
        self.limiter.check("JoinRound", node)
        async with self._lock:
            view = self.state.require_leader()
            if node not in view.nodes:
                raise errors.NodeNotFound(node)
            before = view.jobs.get(job)
            if before is None and node in view.world.ranks and \
                    rules.created_by(view.jobs.values(), node) >= rules.MAX_JOBS_PER_NODE:
                raise errors.TooMany(f"node {node} created {rules.MAX_JOBS_PER_NODE} open jobs already; job {job} is "
                                     "refused until an operator closes one (ftctl)")
            evict = self._room_for(job) if node in view.world.ranks else []
            suspects = {n for n, v in view.verdicts.items() if v.state is not State.ALIVE}
            try:
                rules.check_on_no_spare(req.on_no_spare)  # a bad value is still an error of the caller's
            except ValueError as exc:
                raise errors.InvalidArgument("on_no_spare", str(exc)) from exc
            policy = self.policy
            state, reply = rules.join(self.wall(), before, job, view.world.epoch, view.world.ranks, node,
                                      req.last_round, policy.min_nodes, policy.max_restarts, suspects,
                                      planned=view.world.handed_over, on_no_spare=policy.on_no_spare,
                                      target_size=view.world.target_size)
            if before is None and node not in view.world.ranks:
                return round_info(state, reply)  # a spare's join creates no job record
            await self._save(before, state, f"{node} joins {job}: {reply.status}: {reply.message}", evict)
            return round_info(state, reply)

    def get(self, job: str) -> coordinator_pb2.RoundInfo:
        job = _job(job)
        return round_info(_existing(self.state.require_leader().jobs.get(job), job))

    async def set_store(self, req: coordinator_pb2.SetRoundStoreRequest) -> coordinator_pb2.RoundInfo:
        job, node = _job(req.job), _node(req.node_id)
        validation.validate_set_round_store(req)
        async with self._lock:
            before = _existing(self.state.require_leader().jobs.get(job), job)
            after, error = rules.set_store(before, req.round, node, req.address)
            if error:
                raise errors.RoundConflict(job, error)
            await self._save(before, after, f"{job} round {req.round}: store at {req.address}")
            return round_info(after)

    async def close(self, req: coordinator_pb2.CloseJobRequest) -> coordinator_pb2.RoundInfo:
        job = _job(req.job)
        reason = validation.check_text("reason", req.reason)
        async with self._lock:
            before = _existing(self.state.require_leader().jobs.get(job), job)
            after = rules.close(before, reason or "closed")
            await self._save(before, after, f"{job} closed: {after.closed_reason}")
            return round_info(after)

    async def report_hang(self, req: coordinator_pb2.ReportHangRequest) -> coordinator_pb2.ReportHangResponse:
        job, node = _job(req.job), _node(req.node_id)
        why = validation.clip(validation.check_text("reason", req.reason), 300) or "no training progress"
        self.limiter.check("ReportHang", node)
        async with self._lock:
            view = self.state.require_leader()
            if node not in view.nodes:
                raise errors.NodeNotFound(node)
            if req.culprit:
                view.forced_dead[node] = f"hung: {why}"
                log.warning("node %s reported hung (%s): it will be fenced and replaced", node, why)
                self.wake()
                return coordinator_pb2.ReportHangResponse(action="fenced")
            state = view.jobs.get(job)
            if state is None or state.closed:
                return coordinator_pb2.ReportHangResponse(action="noted")
            stalls = view.stalls.setdefault((job, state.round), set())
            stalls.add(node)
            if set(state.members) <= stalls:
                after = rules.stall_restart(self.wall(), state, f"job stalled: no node made progress ({why})")
                await self._save(state, after, f"{job}: every node stalled; round {after.round}")
                return coordinator_pb2.ReportHangResponse(action="job restarted")
            return coordinator_pb2.ReportHangResponse(action="noted")
