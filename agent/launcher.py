"""The agent's own launcher: what torchrun's elastic agent did, done without torch and without
starting Python again on a membership change.

One :class:`Launcher` per node and job, a state machine driven by :meth:`Launcher.step` (one bounded
step, returning how long until the next is due) and :meth:`Launcher.run` (the loop, in a thread):

* ``JOIN``: ``JoinRound`` with the round this node last ran in. READY: rank 0 picks a free port on the
  node's host and publishes it (``SetRoundStore``); the others wait (``STORE``, bounded) until the
  round's store address appears. Then every local rank's environment is built
  (``RANK = node_rank * nproc + local_rank``, ``WORLD_SIZE = world_size * nproc``, ``MASTER_ADDR`` /
  ``MASTER_PORT`` from the store address, ...) and the :class:`~.warm_pool.WarmPool`'s standbys are
  activated: torch was imported long before, the workers go straight to ``init_process_group``.
* ``WAIT``: a spare, or too few nodes: JoinRound again at most every ``poll_s`` and at once on
  :meth:`Launcher.kick` (the agent calls it when its assignment changes).
* ``RUNNING``: the workers are watched every ``monitor_s``. All exit 0: ``DONE`` (the job is finished
  on this node; like torchrun the launcher does not close the job: ``CloseJob`` is an operator's
  call). One exits non-zero: the node's other workers are killed and it joins again with
  ``last_round`` = the round it ran (the coordinator's rules count the restart), after
  ``failure_settle_s`` (or at once on a kick) so that a peer's death the coordinator is about to see
  is not counted twice. :meth:`Launcher.abort` (the agent's push-abort on a newer epoch) SIGKILLs the
  workers at once and joins again.
* ``CLOSED``: the job is closed (finished by an operator, or its restart budget is spent): stop.

Decisions that need no process are pure functions returning ``(what, reason)`` (:func:`after_join`,
:func:`store_wait`, :func:`worker_outcome`, :func:`push_action`, :func:`worker_env`). Every RPC has a
deadline; failures back off (at most ``max_backoff_s``) and are logged once per change. This module
does not import torch (a test checks).
"""

from __future__ import annotations

import enum
import logging
import math
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import coordinator_pb2

from .warm_pool import PoolClosed, WarmPool, WorkerAssignment, kill_processes, reap

log = logging.getLogger("ftd.agent.launcher")

IDLE_S = 1.0  # the longest a loop sleeps without being kicked


class CoordinatorCalls(Protocol):
    """What the launcher needs of :class:`ftd.client.CoordinatorClient`."""

    def call(self, method: str, request: Any, *, idempotent: bool, timeout_s: float | None = None,
             deadline_s: float | None = None) -> Any: ...


class State(str, enum.Enum):
    JOIN = "join"
    WAIT = "wait"
    STORE = "store"
    RUNNING = "running"
    DONE = "done"
    CLOSED = "closed"
    STOPPED = "stopped"


TERMINAL = frozenset({State.DONE, State.CLOSED, State.STOPPED})


class Act(str, enum.Enum):
    WAIT = "wait"  # not now: ask again later
    HOST_STORE = "host_store"  # rank 0: publish the round's store, then start
    AWAIT_STORE = "await_store"  # wait for rank 0 to publish the round's store
    START = "start"  # activate the workers
    CLOSE = "close"  # the job is closed
    REJOIN = "rejoin"  # join again now (the round moved on)
    ABANDON = "abandon"  # join again, counting the round (its rank 0 never published a store)
    RUN = "run"  # the workers run
    DONE = "done"  # every worker exited 0
    FAIL = "fail"  # a worker failed


# ---- pure decisions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundView:
    """The parts of a ``RoundInfo`` the decisions read."""

    status: str  # "ready" | "wait" | "closed" | "unknown"
    round: int = 0
    epoch: int = 0
    rank: int = -1
    world_size: int = 0
    store_address: str = ""
    message: str = ""
    spare: bool = False
    restarts: int = 0
    max_restarts: int = 0

    @classmethod
    def of(cls, info: Any) -> RoundView:
        status = {coordinator_pb2.RoundInfo.READY: "ready", coordinator_pb2.RoundInfo.WAIT: "wait",
                  coordinator_pb2.RoundInfo.CLOSED: "closed"}.get(info.status, "unknown")
        return cls(status, int(info.round), int(info.epoch), int(info.rank), int(info.world_size),
                   str(info.store_address), str(info.message), bool(info.spare), int(info.restarts),
                   int(info.max_restarts))


def after_join(r: RoundView) -> tuple[Act, str]:
    """What to do with JoinRound's answer."""
    if r.status == "closed":
        return Act.CLOSE, r.message or "the job is closed"
    if r.status != "ready":
        return Act.WAIT, r.message or f"JoinRound answered {r.status}"
    if r.rank < 0 or r.world_size <= 0 or r.rank >= r.world_size:
        return Act.WAIT, f"JoinRound answered rank {r.rank} of {r.world_size}: not a usable rank"
    if r.rank == 0:
        return Act.HOST_STORE, f"rank 0 of {r.world_size} in round {r.round}: this node hosts the round's store"
    if r.store_address:
        return Act.START, f"rank {r.rank} of {r.world_size} in round {r.round}; store at {r.store_address}"
    return Act.AWAIT_STORE, f"rank {r.rank} of {r.world_size} in round {r.round}: waiting for rank 0's store"


def store_wait(joined_round: int, current: RoundView, now: float, deadline: float) -> tuple[Act, str]:
    """A non-zero rank waiting for its round's store, given the job's current round."""
    if current.status == "closed":
        return Act.CLOSE, current.message or "the job is closed"
    if current.round != joined_round:
        return Act.REJOIN, f"round {joined_round} moved on to {current.round} before its store appeared"
    if current.store_address:
        return Act.START, f"round {joined_round} store at {current.store_address}"
    if now >= deadline:
        return Act.ABANDON, f"rank 0 of round {joined_round} published no store in time"
    return Act.WAIT, f"round {joined_round}: no store yet"


def worker_outcome(codes: Sequence[int | None]) -> tuple[Act, str]:
    """The node's workers, by local rank, as exit codes (``None``: running)."""
    if not codes:
        return Act.FAIL, "no workers"
    for local_rank, code in enumerate(codes):
        if code is not None and code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return Act.FAIL, f"local rank {local_rank} {how}"
    if all(code == 0 for code in codes):
        return Act.DONE, f"all {len(codes)} workers exited 0"
    return Act.RUN, f"{sum(1 for c in codes if c is None)} of {len(codes)} workers running"


def push_action(state: State, job: str, round_: int, epoch: int, pushed_epoch: int, pushed_job: str,
                pushed_round: int, fenced: bool) -> tuple[str, str]:
    """The agent's pushed assignment, for a launcher in ``state`` running ``round_`` (formed in world
    ``epoch``): ``("abort" | "kick" | "none", reason)``. A newer epoch, or a newer round of this job,
    means the running world is gone: abort. Not running: join again now."""
    if state in TERMINAL:
        return "none", f"launcher is {state.value}"
    running = state is State.RUNNING
    if fenced:
        return ("abort" if running else "kick"), "this node was fenced out of the world"
    if running and pushed_epoch > epoch:
        return "abort", f"epoch {pushed_epoch} replaced epoch {epoch} of round {round_}"
    if running and pushed_job == job and pushed_round > round_:
        return "abort", f"job {job} moved on to round {pushed_round} from round {round_}"
    if running:
        return "none", f"round {round_} (epoch {epoch}) is current"
    return "kick", f"assignment changed (epoch {pushed_epoch}) while {state.value}"


def worker_env(job: str, node_id: str, host: str, r: RoundView, nproc: int, local_rank: int, master_addr: str,
               master_port: int, max_restarts: int) -> dict[str, str]:
    """The environment torchrun gives a worker, for local rank ``local_rank`` of a node at rank
    ``r.rank`` in a round of ``r.world_size`` nodes, plus the round's ``FTD_*``."""
    rank = r.rank * nproc + local_rank
    world = r.world_size * nproc
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(r.rank), "GROUP_WORLD_SIZE": str(r.world_size),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(r.restarts), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_USE_AGENT_STORE": "False",
        "FTD_JOB": job, "FTD_NODE_ID": node_id, "FTD_HOST": host, "FTD_ROUND": str(r.round),
        "FTD_EPOCH": str(r.epoch),
    }


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str) -> int:
    """A port free on ``host`` right now (the worker of global rank 0 binds it for the round's store)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---- the state machine ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LauncherEvent:
    t: float  # wall clock (comparable with the workers' own records)
    mono: float
    kind: str  # joined, activated, failed, aborted, done, closed, wait
    round: int
    detail: str
    pids: tuple[int, ...] = ()  # the workers concerned


class Launcher:
    def __init__(self, client: CoordinatorCalls, job: str, node_id: str, host: str, nproc: int, min_nodes: int,
                 max_nodes: int, max_restarts: int, pool: WarmPool, *, argv: Sequence[str] | None = None,
                 poll_s: float = 0.2, store_poll_s: float = 0.05, store_wait_s: float = 300.0,
                 monitor_s: float = 0.05, round_poll_s: float = 2.0, failure_settle_s: float = 0.5,
                 kill_wait_s: float = 10.0, rpc_deadline_s: float = 5.0, max_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 on_event: Callable[[LauncherEvent], None] | None = None, on_no_spare: str = "shrink") -> None:
        if pool.nproc != nproc:
            raise ValueError(f"the pool has {pool.nproc} local ranks, the launcher {nproc}")
        self.client = client
        self.job, self.node_id, self.host = job, node_id, host
        self.nproc, self.min_nodes, self.max_nodes, self.max_restarts = nproc, min_nodes, max_nodes, max_restarts
        self.pool = pool
        self.argv = list(argv) if argv is not None else None
        self.poll_s, self.store_poll_s, self.store_wait_s = poll_s, store_poll_s, store_wait_s
        self.monitor_s, self.round_poll_s, self.failure_settle_s = monitor_s, round_poll_s, failure_settle_s
        self.kill_wait_s, self.rpc_deadline_s, self.max_backoff_s = kill_wait_s, rpc_deadline_s, max_backoff_s
        self.clock, self.wall, self.on_event = clock, wall, on_event
        self.on_no_spare = on_no_spare  # the job's setting, sent with every JoinRound (coordinator.rendezvous)

        self.state = State.JOIN
        self.reason = "not joined yet"
        self.last_round = -1  # the round this node's workers last ran in
        self.round = -1  # the round of the running workers
        self.epoch = -1
        self.rank = -1
        self.world_size = 0
        self.running_since: float | None = None  # monotonic: when the running workers were activated
        self.workers: list[subprocess.Popen[bytes]] = []
        self._killed: list[subprocess.Popen[bytes]] = []  # SIGKILLed, maybe not yet reaped
        self._joined: RoundView | None = None
        self._next_at = 0.0
        self._store_deadline = 0.0
        self._round_poll_at = 0.0
        self._tend_at = 0.0
        self._rpc_failures = 0
        self.step_errors = 0  # steps that raised (bugs): logged, counted, retried
        self._abort_why: str | None = None
        self._kicked = False
        self._stopping = False
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one step at a time
        self._thread: threading.Thread | None = None
        self.events: deque[LauncherEvent] = deque(maxlen=256)

    # ---- inputs from other threads (the agent) ---------------------------------------------------

    def kick(self) -> None:
        """Something changed (the agent's assignment): act now instead of at the next poll."""
        self._kicked = True
        self._wake.set()

    def abort(self, why: str) -> list[int]:
        """Push-abort: SIGKILL the workers now (from any thread); the loop then joins again."""
        self._abort_why = why
        pids = kill_processes(list(self.workers))
        if pids:
            log.warning("aborted workers %s of job %s round %d: %s", pids, self.job, self.round, why)
        self._wake.set()
        return pids

    def on_push(self, pushed_epoch: int, pushed_job: str, pushed_round: int, fenced: bool) -> str:
        """The agent's pushed assignment: abort, kick or nothing (:func:`push_action`)."""
        what, why = push_action(self.state, self.job, self.round, self.epoch, pushed_epoch, pushed_job,
                                pushed_round, fenced)
        if what == "abort":
            self.abort(why)
        elif what == "kick":
            self.kick()
        return what

    def worker_pids(self) -> list[int]:
        return [p.pid for p in list(self.workers) if p.poll() is None]

    # ---- the loop ------------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=f"ftd-launcher-{self.job}", daemon=True)
        self._thread.start()
        return self._thread

    def run(self) -> None:
        """Steps until stopped or the job is over here; then releases everything (:meth:`close`). A
        step that raises (a bug) is logged and retried a second later: the node stays in the job rather
        than leave it silently."""
        try:
            while not self._stopping and self.state not in TERMINAL:
                self._wake.clear()
                try:
                    delay = self.step()
                except Exception:
                    self.step_errors += 1
                    log.exception("launcher of job %s on %s: step failed (%d so far)", self.job, self.node_id,
                                  self.step_errors)
                    delay = IDLE_S
                if delay > 0 and not self._stopping:
                    self._wake.wait(min(delay, IDLE_S))
        finally:
            self.close()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops the loop, kills the workers and the standbys (bounded)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
            if thread.is_alive():
                log.error("launcher of job %s did not stop within %gs", self.job, timeout_s)
        self.close()

    def close(self) -> None:
        """SIGKILLs the workers and closes the pool (idempotent)."""
        workers, self.workers = self.workers, []
        kill_processes(workers)
        reap([*workers, *self._killed], self.kill_wait_s)
        self._killed = []
        self.pool.close()
        if self.state is not State.DONE and self.state is not State.CLOSED:
            self._set(State.STOPPED, "stopped")

    def step(self, now: float | None = None) -> float:
        """One bounded step; returns the seconds until the next one is due (``inf``: nothing to do)."""
        with self._lock:
            now = self.clock() if now is None else now
            if self._stopping:
                return math.inf
            why, self._abort_why = self._abort_why, None
            if why is not None:
                self._on_abort(now, why)
            if self._kicked:
                self._kicked = False
                if self.state in (State.JOIN, State.WAIT, State.STORE):
                    self._next_at = now
            if self.state not in TERMINAL and now >= self._tend_at:
                self._tend_at = now + 1.0
                self.pool.tend()
            if self.state is State.RUNNING:
                return self._monitor(now)
            if self.state in (State.JOIN, State.WAIT, State.STORE):
                if now < self._next_at:
                    return self._next_at - now
                return self._join(now) if self.state is not State.STORE else self._await_store(now)
            return math.inf

    # ---- steps ---------------------------------------------------------------------------------

    def _event(self, kind: str, detail: str, round_: int | None = None, pids: Sequence[int] = ()) -> None:
        event = LauncherEvent(self.wall(), self.clock(), kind, self.round if round_ is None else round_, detail,
                              tuple(pids))
        self.events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("launcher event callback failed")

    def _set(self, state: State, reason: str) -> None:
        if state is not self.state or reason != self.reason:
            level = logging.INFO if state in (State.WAIT, State.STORE, State.JOIN) else logging.WARNING
            log.log(level, "node %s job %s: %s (%s)", self.node_id, self.job, state.value, reason)
        self.state, self.reason = state, reason

    def _rpc(self, method: str, request: Any, idempotent: bool, deadline_s: float | None = None) -> Any | None:
        try:
            answer = self.client.call(method, request, idempotent=idempotent,
                                      deadline_s=self.rpc_deadline_s if deadline_s is None else deadline_s)
        except (ConnectionError, grpc.RpcError) as exc:
            self._rpc_failures += 1
            code = rpc_code(exc) if isinstance(exc, grpc.RpcError) else None
            detail = f"{code.name if code else '?'} {rpc_details(exc)}" if isinstance(exc, grpc.RpcError) else str(exc)
            log.log(logging.WARNING if self._rpc_failures <= 3 else logging.DEBUG,
                    "node %s job %s: %s failed (%d in a row): %s", self.node_id, self.job, method,
                    self._rpc_failures, detail)
            return None
        self._rpc_failures = 0
        return answer

    def _backoff(self, now: float) -> float:
        delay = min(self.max_backoff_s, self.poll_s * 2.0 ** min(self._rpc_failures, 10))
        self._next_at = now + delay
        return delay

    def _on_abort(self, now: float, why: str) -> None:
        if self.state in TERMINAL:
            return
        if self.state is State.RUNNING:
            kill_processes(self.workers)  # again: abort() may have raced with an activation
            self._killed.extend(self.workers)
            self.workers = []
            self.pool.refill_now(f"the workers were aborted ({why})")  # the next round needs standbys
            self._event("aborted", why)
            self._set(State.JOIN, f"aborted: {why}")
        elif self.state is State.STORE:
            self._set(State.JOIN, f"aborted while waiting for the store: {why}")
        self._next_at = now

    def _join(self, now: float) -> float:
        info = self._rpc("JoinRound", coordinator_pb2.JoinRoundRequest(
            job=self.job, node_id=self.node_id, last_round=self.last_round, min_nodes=self.min_nodes,
            max_nodes=self.max_nodes, max_restarts=self.max_restarts, on_no_spare=self.on_no_spare), idempotent=False)
        if info is None:
            return self._backoff(now)
        r = RoundView.of(info)
        act, why = after_join(r)
        if act is Act.CLOSE:
            return self._closed(why)
        if act is Act.WAIT:
            if self.state is not State.WAIT:
                self._event("wait", why, r.round)
            self._set(State.WAIT, why)
            self._next_at = now + self.poll_s
            return self.poll_s
        self._joined = r
        self._event("joined", why, r.round)
        if act is Act.HOST_STORE:
            try:
                port = free_port(self.host)
            except OSError as exc:
                log.error("node %s cannot find a free port on %s for round %d's store: %s", self.node_id,
                          self.host, r.round, exc)
                self._set(State.JOIN, f"no free port on {self.host}")
                return self._backoff(now)
            address = join_address(self.host, port)
            if self._rpc("SetRoundStore", coordinator_pb2.SetRoundStoreRequest(
                    job=self.job, round=r.round, node_id=self.node_id, address=address), idempotent=True) is None:
                self._set(State.JOIN, f"could not publish the store of round {r.round}")
                return self._backoff(now)
            return self._start(now, r, self.host, port)
        if act is Act.START:
            host, port = split_address(r.store_address)
            return self._start(now, r, host, port)
        self._set(State.STORE, why)
        self._store_deadline = now + self.store_wait_s
        self._next_at = now
        return 0.0

    def _await_store(self, now: float) -> float:
        joined = self._joined
        assert joined is not None
        info = self._rpc("GetRound", coordinator_pb2.GetRoundRequest(job=self.job), idempotent=True)
        if info is None:
            if now >= self._store_deadline:
                self._set(State.JOIN, f"no answer about round {joined.round}'s store in time")
                self.last_round = max(self.last_round, joined.round)
            return self._backoff(now)
        act, why = store_wait(joined.round, RoundView.of(info), now, self._store_deadline)
        if act is Act.CLOSE:
            return self._closed(why)
        if act is Act.START:
            try:
                host, port = split_address(info.store_address)
            except ValueError as exc:
                act, why = Act.ABANDON, f"round {joined.round}'s store address is unusable: {exc}"
            else:
                return self._start(now, joined, host, port)
        if act in (Act.REJOIN, Act.ABANDON):
            if act is Act.ABANDON:
                self.last_round = max(self.last_round, joined.round)  # counted: the round is over for us
            self._set(State.JOIN, why)
            self._next_at = now
            return 0.0
        self._next_at = now + self.store_poll_s
        return self.store_poll_s

    def _start(self, now: float, r: RoundView, master_addr: str, master_port: int) -> float:
        left = reap(self._killed, self.kill_wait_s)  # the old workers' memory (GPU) must be free first
        if left:
            log.error("node %s: killed workers %s still exist after %gs", self.node_id, left, self.kill_wait_s)
        self._killed = []
        assignments = [WorkerAssignment(worker_env(self.job, self.node_id, self.host, r, self.nproc, lr, master_addr,
                                                   master_port, self.max_restarts), self.argv)
                       for lr in range(self.nproc)]
        self.last_round = max(self.last_round, r.round)  # from here on this node ran in the round
        try:
            procs = self.pool.activate(assignments)
        except (PoolClosed, OSError, ValueError) as exc:
            log.error("node %s job %s: cannot start the workers of round %d: %s", self.node_id, self.job, r.round, exc)
            self._set(State.JOIN, f"activation failed: {exc}")
            self._next_at = now + self.max_backoff_s
            return self.max_backoff_s
        self.workers = procs
        self.round, self.epoch, self.rank, self.world_size = r.round, r.epoch, r.rank, r.world_size
        self.running_since = now
        self._round_poll_at = now + self.round_poll_s
        self._event("activated", f"rank {r.rank} of {r.world_size} (epoch {r.epoch}), workers "
                                 f"{[p.pid for p in procs]}, master {join_address(master_addr, master_port)}",
                    pids=[p.pid for p in procs])
        self._set(State.RUNNING, f"round {r.round}: rank {r.rank} of {r.world_size}")
        return self.monitor_s

    def _monitor(self, now: float) -> float:
        act, why = worker_outcome([p.poll() for p in self.workers])
        if act is Act.DONE:
            self.workers = []
            self._event("done", why)
            self._set(State.DONE, f"job {self.job} finished on this node: {why}")
            return math.inf
        if act is Act.FAIL:
            killed = kill_processes(self.workers)
            self._killed.extend(self.workers)
            self.workers = []
            self._event("failed", why + (f"; killed the others {killed}" if killed else ""))
            self._set(State.JOIN, f"round {self.round} failed: {why}")
            self._next_at = now + self.failure_settle_s
            return self.failure_settle_s
        if self.round_poll_s > 0 and now >= self._round_poll_at:
            self._round_poll_at = now + self.round_poll_s
            # short: the workers are not watched while it runs (the agent's push is the fast path anyway)
            info = self._rpc("GetRound", coordinator_pb2.GetRoundRequest(job=self.job), idempotent=True,
                             deadline_s=min(1.0, self.rpc_deadline_s))
            if info is not None and int(info.round) > self.round:
                self._on_abort(now, f"job {self.job} moved on to round {info.round}")
                return 0.0
        return self.monitor_s

    def _closed(self, why: str) -> float:
        kill_processes(self.workers)
        self._killed.extend(self.workers)
        self.workers = []
        self._event("closed", why)
        self._set(State.CLOSED, why)
        return math.inf
