"""The leader's state and the only way it changes durably: the guarded commit.

* A change is committed first and believed after: node records and the world reach the view only
  once etcd took them; a failed commit leaves memory as it was, so the coordinator never acts on
  state it could not commit.
* Commits run one at a time, because event sequence numbers are allocated here.
* The guard names this leader's term (and the world's revision when a world is written), so a
  deposed leader's commit is refused by etcd rather than trusted to a local flag.

The lease loop (:class:`~.control.Controller`) decides who leads; this class holds what it decided
(``lease``, ``suspended``, ``view``) and answers :meth:`require_leader` for every handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from ftd.throttle import LogThrottle

from . import errors
from .leader_state import EventLine
from .metrics import CoordinatorMetrics
from .model import Event, LeaderInfo, NodeRecord, World
from .settings import CoordinatorSettings
from .store import CommitResult, Guard, Lease, StaleStateError, StateStore, StoreRejected, StoreUnavailable
from .store_calls import StoreCalls
from .view import ClusterView

log = logging.getLogger("ftd.coordinator")


class Committer:
    """Implements :class:`~.leader_state.LeaderState`."""

    def __init__(self, store: StateStore, calls: StoreCalls, settings: CoordinatorSettings,
                 metrics: CoordinatorMetrics, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.calls = calls
        self.settings = settings
        self.replica_id = settings.effective_replica_id
        self.metrics = metrics
        self.clock = clock  # monotonic: liveness deadlines of a loaded view
        self.wall = wall  # unix time: event timestamps
        self.view: ClusterView | None = None
        self.lease: Lease | None = None
        self.suspended = False  # holds the lease but could not confirm it (or load the state)
        self.known_leader: LeaderInfo | None = None
        self.reload_wanted = False  # a guard refused a commit: the state in memory may be stale
        self._lock = asyncio.Lock()
        self._errors = LogThrottle(log)

    @property
    def is_leader(self) -> bool:
        return self.lease is not None and not self.suspended and self.view is not None

    def leader_address(self) -> str:
        if self.is_leader:
            assert self.lease is not None
            return self.lease.leader.address
        if self.lease is not None:
            return ""  # we hold the lease but cannot confirm it: nobody is known to lead
        return self.known_leader.address if self.known_leader else ""

    def require_leader(self) -> ClusterView:
        if self.is_leader:
            assert self.view is not None
            return self.view
        why = "cannot confirm its leadership (etcd unreachable)" if self.lease else "is a standby"
        raise errors.NotLeader(self.replica_id, self.leader_address(), why)

    async def load(self) -> ClusterView:
        """A fresh view from etcd; every known node gets ``failover_grace_s`` before it is judged."""
        snap = await self.calls.data("load", self.store.load)
        return ClusterView.from_snapshot(snap, self.clock(), self.settings.failover_grace_s)

    async def commit(self, kind: str, *, nodes: Sequence[NodeRecord] = (), world: World | None = None,
                     events: Sequence[EventLine] = (), kv_puts: Mapping[str, bytes] | None = None,
                     kv_deletes: Sequence[str] = (), node_deletes: Sequence[str] = ()) -> CommitResult:
        async with self._lock:
            return await self._commit_locked(kind, nodes, world, events, kv_puts or {}, kv_deletes, node_deletes)

    async def _commit_locked(self, kind: str, nodes: Sequence[NodeRecord], world: World | None,
                             events: Sequence[EventLine], kv_puts: Mapping[str, bytes],
                             kv_deletes: Sequence[str], node_deletes: Sequence[str] = ()) -> CommitResult:
        view = self.require_leader()
        assert self.lease is not None
        now = self.wall()
        epoch = world.epoch if world is not None else view.world.epoch
        evs = [Event(view.last_event_seq + i + 1, now, k, msg, node_id, epoch)
               for i, (k, node_id, msg) in enumerate(events)]
        last_seq = view.last_event_seq + len(evs)
        guard = Guard(self.lease.leader, view.world_revision if world is not None else None)
        started = time.perf_counter()  # the real duration of the etcd call, whatever the injected clocks say
        try:
            result = await self.calls.data("commit", self.store.commit, guard, nodes, world, evs,
                                           max(0, last_seq + 1 - self.settings.max_events), kv_puts, kv_deletes,
                                           node_deletes)
        except StoreUnavailable as exc:
            raise errors.StateUnavailable(f"not committed, etcd unreachable: {exc}") from exc
        except StoreRejected as exc:
            self.metrics.etcd_errors.labels("commit_rejected").inc()
            # Under NOSPACE every commit is refused, ten times a second: one line per kind per 10 s.
            self._errors.log(logging.ERROR, f"rejected:{kind}", "etcd rejected a %s commit, nothing changed: %s",
                             kind, exc)
            raise errors.StateRejected(f"not committed: {exc}") from exc
        except StaleStateError as exc:
            self.metrics.etcd_errors.labels("commit_stale").inc()
            log.warning("commit refused by its guard; re-checking leadership and reloading state")
            self.reload_wanted = True
            raise errors.CommitGuardFailed(f"not committed: {exc}; this replica re-checks its leadership") from exc
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        self.metrics.etcd_writes.labels(kind).inc()
        view.last_event_seq = last_seq
        for node in nodes:
            view.nodes[node.node_id] = node
        for node_id in node_deletes:
            view.forget(node_id)
        if world is not None:
            view.set_world(world, result.world_revision)
        return result
