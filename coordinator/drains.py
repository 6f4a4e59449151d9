"""The ``Drain`` RPC: records a planned hand-over of a node (a spot preemption notice, ``ftctl drain``)
so that every rank of the job saves a final checkpoint before the new world is committed.

The hand-over itself is committed by the membership tick once :func:`~.handover_rules.handover_due` says
so; this keeper only validates the request and commits the durable :class:`~.handover_rules.Drain` record
(guarded like every other write), then tells every agent at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ftd.v1 import coordinator_pb2

from . import errors, handover_rules, validation
from .leader_state import LeaderState

log = logging.getLogger("ftd.coordinator.drains")
MAX_REASON = 300


class DrainKeeper:
    def __init__(self, state: LeaderState, *, push_all: Callable[[], None], wake: Callable[[], None],
                 wall: Callable[[], float] = time.time) -> None:
        self.state = state
        self.push_all = push_all
        self.wake = wake
        self.wall = wall
        self._lock = asyncio.Lock()

    async def drain(self, req: coordinator_pb2.DrainRequest) -> coordinator_pb2.DrainResponse:
        validation.validate_drain(req)
        node_id = req.node_id
        reason = validation.clip(validation.one_line(req.reason), MAX_REASON) or "drain requested"
        async with self._lock:
            view = self.state.require_leader()
            node = view.nodes.get(node_id)
            if node is None:
                raise errors.NodeNotFound(node_id)
            if node.fenced:
                raise errors.NodeFenced(node_id, "nothing to hand over")
            existing = view.drains.get(node_id)
            if existing is not None:
                return coordinator_pb2.DrainResponse(
                    accepted=True, message=f"hand-over of {node_id} already pending since "
                                           f"{self.wall() - existing.requested_unix_s:.1f}s: {existing.reason}")
            if view.rank_of(node_id) < 0:
                # A spare holds nothing: it is removed at once (fenced), never promoted while leaving.
                record = handover_rules.Drain(node_id, reason, self.wall(), req.deadline_unix_s, -1)
                message = f"{node_id} is a spare: removed at once, no hand-over needed"
            else:
                job = view.current_job()
                baseline = view.newest_restorable(job.job) if job is not None else -1
                record = handover_rules.Drain(node_id, reason, self.wall(), req.deadline_unix_s, baseline)
                message = (f"hand-over of {node_id} (rank {view.rank_of(node_id)}) pending: the job saves a "
                           f"final checkpoint newer than step {baseline}, then a spare takes the rank")
            await self.state.commit("drain", events=[("drain_requested", node_id, f"{node_id}: {reason}")],
                                    kv_puts={handover_rules.key(node_id): handover_rules.encode(record)})
            view.drains[node_id] = record
            log.warning("drain of %s requested (%s): %s", node_id, reason, message)
            self.push_all()
            self.wake()
            return coordinator_pb2.DrainResponse(accepted=view.rank_of(node_id) >= 0, message=message)
