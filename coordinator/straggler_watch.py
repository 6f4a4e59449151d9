"""The leader's straggler bookkeeping around the pure rules of :mod:`.stragglers`.

Heartbeats feed each node's step timing into the window; every ``JUDGE_EVERY_S`` the world is judged,
``ftd_coordinator_straggler_score{node}`` is set, an event is committed when a node becomes (or stops
being) a straggler, and with ``straggler_action=replace`` the worst straggler is handed over to a
spare through the drain path (every rank stops at one agreed step and saves it, so nothing is lost).
A replaced node is marked ``slow``: it rejoins as a spare but is not promoted until a health verdict
measured after the replacement passes.

All of this is soft state of the leader: a new leader starts with an empty window (it judges again
after ``min_evidence_s``) and forgets the slow marks (the node's next verdict decides).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors
from .leader_state import LeaderState
from .metrics import CoordinatorMetrics
from .stragglers import Judgement, StepSample, StepWindow, StragglerConfig, judge_stragglers, replacement_due

log = logging.getLogger("ftd.coordinator.stragglers")
JUDGE_EVERY_S = 2.0

Drain = Callable[[coordinator_pb2.DrainRequest], Awaitable[coordinator_pb2.DrainResponse]]


class StragglerWatch:
    def __init__(self, state: LeaderState, config: StragglerConfig, metrics: CoordinatorMetrics, drain: Drain,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.config = config
        self.metrics = metrics
        self.drain = drain
        self.clock = clock
        self.wall = wall
        self.window = StepWindow()
        self.judged: dict[str, Judgement] = {}
        self.slow: dict[str, tuple[float, str]] = {}  # node -> (unix time it was replaced, why)
        self.last_replaced_at: float | None = None
        self.decision = ""  # the latest replacement decision, for the status
        self._judged_at = float("-inf")
        self._shown: set[str] = set()

    def new_term(self) -> None:
        self.window = StepWindow()
        self.judged.clear()
        self._judged_at = float("-inf")

    def observe(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        """One heartbeat's progress: a new step with its timing joins the node's window."""
        if not progress.HasField("timing") or progress.step < 0:
            return
        t = progress.timing
        self.window.add(node_id, StepSample(self.clock(), progress.step, t.compute_s, t.wall_s, t.data_s, t.save),
                        self.config)

    def round_started(self) -> None:
        self.window.round_started(self.clock())

    def unfit(self, view_verdicts: dict[str, cluster_pb2.HealthVerdict | None]) -> dict[str, str]:
        """Spares marked slow that have not passed a health check since: not promoted. A verdict
        measured after the replacement that is healthy clears the mark."""
        out: dict[str, str] = {}
        for node_id, (at, why) in list(self.slow.items()):
            verdict = view_verdicts.get(node_id)
            if verdict is not None and verdict.healthy and verdict.checked_unix_s > at:
                log.warning("node %s passed its health checks again; no longer marked slow", node_id)
                del self.slow[node_id]
                continue
            out[node_id] = f"slow ({why}): waits for a passing health check"
        return out

    async def tick(self, spares: Callable[[], int]) -> None:
        """Judges the world when due; ``spares`` counts the healthy spares that could take a rank now
        (asked only when there is a straggler: it looks at every node)."""
        now = self.clock()
        if now - self._judged_at < JUDGE_EVERY_S:
            return
        self._judged_at = now
        view = self.state.require_leader()
        job = view.current_job()
        world = list(view.world.ranks)
        if job is None or job.closed or len(world) < 2:
            self._publish([])
            return
        self.window.forget(world)
        judged, self.window.flags = judge_stragglers(self.window, self.config, now, world)
        before = {n for n, j in self.judged.items() if j.straggler}
        self.judged = {j.node_id: j for j in judged}
        self._publish(judged)
        events = [("straggler_detected", j.node_id, f"{j.node_id}: {j.reason}") for j in judged
                  if j.straggler and j.node_id not in before]
        events += [("straggler_cleared", n, f"{n}: {self.judged[n].reason}") for n in before
                   if n in self.judged and not self.judged[n].straggler]
        for kind, _node, text in events:
            (log.warning if kind == "straggler_detected" else log.info)("%s", text)
        if events:
            with contextlib.suppress(errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
                await self.state.commit("straggler", events=events)
        count = spares() if any(j.straggler for j in judged) else 0
        due, why = replacement_due(now, judged, self.config, count, self.last_replaced_at, bool(view.drains))
        self.decision = why if due is None else f"replacing {due.node_id}: {due.why}"
        if due is None:
            return
        try:
            answer = await self.drain(coordinator_pb2.DrainRequest(node_id=due.node_id, reason=due.why[:300]))
        except errors.CoordinatorError as exc:
            log.error("straggler %s not handed over: %s", due.node_id, exc)
            return
        self.last_replaced_at = now
        self.slow[due.node_id] = (self.wall(), due.why[:200])
        self.metrics.straggler_replacements.inc()
        log.warning("straggler %s handed over to a spare: %s (%s)", due.node_id, due.why, answer.message)

    def _publish(self, judged: list[Judgement]) -> None:
        shown = {j.node_id for j in judged}
        for node_id in self._shown - shown:
            with contextlib.suppress(KeyError):
                self.metrics.straggler_score.remove(node_id)
        for j in judged:
            self.metrics.straggler_score.labels(j.node_id).set(j.score)
        self._shown = shown
        self.metrics.stragglers.set(sum(1 for j in judged if j.straggler))
