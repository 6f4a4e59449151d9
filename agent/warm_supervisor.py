"""Training supervision on the warm path (``launcher = "warm"``): the agent's own
:class:`~.launcher.Launcher` with standby workers (:class:`~.warm_pool.WarmPool`) instead of torchrun.

A membership change then costs a rendezvous and ``init_process_group``, not a new interpreter and
``import torch``: the standbys were started (torch imported) before they were needed, spares
included. Hang detection and push-abort keep the meaning they have on the torchrun path
(:class:`~.training.TrainingSupervisor`, whose inputs and hang check this class inherits); only the
process management differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ftd.v1 import cluster_pb2, coordinator_pb2

from .launcher import CoordinatorCalls, Launcher, State
from .supervisor import Supervisor
from .torchrun_supervisor import TrainingSupervisor, TrainSpec, signal_pids
from .warm_pool import WarmPool, entry_from_cmd, standby_argv

log = logging.getLogger("ftd.agent.torchrun_supervisor")


class WarmTrainingSupervisor(TrainingSupervisor):
    def __init__(self, spec: TrainSpec, supervisor: Supervisor, client: CoordinatorCalls,
                 report_hang: Callable[[bool, str, int], None], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec, supervisor, report_hang, lambda: False, clock)
        entry, args = entry_from_cmd(spec.cmd)
        self.pool = WarmPool(lambda local_rank: standby_argv(entry, args), spec.nproc_per_node, spec.env(),
                             spec.log_path)
        self.launcher = Launcher(client, spec.job, spec.node_id, spec.host, spec.nproc_per_node, spec.min_nodes,
                                 spec.max_nodes, spec.max_restarts, self.pool, on_no_spare=spec.on_no_spare)
        self._started = False
        self._running_since: float | None = None

    # ---- inputs --------------------------------------------------------------------------------

    def on_assignment(self, a: cluster_pb2.Assignment) -> None:
        with self._lock:
            promoted = a.role == cluster_pb2.ROLE_ACTIVE and not self.in_world and not a.fenced
            self.in_world = a.role == cluster_pb2.ROLE_ACTIVE and not a.fenced
            self.active = not a.fenced
            self.epoch = a.epoch
            if promoted:
                self.started_at, self.last_progress = self.clock(), None  # the startup grace starts now
            if not self._started and not a.fenced:
                self._started = True
                self.launches += 1
                self.launcher.start()
                log.warning("warm launcher of job %s started (%d standby worker(s))", self.spec.job,
                            self.spec.nproc_per_node)
        what = self.launcher.on_push(a.epoch, a.job, a.round, a.fenced)
        if what == "abort":
            with self._lock:
                self.last_progress, self.started_at = None, self.clock()

    def on_progress(self, step: int) -> None:
        super().on_progress(step)
        # the workers trained: the next standbys may start now without slowing their start
        self.pool.refill_now(f"the workers reported step {step}")

    def on_response(self, response: coordinator_pb2.HeartbeatResponse) -> None:
        """Every heartbeat answer: a new round of the job (a restart elsewhere) aborts a stale one."""
        if self._started and response.HasField("assignment"):
            a = response.assignment
            if a.job == self.spec.job and a.round > self.launcher.round >= 0:
                self.launcher.on_push(a.epoch, a.job, a.round, a.fenced)

    # ---- process management --------------------------------------------------------------------

    def _running(self) -> bool:
        return bool(self.launcher.worker_pids())

    def workers(self) -> list[int]:
        return self.launcher.worker_pids()

    def standby_pids(self) -> list[int]:
        return self.pool.pids()

    def standbys_ready(self) -> int:
        """Local ranks whose standby has torch imported: a spare is warm when this is nproc."""
        return self.pool.ready_count()

    def abort_workers(self, why: str) -> list[int]:
        pids = self.launcher.abort(why)
        self.last_progress = None
        self.started_at = self.clock()
        return pids

    def signal_workers(self, sig: int) -> list[int]:
        return signal_pids(self.workers(), sig)

    def _stop(self, why: str) -> None:
        if self._started:
            self.launcher.stop()
            log.warning("stopped the warm launcher of job %s: %s", self.spec.job, why)

    def _supervise(self) -> bool:
        """The launcher runs on its own thread: read its state (a new activation restarts the startup
        grace of the hang check)."""
        state = self.launcher.state
        self.finished = state is State.DONE
        self.closed = state is State.CLOSED
        since = self.launcher.running_since
        if since is not None and since != self._running_since:
            self._running_since = since
            self.started_at, self.last_progress, self._hang_reported = self.clock(), None, False
        return False
