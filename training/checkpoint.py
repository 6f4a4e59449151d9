"""Checkpoints from the training side: two-phase save, verified restore, emergency flush.

    from ftd.training import Checkpointer

    ckpt = Checkpointer("my-job")              # rank/world size from torchrun's env, agent from FTD_AGENT_SOCKET
    restored = ckpt.load_latest()              # None on a fresh start, else (step, state_dict)
    ...
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})   # blocks for the snapshot only
    ckpt.wait()                                # flush before exit

A sharded job (FSDP2 ``fully_shard``, tensor parallel) saves in DCP form the state torch's own
helpers give, restored in place (DCP reshards it when the world size changed)::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from ftd.training import Checkpointer
    from ftd.training.cadence import CadencePolicy

    class AppState:                            # a DCP Stateful: get_state_dict names and shards the state
        def __init__(self, model, optim):
            self.model, self.optim = model, optim
        def state_dict(self):                  # creates Adam's lazily made state too (a zero-lr step)
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            return {"model": model_sd, "optim": optim_sd}
        def load_state_dict(self, sd):
            set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    state = {"app": AppState(model, optim)}   # any DCP state: Stateful objects, DTensor/ShardedTensor values
    ckpt = Checkpointer("my-job", format="dcp", cadence=CadencePolicy(1, 100),
                        dataloader=loader)     # optional: a Stateful loader; its position is kept per rank
    step = ckpt.restore(state)                 # in place; None on a fresh start; RNG states and loader too
    ckpt.prepare(state)                        # optional: the snapshot buffers allocated now, not at a save
    for step in range(0 if step is None else step + 1, steps):
        ...                                    # forward, backward, optim.step()
        ckpt.step_end(step, lambda: state)     # a memory snapshot / durable checkpoint when the cadence says
    ckpt.wait()
    ckpt.close()

Every save also keeps this rank's RNG states (python ``random``, numpy when loaded, torch CPU, CUDA
when initialised) and the ``dataloader``'s ``state_dict()``; a restore sets them back (``rng=False``
keeps the RNG out), so a deterministic job recovers bit-identical to an uninterrupted run
(:mod:`.rank_state`). :meth:`Checkpointer.prepare` calls the state's ``state_dict()``: around
``get_state_dict`` on an optimizer that never stepped, that creates its state with torch's zero-lr
step (Adam's step count starts at 1), so on a fresh start call it after the first step if the run
must match one without it. Before the world is known (a standby's ``prepare()`` hook), a
:class:`~.snapshot.Snapshotter` can reserve the bytes ahead: ``Snapshotter().reserve(n)``, handed
over as ``Checkpointer(..., buffers=...)``.

:class:`Checkpointer` is the API; the work is done by three parts, each its own module:

* **Save** (:mod:`.save_loop`) is two-phase: :meth:`Checkpointer.save` copies the state into host
  memory (reused buffers) and returns; a background thread writes the shard to the node's SSD tier
  in a staging folder, checksums every file (CRC32C), publishes it with its manifest written last
  (fsync + rename), and commits it to the catalog through the agent. The checkpoint becomes valid
  when every rank has committed. A failure (disk full...) is logged, reported to the agent (metric,
  alert) and kept in :attr:`Checkpointer.last_error`; training goes on.
* **Restore** (:mod:`.restore`) asks the catalog for the newest valid step and reads this rank's
  shard from the fastest copy, verifying every file's CRC32C before unpickling a byte; a corrupt copy
  is recorded and the next one tried, a step invalidated only when every copy was proven corrupt.
* **Emergency flush** (:mod:`.emergency`): on SIGTERM (and optional extra signals, or a
  preemption-notice file appearing) the latest snapshot is persisted before the process exits.

**Memory snapshots and cadence**: with a memory tier on the node (the agent's tmpfs directory),
:meth:`Checkpointer.step_end` asks the job's :class:`~.cadence.CadencePolicy` what to do at each step:
a memory snapshot (written into the memory tier, committed with tier ``mem``; the agent replicates it
to its buddy node) every ``memory_every_steps`` unless snapshots slow the whole step by more than
``max_stall_fraction`` (then the interval widens, agreed by every rank), and a durable checkpoint
(the memory copy copied to the SSD by the agent, its first tiering hop) every
``persist_every_steps`` or ``persist_every_s``. At most two snapshots per rank are held; one that
would exceed the memory tier's budget is refused with a clear error (reported as ``memory_full``),
never an OOM. Restore tries, fastest first: this node's memory, another node's memory (the buddy's,
pulled through the agent: ``FetchShard``), the SSD, HDD, S3, then any other node's copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ftd.checkpoints.catalog import MEMORY
from ftd.checkpoints.layout import check_job
from ftd.storage_backends.tiers import Tier, open_tiers
from ftd.v1 import cluster_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused, tiers_from_proto
from .cadence import CadencePolicy, CadenceTracker, agree_max
from .checkpoint_signing import ShardSigner
from .dcp_io import check_template
from .emergency import EmergencyFlush
from .handover_stop import HandoverFlag, agree_any
from .rank_state import RankState
from .restore import RestoreError, Restorer, load_into
from .save_loop import SaveLoop, SaveResult, failpoint
from .snapshot import Snapshotter
from .step_timing import StepTimer

log = logging.getLogger("ftd.training.checkpoint")


class HandoverTimeout(RuntimeError):
    """A rank parked for a planned hand-over, and no new world came."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


class Checkpointer:
    def __init__(
        self,
        job: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: int | None = None,
        format: str = "torch",
        agent_socket: str | None = None,
        agent: AgentLink | None = None,
        emergency_signals: Sequence[int] = (signal.SIGTERM,),
        preemption_file: str | None = None,
        install_signal_handlers: bool = True,
        cadence: CadencePolicy | None = None,
        dataloader: Any = None,
        rng: bool = True,
        buffers: Snapshotter | None = None,
    ) -> None:
        self.job = check_job(job)
        if format not in ("torch", "dcp"):
            raise ValueError(f"format must be 'torch' or 'dcp', got {format!r}")
        self.format = format
        self.rank = rank if rank is not None else _env_int("RANK", 0)
        self.world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        self.agent = agent or AgentLink(agent_socket)
        tiers = self.agent.tiers()
        self.node_id = tiers.node_id
        self.epoch = epoch if epoch is not None else _env_int("FTD_EPOCH", self.agent.info().assignment.epoch)
        # The job round (ftd's launcher and rendezvous handler set it): a restart in the same epoch
        # is a new timeline, and the catalog tells the rounds' steps apart by it.
        round_ = _env_int("FTD_ROUND", -1)
        self.agent.round = round_ if round_ >= 0 else None
        self.tiers: list[Tier] = open_tiers(tiers_from_proto(tiers))  # the agent's own specs, fastest first
        self.ssd = next(t for t in self.tiers if t.name != MEMORY)
        self.mem: Tier | None = next((t for t in self.tiers if t.name == MEMORY), None)
        self.cadence = cadence or CadencePolicy()
        extra = RankState(dataloader, rng)  # this rank's RNG states and data loader position, with every save
        # Every shard signed with the node's key, every copy's signature checked before it is loaded
        # (checkpoint_signing; None: an agent without mTLS).
        self.signer = ShardSigner.from_agent(self.agent)
        self.saves = SaveLoop(self.job, self.rank, self.world_size, self.epoch, self.format, self.agent, self.ssd,
                              self.mem, self.cadence.describe() if cadence is not None else "", extra, buffers,
                              self.signer)
        self.restorer = Restorer(self.job, self.rank, self.world_size, self.format, self.tiers, self.agent, extra,
                                 self.epoch, self.signer)
        # The cadence (step_end): measured on every rank, agreed by all (one all-reduce per decision).
        self.cadence_tracker = CadenceTracker(self.cadence, lambda values: agree_max(values, self.world_size))
        self._handover = HandoverFlag()
        self.timing = StepTimer(self.rank)  # the straggler detector's evidence (training/step_timing.py)
        self.saves.cleanup_leftovers()
        self._emergency = EmergencyFlush(self.wait, emergency_signals, preemption_file, install_signal_handlers)

    @property
    def last_error(self) -> str:
        """Why the latest failed save failed ("" before any failure)."""
        return self.saves.last_error

    @property
    def results(self) -> deque[SaveResult]:
        """The results of the latest saves (at most 1000), oldest first."""
        return self.saves.results

    @property
    def last_blocked_s(self) -> float:
        """How long the latest save held the training loop (its snapshot)."""
        return self.saves.last_blocked_s

    @property
    def restore_timings(self) -> dict[str, float]:
        """Where the last restore's time went (seconds): ``target_s`` (the catalog's answer),
        ``read_s`` (this rank's verify and load), ``agree_s`` (waiting for the other ranks)."""
        return dict(self.restorer.timings)

    @property
    def restored_from(self) -> str:
        """The copy the last restore loaded ("mem@node-2", "ssd@node-0", ...)."""
        return self.restorer.restored_from

    @property
    def snapshot_alloc_s(self) -> float:
        """How long the latest save spent allocating snapshot buffers (0 when :meth:`prepare`, a
        reserved ``buffers=`` or an earlier save had laid them out)."""
        return self.saves.snapshot_alloc_s

    @property
    def restored_extra(self) -> list[str]:
        """What the last restore set back besides the state: the RNGs ("python", "numpy", "torch",
        "cuda") and "dataloader" (empty for a shard saved without them, or when not asked for)."""
        return list(self.restorer.restored_extra)

    # ---- save ----------------------------------------------------------------------------------

    def prepare(self, state: Any) -> int:
        """Allocates the snapshot buffers for ``state`` now (every page touched), so that no save
        stalls allocating them; returns their bytes. Calls the state's ``state_dict()`` (see the
        module docstring about an optimizer that never stepped)."""
        return self.saves.prepare(state)

    def save(self, step: int, state_dict: dict[str, Any], *, memory: bool = False,
             durable: bool = True) -> Future[SaveResult]:
        """Snapshots ``state_dict`` into host memory and returns; the write happens in the background.
        The previous save, if still writing, is waited for first (its buffers are reused); its commit
        to the catalog may still be running.

        ``durable`` (the default, and all a plain ``save()`` does): the shard is written to the node's
        SSD tier. ``memory``: it is written to the node's memory tier first and committed there (the
        agent replicates it to its buddy); with ``durable`` as well, a second thread then has the
        agent copy that memory copy to the SSD, so the next snapshot waits for the memory write only.
        Without a memory tier on the node ``memory`` is ignored. :meth:`step_end` chooses both by the
        cadence."""
        if self.format == "dcp":
            check_template(state_dict)  # a bare optimizer could be saved, but never loaded back right
        if durable or self.mem is None:
            # A durable save's write competes with the next step's compute: that step is not straggler
            # evidence. A memory snapshot is not marked: at the default cadence (one every step) every
            # step would be, and the straggler watch would never judge (the medians absorb its cost).
            self.timing.saved()
        return self.saves.save(step, state_dict, memory=memory, durable=durable)

    def step_end(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> Future[SaveResult] | None:
        """Call at the end of every training step, on every rank (a collective every
        ``decide_every_steps``: the ranks agree on the snapshot interval): saves what the cadence says
        (``state_fn`` is called only then; :mod:`.cadence`: the whole step is timed with and
        without snapshot work, and the interval widens when snapshots slow the training by more than
        ``max_stall_fraction``). Returns the save's future, or ``None`` when nothing was saved."""
        d = self.cadence_tracker.step_end(step, self.saves.quiet_since())
        memory = d.memory and self.mem is not None
        if not (memory or d.persist):
            return None
        future = self.save(step, state_fn(), memory=memory, durable=d.persist)
        self.cadence_tracker.saved(d, self.last_blocked_s)
        return future

    def wait(self) -> SaveResult | None:
        """Blocks until the in-flight save (if any) is persisted and committed, its SSD copy too;
        returns its result (of the SSD copy when the newest save was durable)."""
        return self.saves.wait()

    # ---- restore -------------------------------------------------------------------------------

    def load_latest(self, map_location: Any = "cpu", template: dict[str, Any] | None = None,
                    weights_only: bool = True, attempts: int = 8,
                    replicated: bool = False) -> tuple[int, Any] | None:
        """``(step, state_dict)`` of the newest checkpoint this rank can verify, or ``None`` when
        there is no valid checkpoint. ``template`` is required for the ``dcp`` format (loaded in place).
        ``replicated=True`` (data parallel: every rank holds the same state) lets a world of another
        size restore: rank r reads shard ``r % old_world_size``."""
        if template is not None:
            check_template(template)
        return self.restorer.load_latest(map_location, template, weights_only, attempts, replicated)

    def restore(self, state: dict[str, Any], *, weights_only: bool = True, attempts: int = 8,
                replicated: bool = False) -> int | None:
        """Loads the newest checkpoint this rank can verify into ``state`` in place and returns its
        step (``None``: no checkpoint, ``state`` untouched). ``dcp``: DCP's load into the live state,
        a ``Stateful`` value's ``state_dict()`` loaded into and its ``load_state_dict()`` called (an
        ``AppState`` around ``get_state_dict``/``set_state_dict``: sharded state and the optimizer's
        lazily made state included). ``torch``: a Stateful value gets ``load_state_dict(saved)``, a
        tensor is copied into, anything else replaced. The RNG states and the data loader's position
        saved with the step are set back too."""
        if self.format == "dcp":
            check_template(state)
            got = self.restorer.load_latest("cpu", state, weights_only, attempts, replicated)
            return None if got is None else got[0]
        got = self.restorer.load_latest("cpu", None, weights_only, attempts, replicated)
        if got is None:
            return None
        load_into(state, got[1])
        return got[0]

    # ---- progress and hand-overs -------------------------------------------------------------------

    def report_step(self, step: int, loss: float | None = None, grad_norm: float | None = None,
                    flops: float | None = None, fingerprint: int | None = None) -> None:
        """Tells the agent the training made progress (hang detection, dashboards). ``flops``: the
        model FLOPs of this rank's step (about 6 x parameters x tokens for a dense transformer), for
        the MFU gauge. What :attr:`timing` measured since the last report goes with it (the straggler
        detector). ``fingerprint``: :func:`~ftd.training.replica_fingerprint` of this rank's parameters
        (a data-parallel job, every N steps, on every rank at the same steps): the coordinator compares
        the replicas. The answer says whether a planned hand-over is pending (:meth:`should_stop`)."""
        timing = self.timing.take()
        mark = None if fingerprint is None else cluster_pb2.Fingerprint(
            step=step, rank=self.rank, world_size=self.world_size, value=fingerprint & ((1 << 64) - 1))
        if mark is not None and self.agent.round is not None:
            mark.round = self.agent.round
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            answer = self.agent.report(self.rank, step=step, loss=loss, grad_norm=grad_norm, flops=flops,
                                       timing=timing, fingerprint=mark)
            self._handover.update(answer.handover, answer.handover_reason)

    def should_stop(self, step: int) -> bool:
        """Whether the job must stop at ``step`` for a planned hand-over (a preemption notice, a
        drain): then save ``step`` and call :meth:`hand_over`. A collective: call it on every rank at
        the same point of every step, after :meth:`report_step`; every rank gets the same answer."""
        stop = agree_any(self._handover.pending)
        if stop:
            log.warning("rank %d stops at step %d for a planned hand-over (%s)", self.rank, step,
                        self._handover.reason or "reported by another rank")
        return stop

    def hand_over(self, step: int, timeout_s: float = 300.0) -> None:
        """Waits for the final save to be committed, then for the new world: the agent stops this
        process once the hand-over is committed. Raises :class:`HandoverTimeout` when nothing happened
        within ``timeout_s`` (the hand-over was lost; the job goes on from here)."""
        result = self.wait()
        committed = result is not None and result.step == step and result.ok
        if not committed:
            why = "no save" if result is None else f"step {result.step}: {result.error or 'ok'}"
            log.error("final checkpoint of step %d not committed (%s): the hand-over resumes from an older step",
                      step, why)
        else:
            log.warning("final checkpoint of step %d committed; waiting for the new world", step)
        # The coordinator waits for this step (not any newer one) before it commits the new world.
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.report(self.rank, step=step, parked_step=step if committed else -1)
        self._handover.parked.set()
        threading.Event().wait(timeout_s)  # the agent's SIGTERM (the emergency flush's handler) ends this wait
        raise HandoverTimeout(f"no new world within {timeout_s:g}s of the final checkpoint of step {step}")

    def close(self) -> None:
        self.saves.close()
        self._emergency.close()
        self.agent.close()


__all__ = ["Checkpointer", "HandoverTimeout", "RestoreError", "SaveResult", "Snapshotter", "failpoint"]
