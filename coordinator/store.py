"""The coordinator's state store: a small interface, written once, with an etcd and an in-memory
implementation that pass the same contract tests (``tests/test_store_contract.py``).

Like torch elastic's ``RendezvousBackend``, the interface is deliberately tiny and the semantics
are spelled out here once:

* ``load()`` returns everything durable plus the world's revision, the fencing token for the next
  commit.
* ``commit(guard, ...)`` applies node records, the next world and events **atomically**, and only
  if (a) ``guard.leader`` is still the leader record and (b) when a world is written, the world key
  is still at ``guard.world_revision``. Otherwise it raises :class:`StaleStateError` and writes
  nothing: two leaders can never both commit an epoch.
* ``campaign`` creates the leader key bound to a lease if, and only if, no leader key exists;
  ``keep_alive`` refreshes it and answers ``False`` once the lease is gone (leadership lost).

Errors are translated once, at this boundary: :class:`StoreUnavailable` (could not reach the store;
nothing is known to be written), :class:`StaleStateError` (a guard failed; nothing written) and
:class:`StoreRejected` (the store refused the request itself, e.g. a transaction over etcd's
``--max-txn-ops`` or a full database; resending it unchanged will not help).

A commit costs ``len(nodes) + len(node_deletes) + len(events) + 3`` operations (+1 with a world);
callers keep it under ``MAX_TXN_OPS`` (etcd's default ``--max-txn-ops``).

Stored records that do not decode never fail a ``load()``: they are skipped and named in
``Snapshot.problems`` (one bad key must not take the leader down). ``alarms()`` names etcd's raised
alarms (``nospace``, ``corrupt``); while ``nospace`` is raised every commit is
:class:`StoreRejected` with a message saying how to free space.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .model import Event, LeaderInfo, NodeRecord, World, clip_event


class StoreError(Exception):
    """Base of the state store's errors."""


class StoreUnavailable(StoreError):
    """The store could not be reached; the operation may or may not have been applied only for
    writes that were in flight, which is why callers re-read (``load``) before deciding again."""

    def __init__(self, op: str, cause: BaseException | str) -> None:
        super().__init__(f"state store unavailable during {op}: {cause}")
        self.op = op


class StoreRejected(StoreError):
    """The store refused the request (not a connectivity problem); ``op`` names it."""

    def __init__(self, op: str, cause: BaseException | str) -> None:
        super().__init__(f"state store rejected {op}: {cause}")
        self.op = op


MAX_TXN_OPS = 128
NOSPACE = "nospace"
NOSPACE_HINT = ("etcd's database is full (NOSPACE alarm): nothing was written and no membership change can be "
                "committed until an operator frees space: compact (etcdctl compact <revision>), defragment every "
                "member (etcdctl defrag), then etcdctl alarm disarm; raise --quota-backend-bytes if it fills again")


def commit_ops(nodes: int, events: int, world: bool, kv: int = 0) -> int:
    """Operations one commit takes: puts and deletes, the event prune, the world read-back, the world put."""
    return nodes + events + kv + 2 + (1 if world else 0)


def check_kv_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/") or "\0" in key:
        raise ValueError(f"bad kv key {key!r}")
    return key


class StaleStateError(StoreError):
    """A commit's guard failed: another leader exists or the world changed since it was read."""


@dataclass(frozen=True)
class Snapshot:
    nodes: dict[str, NodeRecord]
    world: World
    world_revision: int  # 0 when no world was ever written
    last_event_seq: int
    leader: LeaderInfo | None
    kv: dict[str, bytes] = field(default_factory=dict)  # other subsystems' records (the checkpoint catalog)
    problems: tuple[str, ...] = ()  # records that did not decode and were skipped, naming their keys


@dataclass(frozen=True)
class Guard:
    leader: LeaderInfo
    world_revision: int | None = None  # required when the commit writes a world


@dataclass(frozen=True)
class Lease:
    id: int
    ttl_s: int
    leader: LeaderInfo


@dataclass(frozen=True)
class CommitResult:
    world_revision: int  # the world key's revision after the commit (unchanged when no world)


class StateStore(Protocol):
    def load(self) -> Snapshot: ...

    def commit(
        self,
        guard: Guard,
        nodes: Sequence[NodeRecord] = (),
        world: World | None = None,
        events: Sequence[Event] = (),
        prune_events_below: int = 0,
        kv_puts: Mapping[str, bytes] | None = None,
        kv_deletes: Sequence[str] = (),
        node_deletes: Sequence[str] = (),
    ) -> CommitResult: ...

    def list_events(self, limit: int, before_seq: int = 0, after_seq: int | None = None) -> list[Event]:
        """The newest ``limit`` events, newest first; with ``before_seq`` only those below it. With
        ``after_seq`` the oldest ``limit`` events above it instead, oldest first (a watcher's read)."""

    def alarms(self) -> list[str]:
        """etcd's raised alarms (``nospace``, ``corrupt``), sorted; ``[]`` when none."""

    def current_leader(self) -> LeaderInfo | None: ...

    def campaign(self, replica_id: str, address: str, ttl_s: int, now_unix: float) -> Lease | None: ...

    def keep_alive(self, lease: Lease) -> bool: ...

    def resign(self, lease: Lease) -> None: ...

    def close(self) -> None: ...


def new_leader_info(replica_id: str, address: str, now_unix: float) -> LeaderInfo:
    return LeaderInfo(replica_id, address, now_unix, uuid.uuid4().hex)


@dataclass
class _MemLease:
    lease: Lease
    expires: float


@dataclass
class MemoryStore:
    """In-process fake with the same contract, for fast unit tests of the control logic. Leases
    expire on an injectable clock, so tests move time instead of sleeping. ``available`` switched
    off makes every call raise :class:`StoreUnavailable`, like an unreachable etcd."""

    clock: Callable[[], float] = time.monotonic
    max_txn_ops: int = MAX_TXN_OPS
    _available: bool = True
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    world: World = field(default_factory=World)
    world_revision: int = 0
    events: dict[int, Event] = field(default_factory=dict)
    kv: dict[str, bytes] = field(default_factory=dict)
    raised: list[str] = field(default_factory=list)  # alarms, as etcd would raise them (tests set this)
    corrupt: dict[str, str] = field(default_factory=dict)  # key -> problem: records that "do not decode"
    revision: int = 0
    writes: int = 0
    _leader: _MemLease | None = None
    _next_lease: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def available(self) -> bool:
        return self._available

    @available.setter
    def available(self, value: bool) -> None:
        """Switching back on extends the leader's lease, as etcd does when it restarts."""
        with self._lock:
            if value and not self._available and self._leader is not None:
                self._leader.expires = self.clock() + self._leader.lease.ttl_s
            self._available = value

    def _check(self, op: str) -> None:
        if not self._available:
            raise StoreUnavailable(op, "memory store switched off")
        if self._leader is not None and self.clock() >= self._leader.expires:
            self._leader = None

    def load(self) -> Snapshot:
        with self._lock:
            self._check("load")
            last = max(self.events, default=0)
            leader = self._leader.lease.leader if self._leader else None
            return Snapshot(dict(self.nodes), self.world, self.world_revision, last, leader, dict(self.kv),
                            tuple(self.corrupt.values()))

    def commit(
        self,
        guard: Guard,
        nodes: Sequence[NodeRecord] = (),
        world: World | None = None,
        events: Sequence[Event] = (),
        prune_events_below: int = 0,
        kv_puts: Mapping[str, bytes] | None = None,
        kv_deletes: Sequence[str] = (),
        node_deletes: Sequence[str] = (),
    ) -> CommitResult:
        kv_puts = kv_puts or {}
        with self._lock:
            self._check("commit")
            for key in [*kv_puts, *kv_deletes]:
                check_kv_key(key)
            ops = commit_ops(len(nodes) + len(node_deletes), len(events), world is not None,
                             len(kv_puts) + len(kv_deletes))
            if ops > self.max_txn_ops:
                raise StoreRejected("commit", f"too many operations in txn request ({ops} > {self.max_txn_ops})")
            if NOSPACE in self.raised:
                raise StoreRejected("commit", NOSPACE_HINT)
            if self._leader is None or self._leader.lease.leader != guard.leader:
                raise StaleStateError(f"{guard.leader.replica_id} is not the leader")
            if world is not None and guard.world_revision != self.world_revision:
                raise StaleStateError(
                    f"world revision is {self.world_revision}, guard expected {guard.world_revision}"
                )
            self.revision += 1
            self.writes += 1
            for node in nodes:
                self.nodes[node.node_id] = node
            for node_id in node_deletes:
                self.nodes.pop(node_id, None)
                self.corrupt.pop(f"nodes/{node_id}", None)
            if world is not None:
                self.world = world
                self.world_revision = self.revision
            for event in events:
                self.events[event.seq] = clip_event(event)
            for seq in [s for s in self.events if s < prune_events_below]:
                del self.events[seq]
            for key in kv_deletes:
                self.kv.pop(key, None)
            self.kv.update(kv_puts)
            return CommitResult(self.world_revision)

    def list_events(self, limit: int, before_seq: int = 0, after_seq: int | None = None) -> list[Event]:
        with self._lock:
            self._check("list_events")
            if after_seq is not None:
                return [self.events[s] for s in sorted(s for s in self.events if s > after_seq)[:limit]]
            seqs = sorted((s for s in self.events if before_seq <= 0 or s < before_seq), reverse=True)
            return [self.events[s] for s in seqs[:limit]]

    def alarms(self) -> list[str]:
        with self._lock:
            self._check("alarms")
            return sorted(set(self.raised))

    def current_leader(self) -> LeaderInfo | None:
        with self._lock:
            self._check("current_leader")
            return self._leader.lease.leader if self._leader else None

    def campaign(self, replica_id: str, address: str, ttl_s: int, now_unix: float) -> Lease | None:
        with self._lock:
            self._check("campaign")
            if self._leader is not None:
                return None
            if NOSPACE in self.raised:  # etcd refuses to grant a lease while its database is full
                raise StoreRejected("campaign", NOSPACE_HINT)
            lease = Lease(self._next_lease, ttl_s, new_leader_info(replica_id, address, now_unix))
            self._next_lease += 1
            self._leader = _MemLease(lease, self.clock() + ttl_s)
            self.writes += 1
            return lease

    def keep_alive(self, lease: Lease) -> bool:
        with self._lock:
            self._check("keep_alive")
            if self._leader is None or self._leader.lease.id != lease.id:
                return False
            self._leader.expires = self.clock() + lease.ttl_s
            return True

    def resign(self, lease: Lease) -> None:
        with self._lock:
            self._check("resign")
            if self._leader is not None and self._leader.lease.id == lease.id:
                self._leader = None

    def close(self) -> None:
        pass
