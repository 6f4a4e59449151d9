"""The agent's part of a planned hand-over (a spot preemption notice, ``ftctl drain``).

* A notice from :mod:`.preemption` becomes one ``Drain`` request to the coordinator, retried until it
  is accepted or the notice's deadline passes (it is idempotent: a second request answers "already
  pending").
* The coordinator's answer to every heartbeat names the nodes whose hand-over is pending; while one
  of them is in the job's world, every worker of this node is told so with its ``ReportProgress``
  answer, saves a final checkpoint at the step all ranks agree on, and waits for the new world.
* A node that received a final notice reports itself unhealthy, so it is never promoted while going.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ftd.rpc import describe
from ftd.v1 import cluster_pb2, coordinator_pb2

from .metrics import AgentMetrics
from .preemption_notices import Notice

log = logging.getLogger("ftd.agent.handover_relay")

# The smallest window the clouds give (GCE, Azure: about 30 s): without a deadline in the notice a
# drain request is retried this long.
DEFAULT_NOTICE_S = 30.0


@dataclass(frozen=True)
class Pending:
    nodes: tuple[str, ...]
    reason: str


class Handover:
    def __init__(self, node_id: str, drain: Callable[[coordinator_pb2.DrainRequest], coordinator_pb2.DrainResponse],
                 metrics: AgentMetrics, wall: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self._drain = drain
        self.metrics = metrics
        self.wall = wall
        self._lock = threading.Lock()
        self._pending = Pending((), "")
        self.notice: Notice | None = None  # the latest notice that this node goes away

    # ---- from the preemption watcher ---------------------------------------------------------

    def on_notice(self, notice: Notice) -> None:
        """Called from the watcher's thread once per distinct notice."""
        self.metrics.preemption_notices.labels(notice.source, notice.kind.value).inc()
        now = self.wall()
        log.warning("preemption notice for %s: %s", self.node_id, notice.describe(now))
        if notice.kind.value == "rebalance":
            return  # a recommendation, not a notice that the node goes: noted, nothing handed over
        self.notice = notice
        deadline = notice.deadline_unix if notice.deadline_unix is not None else now + DEFAULT_NOTICE_S
        reason = f"{notice.source} {notice.kind.value} notice: {notice.detail}"[:300]
        request = coordinator_pb2.DrainRequest(node_id=self.node_id, reason=reason, deadline_unix_s=deadline)
        threading.Thread(target=self._request, args=(request, deadline), name="ftd-drain", daemon=True).start()

    def _request(self, request: coordinator_pb2.DrainRequest, deadline: float) -> None:
        pause = 0.2
        while True:
            try:
                answer = self._drain(request)
                log.warning("drain of %s requested: %s", self.node_id, answer.message)
                return
            except (grpc.RpcError, ConnectionError) as exc:
                left = deadline - self.wall()
                if left <= 0:
                    log.error("drain of %s not accepted before the notice's deadline: %s", self.node_id,
                              describe(exc))
                    return
                log.warning("drain of %s not accepted yet (%s); retrying", self.node_id, describe(exc))
                time.sleep(min(pause, left))
                pause = min(pause * 2, 2.0)

    # ---- from the heartbeat session -------------------------------------------------------------

    def on_response(self, response: coordinator_pb2.HeartbeatResponse) -> None:
        pending = Pending(tuple(response.draining), response.draining_reason)
        with self._lock:
            changed = pending != self._pending
            self._pending = pending
        if changed:
            if pending.nodes:
                log.warning("hand-over pending for %s: workers save a final checkpoint (%s)",
                            ", ".join(pending.nodes), pending.reason)
            self.metrics.handover_pending.set(1 if pending.nodes else 0)

    @property
    def pending(self) -> Pending:
        with self._lock:
            return self._pending

    def going_away(self) -> str:
        """Why this node must not take a rank ("" when nothing says it goes away)."""
        notice = self.notice
        return f"preemption notice: {notice.describe(self.wall())}" if notice is not None else ""


def carry_parked(previous: cluster_pb2.Progress, progress: cluster_pb2.Progress) -> None:
    """The node's progress stays parked (``parked_step``) while its ranks report the stop step: a rank
    that has not parked yet does not unpark the node, a failed final save (-1) on any rank wins, and
    a later step (the new world trains on) clears it. Updates ``progress`` in place."""
    if not previous.HasField("parked_step") or progress.step > previous.step:
        return
    progress.parked_step = min(progress.parked_step, previous.parked_step) if progress.HasField("parked_step") \
        else previous.parked_step
