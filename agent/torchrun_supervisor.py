"""The agent's supervision of the training job: launch torchrun with the ftd rendezvous when the node
holds a rank, abort the workers the moment the world changes, detect hangs, relaunch after a crash.

* **Launch**: every registered node runs ``torchrun --rdzv-backend=ftd ...``; on a spare it is a
  *hot spare*, waiting in the rendezvous with torch already imported, and joins the moment it is
  promoted. A fenced node stops everything at once (a zombie cannot disturb the new world).
* **Push-abort**: when the coordinator pushes a newer epoch, the old workers are SIGKILLed right
  away (torchrun itself stays and re-rendezvous), so no survivor waits in a collective for its peer.
* **Hang detection** (:func:`hang_check`, pure): no step progress for ``hang_timeout_s`` (or no first
  step within the startup grace). A node whose workers are stopped, in uninterruptible sleep or gone
  is the culprit and reports itself (the coordinator fences and replaces it); a node whose workers
  merely wait reports a stall (when every node stalls the job restarts in a new round).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftd.v1 import cluster_pb2

from .supervisor import Supervisor

log = logging.getLogger("ftd.agent.torchrun_supervisor")


@dataclass(frozen=True)
class TrainSpec:
    job: str
    cmd: tuple[str, ...]
    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    max_restarts: int
    coordinators: str
    node_id: str
    host: str
    socket: Path
    log_path: Path
    hang_timeout_s: float
    hang_startup_grace_s: float
    pki_dir: Path | None = None  # mTLS: handed to torchrun as FTD_PKI_DIR
    on_no_spare: str = "shrink"  # the job's setting, sent with every JoinRound (coordinator.rendezvous)

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--rdzv-backend=ftd", f"--rdzv-endpoint={self.coordinators}", f"--rdzv-id={self.job}",
            f"--nnodes={self.min_nodes}:{self.max_nodes}", f"--nproc-per-node={self.nproc_per_node}",
            "--max-restarts=1000000",  # the budget that counts is the job's, in the coordinator
            "--monitor-interval=0.1", f"--local-addr={self.host}",
            f"--rdzv-conf=max_restarts={self.max_restarts},node_id={self.node_id},on_no_spare={self.on_no_spare}",
            *self.cmd,
        ]

    def env(self) -> dict[str, str]:
        """torchrun's environment: the agent's socket, the node, and with mTLS the PKI directory (the
        ftd rendezvous handler uses its ``rendezvous/<node_id>`` certificate from there)."""
        env = {**os.environ, "FTD_AGENT_SOCKET": str(self.socket), "FTD_NODE_ID": self.node_id,
               "FTD_JOB": self.job, "FTD_HOST": self.host, "PYTHONUNBUFFERED": "1"}
        env.pop("FTD_PKI_DIR", None)
        if self.pki_dir is not None:
            env["FTD_PKI_DIR"] = str(self.pki_dir)
        return env


# ---- processes -------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, from /proc; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun's workers start their own sessions, so a process
    group signal does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_pids(pids: list[int], sig: int) -> list[int]:
    """Signals each pid; returns those that still existed."""
    hit = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            hit.append(pid)
    return hit


def states(pids: list[int]) -> list[str]:
    return [s[1] for p in pids if (s := _stat(p)) is not None]


def hang_check(now: float, started_at: float, last_progress_at: float | None, timeout_s: float,
               startup_grace_s: float, worker_states: list[str]) -> tuple[str, str]:
    """``("ok" | "culprit" | "stalled", reason)``: pure, so it is tested without waiting."""
    if timeout_s <= 0:
        return "ok", "hang detection off"
    since = now - (last_progress_at if last_progress_at is not None else started_at)
    limit = timeout_s if last_progress_at is not None else max(timeout_s, startup_grace_s)
    if since < limit:
        return "ok", f"progress {since:.1f}s ago"
    what = "no step progress" if last_progress_at is not None else "no first step"
    if not worker_states:
        return "culprit", f"{what} for {since:.0f}s and no worker process alive"
    stuck = [s for s in worker_states if s in ("T", "t", "D", "Z")]
    if stuck:
        return "culprit", (f"{what} for {since:.0f}s; worker(s) in state {','.join(sorted(set(stuck)))} "
                           "(stopped, uninterruptible or dead)")
    return "stalled", f"{what} for {since:.0f}s; workers alive and waiting ({','.join(sorted(set(worker_states)))})"


class TrainingSupervisor:
    def __init__(self, spec: TrainSpec, supervisor: Supervisor,
                 report_hang: Callable[[bool, str, int], None], job_closed: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.supervisor = supervisor
        self.report_hang = report_hang
        self.job_closed = job_closed
        self.clock = clock
        self._failures = 0
        self._next_launch = 0.0
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.last_progress: tuple[int, float] | None = None
        self.finished = False  # torchrun exited 0: the job is done on this node
        self.closed = False  # the job's rendezvous is closed: never relaunch
        self.active = False  # registered and not fenced: torchrun runs (in the world, or as a hot spare)
        self.in_world = False  # holds a rank: only then is a lack of progress a hang
        self.epoch = -1
        self.launches = 0
        self._hang_reported = False
        self._lock = threading.Lock()

    # ---- inputs --------------------------------------------------------------------------------

    def on_assignment(self, a: cluster_pb2.Assignment) -> None:
        with self._lock:
            if a.fenced:
                self.active = self.in_world = False
                self._stop("this node was fenced out of the world")
                return
            newer = a.epoch > self.epoch
            self.epoch = a.epoch
            self.active = True  # active or hot spare: torchrun runs; its rendezvous tells them apart
            promoted = a.role == cluster_pb2.ROLE_ACTIVE and not self.in_world
            self.in_world = a.role == cluster_pb2.ROLE_ACTIVE
            if promoted:
                self.started_at, self.last_progress = self.clock(), None  # the startup grace starts now
            if newer and self._running() and self.in_world and not promoted:
                aborted = self.abort_workers(f"epoch {a.epoch}: {a.reason}")
                if not aborted:
                    # No workers: torchrun is inside its rendezvous, maybe waiting on a store barrier
                    # for a node that just died. Start it over in the new epoch.
                    self._stop(f"epoch {a.epoch} while torchrun was rendezvousing")
                    self._next_launch = 0.0

    def on_progress(self, step: int) -> None:
        with self._lock:
            if self.last_progress is None or step != self.last_progress[0]:
                self.last_progress = (step, self.clock())
                self._hang_reported = False
                self._failures = 0

    # ---- actions -------------------------------------------------------------------------------

    def _running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def standby_pids(self) -> list[int]:
        """Processes started ahead for a later round (none here; the warm launcher's standbys)."""
        return []

    def standbys_ready(self) -> int:
        return 0

    def workers(self) -> list[int]:
        return descendants(self.proc.pid) if self._running() and self.proc is not None else []

    def abort_workers(self, why: str) -> list[int]:
        """Push-abort: SIGKILL the workers now; torchrun stays and joins the next round."""
        pids = signal_pids(self.workers(), signal.SIGKILL)
        if pids:
            log.warning("aborted workers %s (%s)", pids, why)
        self.last_progress = None
        self.started_at = self.clock()
        return pids

    def _launch(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = self.supervisor.start(self.spec.argv(), env=self.spec.env(), log_path=self.spec.log_path)
        self.started_at = self.clock()
        self.last_progress = None
        self.launches += 1
        log.warning("launched torchrun for job %s (pid %d, launch %d)", self.spec.job, self.proc.pid, self.launches)

    def _stop(self, why: str) -> None:
        if not self._running():
            return
        assert self.proc is not None
        pids = signal_pids([*self.workers(), self.proc.pid], signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None
        log.warning("stopped torchrun and its workers %s: %s", pids, why)

    def _closed(self) -> bool:
        try:
            closed = self.job_closed()
        except Exception as exc:  # unknown: try again later rather than give up on the job
            log.warning("cannot tell whether job %s is closed: %s", self.spec.job, exc)
            return False
        if closed:
            log.warning("job %s is closed: torchrun is not relaunched", self.spec.job)
        return closed

    def stop(self, why: str) -> None:
        with self._lock:
            self._stop(why)

    def signal_workers(self, sig: int) -> list[int]:
        return signal_pids(self.workers(), sig)

    def tick(self) -> None:
        """Called about once a second by the agent's main loop."""
        with self._lock:
            if self._supervise():
                return
            if not self._running() or self._hang_reported or not self.in_world:
                return
            step, at = self.last_progress if self.last_progress else (-1, None)
            verdict, why = hang_check(self.clock(), self.started_at, at, self.spec.hang_timeout_s,
                                      self.spec.hang_startup_grace_s, states(self.workers()))
        if verdict == "ok":
            return
        self._hang_reported = True
        log.error("hang detected (%s): %s", verdict, why)
        try:
            self.report_hang(verdict == "culprit", why, step)
        except Exception as exc:
            log.error("could not report the hang: %s", exc)
            self._hang_reported = False
        if verdict == "culprit":
            with self._lock:
                self.abort_workers(f"hung: {why}")

    def _supervise(self) -> bool:
        """torchrun's exit and (re)launch; True when it was just launched (no hang check this tick)."""
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.proc = None
            if code == 0:
                self.finished = True
                log.warning("job %s finished on this node (torchrun exited 0)", self.spec.job)
            else:
                self._failures += 1
                self._next_launch = self.clock() + min(30.0, 0.5 * 2 ** (self._failures - 1))
                log.error("torchrun exited with code %s; see %s", code, self.spec.log_path)
                self.closed = self._closed()
        if (self.active and not self._running() and not self.finished and not self.closed
                and self.clock() >= self._next_launch):
            self._launch()
            return True
        return False
