"""Step anomalies the agents found (agent/step_anomalies.py), as the leader records them: one event
``step_anomaly`` and one count of ``ftd_coordinator_step_anomalies_total{kind}`` per anomaly, however
many heartbeats carry it (an agent repeats its newest anomaly until a newer one).

Soft state: a new leader may record an anomaly a second time from the next heartbeat that carries
it (the event log says so twice; nothing acts on it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from prometheus_client import Counter

from ftd.v1 import cluster_pb2

from . import errors
from .leader_state import LeaderState

log = logging.getLogger("ftd.coordinator.anomalies")
MAX_PENDING = 64


class AnomalyLog:
    def __init__(self, state: LeaderState, counter: Counter,
                 on_new: Callable[[str, cluster_pb2.Progress], None] | None = None) -> None:
        self.state = state
        self.counter = counter
        self.on_new = on_new  # each new anomaly once (the rollback keeper)
        self._seen: dict[str, tuple[int, int, str, int]] = {}  # node -> (step, rank, kind, round) of its newest
        self._pending: list[tuple[str, str, str]] = []

    def observe(self, node_id: str, progress: cluster_pb2.Progress) -> None:
        if not progress.HasField("anomaly"):
            return
        a = progress.anomaly
        key = (a.step, a.rank, a.kind, a.round if a.HasField("round") else -1)
        if self._seen.get(node_id) == key:
            return
        self._seen[node_id] = key
        if self.on_new is not None:
            self.on_new(node_id, progress)
        self.counter.labels(a.kind if a.kind in ("nan", "loss_spike", "grad_norm_jump") else "other").inc()
        text = f"{node_id}: {a.reason or f'{a.kind} at step {a.step} (rank {a.rank})'}"[:400]
        log.warning("step anomaly on %s", text)
        if len(self._pending) < MAX_PENDING:
            self._pending.append(("step_anomaly", node_id, text))

    async def flush(self) -> None:
        """Commits the pending events (best effort: the counter and the log have them already)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        with contextlib.suppress(errors.StateUnavailable, errors.StateRejected, errors.NotLeader):
            await self.state.commit("anomaly", events=events)
