"""etcd's space, kept by the leader so that a full database (NOSPACE) never stops fencing.

etcd refuses every write that adds data once its database file passes ``--quota-backend-bytes`` (the
NOSPACE alarm): a fence, a promotion, a new leader lease. A node's rendezvous certificate may write under
``/torch/elastic/`` (torch's etcd-v3 rendezvous shares its keys between the nodes of a run, so etcd's
RBAC cannot confine one node to keys of its own), and etcd bounds neither a user's bytes nor the history
that overwrites leave behind. So the leader:

* compacts every ``compact_every_s`` to the revision of the previous pass (one period of history stays
  for watchers), and at once when the database is pressed;
* measures every rendezvous run's live bytes and deletes a run over its budget (or the largest runs, while
  all of them together pass four budgets);
* defragments every member when the file passes ``defrag_above`` of the quota (etcd 3.4 counts the file,
  not the pages in use: a compaction alone frees nothing the quota sees);
* disarms NOSPACE once the file is below ``disarm_below`` of the quota.

The decisions are pure functions (:func:`plan`, :func:`may_disarm`) of one :class:`Reading`, the state and
the config, each returning its reason; :class:`EtcdSpace` is the thin etcd side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from ftd.etcd_client import current_member, make_client, parse_endpoints

log = logging.getLogger("ftd.coordinator")

RENDEZVOUS_ROOT = "/torch/elastic/"
RUN_PREFIXES = ("/torch/elastic/store/", "/torch/elastic/rendezvous/")
NEWEST = -1  # compact to the newest revision (after the cleaning)
TOTAL_BUDGETS = 4  # all rendezvous runs together may hold this many budgets
NOSPACE_ALARM = 1  # etcdserverpb.AlarmType.NOSPACE
PAGE = 500  # keys read per range call while measuring


@dataclass(frozen=True)
class SpaceConfig:
    quota_bytes: int  # etcd's --quota-backend-bytes (what the members were started with)
    rendezvous_budget_bytes: int  # live bytes (keys + values) one rendezvous run may hold
    compact_every_s: float = 30.0
    defrag_above: float = 0.5  # of the quota: defragment when the file is larger
    disarm_below: float = 0.8  # of the quota: NOSPACE is disarmed once the file is smaller


@dataclass
class SpaceState:
    compacted_at: float = -math.inf
    mark: int = 0  # the revision seen at the last periodic pass: the next one compacts to it
    defragged_size: int = 0  # the file's size after the last defragmentation


@dataclass(frozen=True)
class Reading:
    db_size: int  # the largest member's database file
    revision: int
    nospace: bool
    usage: Mapping[str, int]  # rendezvous run prefix -> live bytes


@dataclass(frozen=True)
class SpacePlan:
    clean: tuple[str, ...] = ()
    compact_to: int = 0  # 0: no compaction; NEWEST: the newest revision after the cleaning
    defragment: bool = False
    reason: str = ""

    @property
    def acts(self) -> bool:
        return bool(self.clean or self.defragment or self.compact_to == NEWEST)


def run_prefix(key: str) -> str | None:
    """The run a rendezvous key belongs to (``/torch/elastic/store/<run>/`` or
    ``/torch/elastic/rendezvous/<run>``), or None for a key outside them."""
    for root in RUN_PREFIXES:
        if key.startswith(root):
            run = key[len(root):].split("/", 1)[0]
            return root + run + ("/" if root.endswith("store/") else "")
    return None


def usage_by_run(items: Iterable[tuple[str, int]]) -> dict[str, int]:
    """``(key, bytes)`` pairs summed per run (keys outside every run under their own name)."""
    out: dict[str, int] = {}
    for key, size in items:
        run = run_prefix(key) or key
        out[run] = out.get(run, 0) + size
    return out


def plan(now: float, reading: Reading, state: SpaceState, config: SpaceConfig) -> SpacePlan:
    """What to do about etcd's space now, and why."""
    reasons: list[str] = []
    budget = config.rendezvous_budget_bytes
    clean = sorted(run for run, size in reading.usage.items() if size > budget)
    reasons += [f"rendezvous run {run} holds {reading.usage[run]} bytes, over its budget of {budget}" for run in clean]
    left = sorted(((size, run) for run, size in reading.usage.items() if run not in clean), reverse=True)
    total = sum(size for size, _ in left)
    while left and total > TOTAL_BUDGETS * budget:
        size, run = left.pop(0)
        clean.append(run)
        reasons.append(f"rendezvous runs hold {total} bytes together, over {TOTAL_BUDGETS} budgets: the largest, "
                       f"{run} ({size} bytes), goes")
        total -= size
    threshold = config.defrag_above * config.quota_bytes
    grew = reading.db_size - state.defragged_size >= 0.1 * config.quota_bytes
    defragment = reading.nospace or (reading.db_size >= threshold and grew)
    if reading.nospace:
        reasons.append("etcd raised NOSPACE: writes (fences, promotions) are refused")
    elif defragment:
        reasons.append(f"database file {reading.db_size} bytes, over {config.defrag_above:.0%} of the quota "
                       f"{config.quota_bytes}")
    if clean or defragment:
        return SpacePlan(tuple(clean), NEWEST, defragment, "; ".join(reasons))
    if now - state.compacted_at >= config.compact_every_s and state.mark > 0:
        return SpacePlan(compact_to=state.mark, reason=f"periodic compaction to revision {state.mark}")
    return SpacePlan(reason="nothing to do")


def advance(now: float, reading: Reading, state: SpaceState, done: SpacePlan, config: SpaceConfig) -> None:
    """The state after a pass: a new mark every period (or after a compaction to the newest revision)."""
    if done.compact_to == NEWEST or now - state.compacted_at >= config.compact_every_s:
        state.compacted_at, state.mark = now, reading.revision


def may_disarm(db_size: int, config: SpaceConfig) -> tuple[bool, str]:
    """Whether NOSPACE may be disarmed with the file at ``db_size`` (after cleaning and defragmenting)."""
    limit = config.disarm_below * config.quota_bytes
    if db_size < limit:
        return True, f"database file {db_size} bytes, below {config.disarm_below:.0%} of the quota"
    return False, (f"database file still {db_size} bytes, not below {config.disarm_below:.0%} of the quota "
                   f"{config.quota_bytes}: NOSPACE stays (free space: etcdctl del, compact, defrag)")


class EtcdSpace:
    """The etcd calls of the space keeper: a failover client for the keys, alarms and compaction, and one
    client per member for what is per member (the file's size, a defragmentation); made inside the
    caller's :func:`ftd.etcd_client.using_tls`."""

    def __init__(self, endpoints: str, timeout_s: float = 30.0) -> None:
        self.any = make_client(endpoints, timeout_s)
        self.members = [make_client(f"{host}:{port}", timeout_s) for host, port in parse_endpoints(endpoints)]

    def _sizes(self) -> list[int]:
        sizes = []
        for client in self.members:
            with contextlib.suppress(Exception):  # a member down: the others say how large the file is
                sizes.append(int(client.status().db_size))
        return sizes

    def read(self) -> Reading:
        nospace = any(a.alarm_type == NOSPACE_ALARM for a in self.any.list_alarms())
        items: list[tuple[str, int]] = []
        start = RENDEZVOUS_ROOT.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        limit, revision = PAGE, 0
        while True:
            try:
                resp = self.any.get_range_response(start, end, limit=limit)
            except grpc.RpcError as exc:
                # A page of large values over gRPC's 4 MiB: fewer keys a page (etcd takes at most
                # 1.5 MiB a request, so two always fit).
                if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED or limit <= 2:
                    raise
                limit = max(2, limit // 8)
                continue
            revision = max(revision, int(resp.header.revision))
            items += [(kv.key.decode("utf-8", "replace"), len(kv.key) + len(kv.value)) for kv in resp.kvs]
            if not resp.more or not resp.kvs:
                break
            start = resp.kvs[-1].key + b"\0"
        return Reading(max(self._sizes(), default=0), revision, nospace, usage_by_run(items))

    def clean(self, prefixes: Sequence[str]) -> None:
        """Deletes every key of each run (a delete is allowed under NOSPACE)."""
        for prefix in prefixes:
            self.any.delete_prefix(prefix)

    def newest_revision(self) -> int:
        return int(self.any.get_response("/ftd/").header.revision)

    def compact(self, revision: int) -> None:
        try:
            self.any.compact(revision, physical=True)
        except grpc.RpcError as exc:  # compacted already (by a pass of another leader): nothing to do
            if exc.code() is not grpc.StatusCode.OUT_OF_RANGE:
                raise

    def defragment(self) -> int:
        """Defragments every member it reaches, one at a time (each blocks its member meanwhile); returns
        the largest file after."""
        for client in self.members:
            try:
                client.defragment()
            except Exception as exc:  # a member down is defragmented by a later pass
                log.warning("etcd space: cannot defragment member %s: %r", current_member(client), exc)
        return max(self._sizes(), default=0)

    def disarm(self) -> None:
        for alarm in list(self.any.list_alarms()):
            if alarm.alarm_type == NOSPACE_ALARM:
                self.any.disarm_alarm(alarm.member_id)

    def close(self) -> None:
        for client in [self.any, *self.members]:
            with contextlib.suppress(Exception):
                client.close()


class SpaceKeeper:
    """Runs a pass every ``poll_s`` while this replica leads (only the leader maintains etcd); every pass
    that acts is logged and recorded as an ``etcd_space`` event once writes go through again."""

    def __init__(self, space: EtcdSpace, config: SpaceConfig, is_leader: Callable[[], bool],
                 record: Callable[[str], Awaitable[object]] | None = None, poll_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.space, self.config, self.is_leader, self.record = space, config, is_leader, record
        self.poll_s, self.clock = poll_s, clock
        self.state = SpaceState()
        self.last = ""  # what the last pass did, and why

    def pass_once(self) -> SpacePlan:
        """One pass (blocking: run it off the event loop)."""
        now = self.clock()
        reading = self.space.read()
        todo = plan(now, reading, self.state, self.config)
        if todo.clean:
            self.space.clean(todo.clean)
        if todo.compact_to:
            self.space.compact(self.space.newest_revision() if todo.compact_to == NEWEST else todo.compact_to)
        size = reading.db_size
        if todo.defragment:
            size = self.state.defragged_size = self.space.defragment()
        why = todo.reason
        if reading.nospace:
            disarm, because = may_disarm(size, self.config)
            if disarm:
                self.space.disarm()
            why = f"{why}; {'NOSPACE disarmed' if disarm else 'NOSPACE kept'}: {because}"
        advance(now, reading, self.state, todo, self.config)
        self.last = why
        return SpacePlan(todo.clean, todo.compact_to, todo.defragment, why)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            if self.is_leader():
                try:
                    done = await asyncio.to_thread(self.pass_once)
                    if done.acts:
                        log.warning("etcd space: %s", done.reason)
                        if self.record is not None:
                            with contextlib.suppress(Exception):  # informational: the next pass goes on
                                await self.record(done.reason)
                except Exception as exc:
                    log.warning("etcd space pass failed: %r", exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.poll_s)
