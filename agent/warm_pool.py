"""Warm standby workers for the agent's launcher: torch is imported before a round needs it.

A :class:`WarmPool` keeps one standby process per local rank (``python -m ftd.training.warm_worker``:
torch and the job's module imported, the job's ``prepare()`` run when it has one, waiting on a pipe).
:meth:`WarmPool.activate` hands each standby its assignment (the round's environment) and returns the
processes as the node's running workers, in milliseconds; a standby still importing or preparing
picks its assignment up the moment it is ready. The next standby set is started in the background
(``SCHED_IDLE`` while it imports and prepares, so it takes only CPU time the training leaves), so the
next failure finds warm standbys too, but only once the new workers have trained (the agent calls
:meth:`WarmPool.refill_now` on their first step report; ``refill_grace_s`` after the activation at
the latest; at once when the workers are aborted again): ``SCHED_IDLE`` is not free while the new
world restores. Measured with the FSDP2 example (38 M parameters, 4 ranks on 2 cores): 4 standbys
preparing under ``SCHED_IDLE`` slowed the steps from 2.1 s to 2.4-3.1 s, because a training that waits
on its collectives leaves CPU time; refilled at the activation they halved the new world's CPU share
through its process group, restore and first step. A standby whose ``prepare()`` raised is logged
here (:attr:`WarmPool.prepare_failures`) and still serves: its job builds everything after the
assignment.

The agent process itself never imports torch: this module is the standard library only (a test
checks), and the pipe protocol is :mod:`ftd.training.warm_worker`'s.

Every process the pool starts leads its own session; :meth:`WarmPool.close` SIGKILLs the groups of
those still running (checked through their :class:`subprocess.Popen`, never by name, so a reused pid is
never hit) and reaps them, bounded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("ftd.agent.warm_pool")

# The protocol of ftd.training.warm_worker (not imported here: that package imports torch).
PROTOCOL = 1
ENV_BACKGROUND = "FTD_WARM_BACKGROUND"
WORKER_MODULE = "ftd.training.warm_worker"
MAX_ASSIGNMENT = 60_000  # below a pipe's 64 KiB: writing an assignment to a fresh pipe never blocks
_MAX_PENDING = 1 << 16  # protocol bytes kept from one standby while no full line came


class PoolClosed(RuntimeError):
    pass


def standby_argv(entry: str, args: Sequence[str] = (), python: str = sys.executable,
                 wait_s: float | None = None, preload: Sequence[str] = ()) -> list[str]:
    """The command line of a standby running ``entry`` (``MODULE[:FUNCTION]`` or a script) with ``args``,
    importing the ``preload`` modules ahead as well (torch, torch.distributed and torch._dynamo always)."""
    extra = ["--wait-s", f"{wait_s:g}"] if wait_s is not None else []
    for module in preload:
        extra += ["--preload", module]
    return [python, "-m", WORKER_MODULE, "--entry", entry, *extra, "--", *args]


def entry_from_cmd(cmd: Sequence[str]) -> tuple[str, list[str]]:
    """A torchrun-style training command (``-m MODULE ARGS...`` or ``script.py ARGS...``) as the
    standby's ``(entry, args)``."""
    if not cmd:
        raise ValueError("empty training command")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise ValueError("'-m' without a module in the training command")
        return cmd[1], list(cmd[2:])
    if cmd[0].startswith("-"):
        raise ValueError(f"training command starts with an option {cmd[0]!r}: give '-m MODULE' or a script")
    return cmd[0], list(cmd[1:])


@dataclass(frozen=True)
class WorkerAssignment:
    """What one standby is told when activated: environment variables to set and, unless ``None``,
    the job's argv (else the arguments it was started with)."""

    env: Mapping[str, str]
    argv: Sequence[str] | None = None

    def line(self) -> bytes:
        data = json.dumps({"env": dict(self.env), "argv": None if self.argv is None else list(self.argv)})
        raw = data.encode() + b"\n"
        if len(raw) > MAX_ASSIGNMENT:
            raise ValueError(f"assignment of {len(raw)} bytes (at most {MAX_ASSIGNMENT})")
        return raw


def kill_processes(procs: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGKILL) -> list[int]:
    """Signals the process group of each process not yet reaped (a reaped one's pid may be reused);
    returns the pids signalled."""
    hit = []
    for proc in procs:
        if proc.poll() is not None:
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                continue
        hit.append(proc.pid)
    return hit


def reap(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """Waits for the processes to exit, ``timeout_s`` in all; returns the pids still running."""
    deadline = time.monotonic() + timeout_s
    left = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            left.append(proc.pid)
    return left


def idle(pid: int) -> bool:
    """``pid`` to ``SCHED_IDLE``: it runs only on CPU time nobody else wants."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


@functools.cache
def idle_reversible() -> bool:
    """Whether a process of this agent can leave ``SCHED_IDLE`` again (``CAP_SYS_NICE``, or an
    ``RLIMIT_NICE`` that allows nice 0): a background standby must, before it trains. Tried once on a
    throwaway thread (a thread's policy is its own), so the agent's threads are never touched."""
    result = [False]

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result[0] = True
        except (AttributeError, OSError):
            pass

    probe = threading.Thread(target=attempt, name="ftd-sched-probe", daemon=True)
    probe.start()
    probe.join(5.0)
    if not result[0]:
        log.info("standby workers start at normal priority: this agent may not return a process from "
                 "SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE %s)", _nice_limit())
    return result[0]


def _nice_limit() -> str:
    try:
        import resource
        return str(resource.getrlimit(resource.RLIMIT_NICE)[0])
    except (ImportError, OSError, AttributeError):
        return "unknown"


def boost(pid: int) -> bool:
    """Every thread of ``pid`` to ``SCHED_OTHER`` (a background standby needed now); False if refused."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    ok = True
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            continue
        except OSError:
            ok = False
    return ok


@dataclass
class Standby:
    """One pre-started worker process and what its protocol pipe said so far."""

    local_rank: int
    proc: subprocess.Popen[bytes]
    background: bool
    spawned_at: float
    ready_at: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    prepare_error: str = ""  # the job's prepare() raised (the standby still serves, unprepared)
    assigned_at: float | None = None
    _buf: bytes = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        return self.ready_at is not None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def pump(self, now: float) -> None:
        """Reads what the standby wrote (non-blocking) and notes its ``ready`` / ``error`` lines."""
        if self.proc.stdout is None or self.proc.stdout.closed:
            return
        while True:
            try:
                chunk = os.read(self.fileno(), 65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return
            if not chunk:
                break
            self._buf = (self._buf + chunk)[-_MAX_PENDING:]
        while b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            try:
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if not isinstance(record, dict):
                continue
            if record.get("event") == "ready" and self.ready_at is None:
                self.ready_at, self.info = now, record
            elif record.get("event") == "error":
                self.error = str(record.get("message", ""))
            elif record.get("event") == "prepare_failed":
                self.prepare_error = str(record.get("message", "")) or "prepare() failed"

    def close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@dataclass(frozen=True)
class Readiness:
    """How long one standby took from its spawn to ready: the cold start a warm activation saves."""

    local_rank: int
    pid: int
    background: bool
    spawn_to_ready_s: float  # as the pool saw it (it reads the pipes when tended: an upper bound)
    startup_s: float  # as the standby measured it: process start to ready
    prepare_s: float | None = None  # the job's prepare() (None: the job has none), part of startup_s
    prepared: bool = False  # the standby holds a prepared context for the job's main


class WarmPool:
    """``nproc`` standby workers, one per local rank, started ahead of the round that needs them.

    ``argv_for_local_rank(local_rank)`` is a standby's command line (:func:`standby_argv`); ``env`` its
    environment (the agent's, with ``FTD_AGENT_SOCKET`` & co.), to which the pool adds ``LOCAL_RANK``
    and ``LOCAL_WORLD_SIZE``; ``log_path`` receives their stdout and stderr (``{local_rank}`` in it is
    replaced, for one log per rank)."""

    def __init__(self, argv_for_local_rank: Callable[[int], Sequence[str]], nproc: int, env: Mapping[str, str],
                 log_path: Path, *, prime: bool = True, background_refill: bool = True, background_prime: bool = True,
                 respawn_backoff_s: float = 1.0, refill_grace_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1 (got {nproc})")
        self.argv_for_local_rank = argv_for_local_rank
        self.nproc = nproc
        self.env = dict(env)
        self.log_path = log_path
        self.background_refill = background_refill
        self.background_prime = background_prime
        self.respawn_backoff_s = respawn_backoff_s
        self.refill_grace_s = refill_grace_s
        self._refill_due: float | None = None  # a background refill waits for refill_now() or this time
        self.clock = clock
        self._slots: list[Standby | None] = [None] * nproc
        self._handed: list[Standby] = []  # activated: the running workers (the launcher owns them now)
        self._failures = [0] * nproc  # standbys of a slot that died before ready, in a row
        self._respawn_at = [0.0] * nproc
        self.readiness: list[Readiness] = []
        self.activations = 0
        self.cold_activations = 0  # ranks activated with no live standby (a cold start)
        self.failed_starts = 0  # standbys that exited before they were ready
        self.prepare_failures = 0  # standbys whose job prepare() raised (they serve unprepared)
        self._lock = threading.RLock()
        self._closed = False
        self._refill: threading.Thread | None = None
        if prime:
            self.prime()

    # ---- processes ------------------------------------------------------------------------------

    def _spawn(self, local_rank: int, background: bool) -> Standby:
        """Starts one standby (caller holds the lock)."""
        if self._closed:
            raise PoolClosed("the warm pool is closed")
        env = {**self.env, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.nproc),
               "PYTHONUNBUFFERED": "1"}
        env.pop(ENV_BACKGROUND, None)
        background = background and idle_reversible()
        if background:
            env[ENV_BACKGROUND] = "1"
        if self.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers per node
        path = self._log_of(local_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv_for_local_rank(local_rank))
        with open(path, "ab") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                    start_new_session=True, close_fds=True)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        if background:
            idle(proc.pid)  # before the interpreter gets to `import torch`; the standby reverts when ready
        standby = Standby(local_rank, proc, background, self.clock())
        log.info("started standby worker pid %d for local rank %d%s", proc.pid, local_rank,
                 " (background)" if background else "")
        return standby

    def _log_of(self, local_rank: int) -> Path:
        return Path(str(self.log_path).replace("{local_rank}", str(local_rank)))

    def _fill(self, background: bool) -> None:
        with self._lock:
            for local_rank, slot in enumerate(self._slots):
                if slot is None and not self._closed:
                    self._slots[local_rank] = self._spawn(local_rank, background)

    def prime(self) -> None:
        """Starts a standby for every local rank that has none: under ``SCHED_IDLE`` unless
        ``background_prime`` is off. A node's first standbys wait for a round that may be hours away
        (a spare's, or a replacement agent's beside a training that runs): on an idle node they get
        the CPU all the same, on a busy one they take none from the training, and an activation that
        comes while they still import boosts them (:meth:`_hand`)."""
        self._fill(background=self.background_prime)

    def _refill_later(self) -> None:
        def refill() -> None:
            try:
                self._fill(background=True)
            except PoolClosed:
                pass
            except OSError as exc:
                log.error("cannot start the next standby workers: %s (tend() tries again)", exc)

        self._refill = threading.Thread(target=refill, name="ftd-warm-refill", daemon=True)
        self._refill.start()

    def _pump(self, now: float) -> None:
        """Reads every standby's pipe; notes readiness; forgets standbys that died (caller holds the lock)."""
        for local_rank, standby in enumerate(self._slots):
            if standby is None:
                continue
            was_ready = standby.ready
            standby.pump(now)
            if standby.ready and not was_ready:
                self._failures[local_rank] = 0
                prepare_s = standby.info.get("prepare_s")
                log.info("standby worker pid %d for local rank %d ready %.1fs after its start", standby.pid,
                         local_rank, now - standby.spawned_at)
                self.readiness.append(Readiness(local_rank, standby.pid, standby.background,
                                                round(now - standby.spawned_at, 4),
                                                float(standby.info.get("startup_s") or 0.0),
                                                None if prepare_s is None else float(prepare_s),
                                                bool(standby.info.get("prepared"))))
                if standby.prepare_error:
                    self.prepare_failures += 1
                    log.warning("standby worker pid %d (local rank %d): %s (traceback in %s)", standby.pid,
                                local_rank, standby.prepare_error, self._log_of(local_rank))
            if not standby.alive():
                code = standby.proc.returncode
                self._failures[local_rank] += 0 if standby.ready else 1
                self.failed_starts += 0 if standby.ready else 1
                backoff = min(30.0, self.respawn_backoff_s * 2 ** max(0, self._failures[local_rank] - 1))
                self._respawn_at[local_rank] = now + (backoff if not standby.ready else 0.0)
                log.warning("standby worker pid %d (local rank %d) exited with code %s%s", standby.pid, local_rank,
                            code, f": {standby.error}" if standby.error else "")
                standby.close_pipes()
                self._slots[local_rank] = None
        running = []
        for worker in self._handed:
            if worker.alive():
                running.append(worker)
            else:
                worker.close_pipes()
        self._handed = running

    def tend(self) -> None:
        """Notes readiness and replaces standbys that died or expired (with a backoff for ones that
        die before they are ready). Cheap: call it every second or so."""
        with self._lock:
            if self._closed:
                return
            now = self.clock()
            self._pump(now)
            if self._refill_due is not None:
                if now < self._refill_due:
                    return  # the new workers have not trained yet: no standby competes with their start
                self._refill_due = None
                log.info("starting the next standby workers: no step report %gs after the activation",
                         self.refill_grace_s)
            for local_rank, slot in enumerate(self._slots):
                if slot is None and now >= self._respawn_at[local_rank]:
                    try:
                        self._slots[local_rank] = self._spawn(local_rank, background=self.background_refill)
                    except OSError as exc:
                        log.error("cannot start a standby worker for local rank %d: %s", local_rank, exc)
                        self._respawn_at[local_rank] = now + 5.0

    def refill_now(self, why: str) -> bool:
        """Starts the background refill an activation deferred (the new workers trained a step, or
        were aborted and standbys are needed again); False when none was waiting."""
        with self._lock:
            if self._refill_due is None or self._closed:
                return False
            self._refill_due = None
            log.info("starting the next standby workers: %s", why)
            self._refill_later()
            return True

    def ready_count(self) -> int:
        with self._lock:
            self._pump(self.clock())
            return sum(1 for s in self._slots if s is not None and s.ready)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once every local rank has a ready standby; False when ``timeout_s`` passed first.
        Replaces standbys that die meanwhile (:meth:`tend`); a deferred refill starts now."""
        self.refill_now("someone waits for ready standbys")
        deadline = time.monotonic() + timeout_s
        while True:
            self.tend()
            with self._lock:
                if self._closed:
                    return False
                waiting = [s for s in self._slots if s is None or not s.ready]
                fds = [s.fileno() for s in waiting if s is not None and s.proc.stdout is not None
                       and not s.proc.stdout.closed]
            if not waiting:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if fds:
                select.select(fds, [], [], min(remaining, 0.1))
            else:
                time.sleep(min(remaining, 0.05))

    def pids(self) -> list[int]:
        """The standbys' pids (not the activated workers')."""
        with self._lock:
            return [s.pid for s in self._slots if s is not None and s.alive()]

    # ---- activation -----------------------------------------------------------------------------

    def activate(self, assignments: Sequence[WorkerAssignment]) -> list[subprocess.Popen[bytes]]:
        """Hands local rank ``i`` its assignment ``assignments[i]``; returns the processes, now the
        node's workers (the caller owns them: it monitors and kills them). Never waits for a standby
        to be ready: one still importing reads its assignment when it is. A rank with no live standby
        gets a cold one (counted in :attr:`cold_activations`). The next standby set follows in the
        background once the workers trained (:meth:`refill_now`) or ``refill_grace_s`` passed."""
        if len(assignments) != self.nproc:
            raise ValueError(f"{len(assignments)} assignments for {self.nproc} local ranks")
        lines = [a.line() for a in assignments]
        procs: list[subprocess.Popen[bytes]] = []
        with self._lock:
            if self._closed:
                raise PoolClosed("the warm pool is closed")
            now = self.clock()
            self._pump(now)
            for local_rank, line in enumerate(lines):
                standby = self._slots[local_rank]
                self._slots[local_rank] = None
                if standby is None or not standby.alive() or not self._hand(standby, line):
                    if standby is not None:
                        standby.close_pipes()
                    self.cold_activations += 1
                    log.warning("no live standby for local rank %d: starting a cold worker", local_rank)
                    standby = self._spawn(local_rank, background=False)
                    self._hand(standby, line)  # a fresh pipe: fails only if the process died already
                standby.assigned_at = now
                self._handed.append(standby)
                procs.append(standby.proc)
            self.activations += 1
            if self.background_refill:
                self._refill_due = now + self.refill_grace_s
            else:
                self._fill(background=False)
        return procs

    @staticmethod
    def _hand(standby: Standby, line: bytes) -> bool:
        if standby.background and not standby.ready:
            boost(standby.pid)  # still importing under SCHED_IDLE: it is needed now
        assert standby.proc.stdin is not None
        try:
            standby.proc.stdin.write(line)
            standby.proc.stdin.flush()
        except OSError:  # BrokenPipeError: it died meanwhile
            return False
        return True

    # ---- the end --------------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> list[int]:
        """SIGKILLs everything the pool started that still runs (standbys and the workers it handed
        out), reaps them (``timeout_s`` in all) and closes their pipes. Returns the pids killed."""
        with self._lock:
            self._closed = True
            refill = self._refill
        if refill is not None:
            refill.join(timeout=timeout_s)
        with self._lock:
            everything = [s for s in [*self._slots, *self._handed] if s is not None]
            self._slots = [None] * self.nproc
            self._handed = []
        killed = kill_processes([s.proc for s in everything])
        left = reap([s.proc for s in everything], timeout_s)
        if left:
            log.error("warm pool: pids %s did not exit within %gs of SIGKILL", left, timeout_s)
        for standby in everything:
            standby.close_pipes()
        return killed

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
