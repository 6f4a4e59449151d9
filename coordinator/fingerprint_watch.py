"""The leader's replica-fingerprint watch (rules in :mod:`.fingerprints`): it gathers the
fingerprints the heartbeats carry per job round and step, compares each step once every rank
reported it, and hands a confirmed silent data corruption to the rollback keeper (fence the suspects'
nodes, roll the job back to before the disagreement) when ``anomaly_action = "rollback"``; with
``alert`` it records the event and counts it only.

Soft state, like the straggler window: a new leader starts comparing from the next reports (a
corruption is then confirmed one recheck later, never acted on twice: the job record keeps the key
of what was answered).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from ftd.v1 import cluster_pb2

from . import errors
from . import fingerprints as rules
from .leader_state import LeaderState
from .rollback_rules import FINGERPRINT, Seen, job_of
from .rollbacks import RollbackKeeper

log = logging.getLogger("ftd.coordinator.fingerprints")
KEEP_STEPS = 16  # incomplete steps kept per job (a rank that stopped reporting leaves one behind)
KEEP_HISTORY = 32


class FingerprintWatch:
    def __init__(self, state: LeaderState, rollbacks: RollbackKeeper, counter: Counter, confirmations: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.state, self.rollbacks, self.counter = state, rollbacks, counter  # counter: {outcome}
        self.confirmations, self.clock = confirmations, clock
        self.steps: dict[tuple[str, int], dict[int, dict[int, tuple[str, int]]]] = {}  # (job, round) -> step -> rank
        self.history: dict[tuple[str, int], list[rules.Comparison]] = {}
        self.found: dict[tuple[str, int], tuple[rules.Finding, tuple[str, ...]]] = {}  # to act on
        self.acted: set[tuple[str, int]] = set()
        self.decision = ""
        self._events: list[tuple[str, str, str]] = []

    def observe(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        view = self.state.view
        if view is None or not progress.fingerprints:
            return
        job = job_of(node_id, view.jobs.values())
        if job is None:
            return
        for mark in progress.fingerprints:
            round_ = mark.round if mark.HasField("round") else job.round
            if round_ != job.round:
                continue  # another round's replicas (an old world still reporting)
            key = (job.job, round_)
            done = self.history.get(key, [])
            if done and mark.step <= done[-1].step:
                continue
            by_step = self.steps.setdefault(key, {})
            ranks = by_step.setdefault(mark.step, {})
            ranks[mark.rank] = (node_id, int(mark.value))
            verdict = rules.compare({r: v for r, (_, v) in ranks.items()}, mark.world_size, mark.step)
            if verdict is None:
                while len(by_step) > KEEP_STEPS:
                    by_step.pop(min(by_step))
                continue
            nodes = {r: n for r, (n, _) in ranks.items()}
            for step in [s for s in by_step if s <= mark.step]:
                by_step.pop(step)
            self._judged(key, verdict, nodes)

    def _judged(self, key: tuple[str, int], verdict: rules.Comparison, nodes: dict[int, str]) -> None:
        history = self.history.setdefault(key, [])
        history.append(verdict)
        del history[:-KEEP_HISTORY]
        if not verdict.agreed:
            self.counter.labels("mismatch").inc()
            if len(history) < 2 or history[-2].agreed:
                self._events.append(("fingerprint_mismatch", nodes.get(next(iter(verdict.dissent), -1), ""),
                                     f"{key[0]} round {key[1]}: {verdict.reason}"))
                log.warning("job %s: %s", key[0], verdict.reason)
        finding, why = rules.confirmed(history, self.confirmations)
        self.decision = f"{key[0]}: {why}" if finding is None else f"{key[0]}: {finding.reason}"
        if finding is not None and key not in self.acted:
            self.found[key] = (finding, tuple(sorted({nodes[r] for r in finding.ranks if r in nodes})))

    def round_started(self) -> None:
        """A new world: its replicas start comparing afresh (the keys carry the round anyway)."""
        live = {(j.job, j.round) for j in (self.state.view.jobs.values() if self.state.view else ())}
        for table in (self.steps, self.history, self.found):
            for key in [k for k in table if k not in live]:
                table.pop(key)

    def new_term(self) -> None:
        self.steps.clear()
        self.history.clear()
        self.found.clear()

    async def tick(self) -> None:
        if self._events:
            events, self._events = self._events, []
            with contextlib.suppress(errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
                await self.state.commit("fingerprint", events=events)
        for key, (finding, nodes) in list(self.found.items()):
            seen = Seen(nodes[0] if nodes else "", finding.first_bad, finding.ranks[0] if finding.ranks else -1,
                        FINGERPRINT, key[1], finding.reason, self.clock())
            outcome = await self.rollbacks.act_on_corruption(key[0], seen, nodes)
            if outcome == "retry":
                continue  # etcd unreachable: the next tick tries again
            if outcome == "acted":
                self.acted.add(key)
                self.counter.labels("fenced" if nodes else "rolled_back").inc()
            self.found.pop(key, None)


__all__ = ["FingerprintWatch"]
