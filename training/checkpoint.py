"""Checkpoints from the training side: two-phase save, verified restore, emergency flush.

    from ftd.training import Checkpointer

    ckpt = Checkpointer("my-job")              # rank/world size from torchrun's env, agent from FTD_AGENT_SOCKET
    restored = ckpt.load_latest()              # None on a fresh start, else (step, state_dict)
    ...
    ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})   # blocks for the snapshot only
    ckpt.wait()                                # flush before exit

**Save** is two-phase: :meth:`Checkpointer.save` copies the state into host memory (reused buffers)
and returns; a background thread writes the shard to the node's SSD tier in a staging folder,
checksums every file (CRC32C), publishes it with its manifest written last (fsync + rename), and
commits it to the catalog through the agent. The checkpoint becomes valid when every rank has
committed. A failure (disk full...) is logged, reported to the agent (metric, alert) and kept in
:attr:`Checkpointer.last_error`; training goes on.

**Restore** asks the catalog for the newest valid step, reads this rank's shard from the fastest
tier that holds it (local SSD, then HDD or a shared filesystem, then S3), verifies every file's
CRC32C before unpickling a byte, and on a mismatch records the corrupt copy and tries the next tier;
when no tier has a good copy the step is invalidated (with the reason) and the previous valid step
is tried. With ``torch.distributed`` initialised the ranks agree on one step.

**Memory snapshots and cadence**: with a memory tier on the node (the agent's tmpfs directory),
:meth:`Checkpointer.step_end` asks the job's :class:`~.cadence.CadencePolicy` what to do at each step:
a memory snapshot (written into the memory tier, committed with tier ``mem``; the agent replicates it
to its buddy node) every ``memory_every_steps`` unless the stall forbids, and a durable checkpoint
(the memory copy copied to the SSD by a second thread) every ``persist_every_steps`` or
``persist_every_s``. At most two snapshots per rank are held; one that would exceed the memory
tier's budget is refused with a clear error (reported as ``memory_full``), never an OOM. Restore
tries, fastest first: this node's memory, another node's memory (the buddy's, pulled through the
agent: ``FetchShard``), the SSD, HDD, S3, then any other node's copy. A copy whose node cannot be
reached is skipped, never recorded corrupt; a step is invalidated only when every copy was proven
corrupt.

**Emergency save**: on SIGTERM (and optional extra signals, or a preemption-notice file appearing)
the latest snapshot is persisted before the process exits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import torch

from ftd.agent import memory_tier
from ftd.checkpoints.catalog import MEMORY, TIERS, CheckpointRecord, CopyRef, ShardRecord, from_info
from ftd.checkpoints.layout import (
    MANIFEST,
    FileEntry,
    ShardManifest,
    check_job,
    check_step,
    parse_shard_key,
    shard_prefix,
)
from ftd.storage_backends.base import ObjectNotFound, StorageBackend, StorageError, StorageFull, crc32c_file
from ftd.storage_backends.tiers import Tier, open_tiers, tiers_from_proto
from ftd.v1 import agent_pb2, checkpoint_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused
from .cadence import CadencePolicy, decide
from .handover_stop import HandoverFlag, agree_any
from .snapshot import Snapshotter

log = logging.getLogger("ftd.training.checkpoint")
_FAILPOINT_ENV = "FTD_FAILPOINTS"
_FAILPOINT_ARMED_ENV = "FTD_FAILPOINTS_ARMED"


def failpoint(name: str) -> None:
    """Chaos hook: when ``name`` is listed in ``$FTD_FAILPOINTS`` the process SIGKILLs itself here,
    which is how the crash-consistency tests stop a save at every interesting point. With
    ``$FTD_FAILPOINTS_ARMED`` (a directory) it fires only once it is armed, and only once: in the one
    process that removes the file ``DIR/NAME`` first (the chaos matrix arms it mid-training)."""
    if name not in os.environ.get(_FAILPOINT_ENV, "").split(","):
        return
    armed = os.environ.get(_FAILPOINT_ARMED_ENV)
    if armed:
        try:
            os.unlink(os.path.join(armed, name))  # atomic: exactly one process wins
        except OSError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


class HandoverTimeout(RuntimeError):
    """A rank parked for a planned hand-over, and no new world came."""


class RestoreError(RuntimeError):
    pass


class _Skipped(Exception):
    """A copy that could not be read now (its node unreachable, or it is not there): skipped, not
    recorded corrupt."""


@dataclass
class SaveResult:
    step: int
    ok: bool
    error: str = ""
    blocked_s: float = 0.0  # how long save() held the training loop
    persist_s: float = 0.0  # background: write + checksum + publish + commit
    bytes: int = 0
    valid: bool = False  # the checkpoint was valid (all ranks in) when this rank committed
    tier: str = "ssd"  # "mem": a memory snapshot


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
        self.tiers: list[Tier] = open_tiers(tiers_from_proto(tiers))  # the agent's own specs, fastest first
        self.ssd = next(t for t in self.tiers if t.name != MEMORY)
        self.mem: Tier | None = next((t for t in self.tiers if t.name == MEMORY), None)
        self.cadence = cadence or CadencePolicy()
        self._cadence_text = self.cadence.describe() if cadence is not None else ""
        self.last_error = ""
        self.results: collections.deque[SaveResult] = collections.deque(maxlen=1000)
        self._snap = Snapshotter()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-ckpt-persist")
        self._inflight: Future[SaveResult] | None = None
        self._buffers_free = threading.Event()  # set: no save is reading the snapshot buffers
        self._buffers_free.set()
        # The SSD copy of a memory snapshot (a durable step), and the step it still reads from memory.
        self._durable_pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-ckpt-durable")
        self._durable: Future[SaveResult] | None = None
        self._pinned: set[int] = set()
        # Set: no durable copy is reading a memory snapshot (its commit may still be under way: the
        # next snapshot need not wait for the catalog, only for the bytes to be on the SSD).
        self._unpinned = threading.Event()
        self._unpinned.set()
        # Cadence state (step_end).
        self._last_persist_step = -1
        self._last_persist_s = 0.0
        self._last_step_end: float | None = None
        self._step_s = 0.0
        self.last_blocked_s = 0.0
        self.restored_from = ""  # the copy the last restore loaded ("mem@node-2", "ssd@node-0", ...)
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, Any] = {}
        self._handover = HandoverFlag()
        self._cleanup_leftovers()
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in emergency_signals:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        if preemption_file:
            threading.Thread(target=self._watch_preemption, args=(Path(preemption_file),), daemon=True,
                             name="ftd-ckpt-preemption").start()

    # ---- tiers ---------------------------------------------------------------------------------

    def _cleanup_leftovers(self) -> None:
        """A save interrupted by a crash leaves an unpublished staging folder of this rank; nobody
        else writes this rank's shards on this node, so they can all go now (other local ranks'
        folders are left alone: they may be saving). The same on the memory tier."""

        def mine(key: str) -> bool:
            ident = parse_shard_key(key)
            return ident is not None and ident[2] == self.rank

        for tier in (self.ssd, *([self.mem] if self.mem is not None else [])):
            backend = tier.backend
            try:
                removed = backend.cleanup(f"{self.job}/", older_than_s=0.0, marker_name=MANIFEST, select=mine)
            except (StorageError, OSError) as exc:
                log.warning("could not clean leftovers on %s: %s", backend.name, exc)
                continue
            if removed:
                log.info("removed %d leftovers of interrupted saves of rank %d: %s", len(removed), self.rank, removed)

    # ---- save ----------------------------------------------------------------------------------

    def save(self, step: int, state_dict: dict[str, Any], *, memory: bool = False,
             durable: bool = True) -> Future[SaveResult]:
        """Snapshots ``state_dict`` into host memory and returns; the write happens in the background.
        The previous save, if still writing, is waited for first (its buffers are reused); its commit
        to the catalog may still be running.

        ``durable`` (the default, and all a plain ``save()`` does): the shard is written to the node's
        SSD tier. ``memory``: it is written to the node's memory tier first and committed there (the
        agent replicates it to its buddy); with ``durable`` as well, a second thread then copies that
        memory copy to the SSD, so the next snapshot waits for the memory write only. Without a memory
        tier on the node ``memory`` is ignored. :meth:`step_end` chooses both by the cadence."""
        check_step(step)
        memory = memory and self.mem is not None
        if not (memory or durable):
            raise ValueError("a save goes to memory, to durable storage, or both")
        started = time.perf_counter()
        self._buffers_free.wait()  # the previous save has read its snapshot (its commit may still run)
        self._buffers_free.clear()
        try:
            snap = self._snap.snapshot(state_dict)
        except BaseException:
            self._buffers_free.set()
            raise
        blocked = time.perf_counter() - started
        self.last_blocked_s = blocked
        with self._lock:
            task = functools.partial(self._persist_memory, step, snap, blocked, durable) if memory else \
                functools.partial(self._persist, step, snap, blocked)
            self._inflight = self._pool.submit(self._releasing, task)
            return self._inflight

    def _releasing(self, task: Callable[[], SaveResult]) -> SaveResult:
        try:
            return task()
        finally:
            self._buffers_free.set()

    def step_end(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> Future[SaveResult] | None:
        """Call at the end of every training step: saves what the cadence says (``state_fn`` is called
        only then). Returns the save's future, or ``None`` when nothing was saved at this step."""
        now = time.monotonic()
        if self._last_step_end is not None:  # the step time, smoothed: what the stall is compared with
            took = now - self._last_step_end
            self._step_s = took if self._step_s == 0 else 0.8 * self._step_s + 0.2 * took
        self._last_step_end = now
        d = decide(self.cadence, step, time.time(), self._last_persist_step, self._last_persist_s,
                   stall_s=self.last_blocked_s, step_s=self._step_s)
        memory = d.memory and self.mem is not None
        if not (memory or d.persist):
            return None
        if d.persist:
            self._last_persist_step, self._last_persist_s = step, time.time()
        future = self.save(step, state_fn(), memory=memory, durable=d.persist)
        self._last_step_end = time.monotonic()  # the save's stall is measured apart (last_blocked_s)
        return future

    def wait(self) -> SaveResult | None:
        """Blocks until the in-flight save (if any) is persisted and committed, its SSD copy too;
        returns its result (of the SSD copy when the newest save was durable)."""
        result = self._wait_inflight()
        with self._lock:
            durable = self._durable
        if durable is not None:
            copied = durable.result()
            if result is None or copied.step >= result.step:
                return copied
        return result

    def _wait_inflight(self) -> SaveResult | None:
        with self._lock:
            inflight = self._inflight
        return inflight.result() if inflight is not None else None

    def _persist_memory(self, step: int, snap: Any, blocked: float, durable: bool) -> SaveResult:
        """The memory snapshot: room made (the oldest of this rank's snapshots go), the budget
        checked, the shard written into the memory tier and committed there; then, for a durable
        step, the SSD copy queued (or, if the memory write failed, the SSD written directly)."""
        assert self.mem is not None
        started = time.perf_counter()
        result = SaveResult(step, ok=False, blocked_s=blocked, tier=MEMORY)
        self._event(step, "started", blocked_s=blocked, tier=MEMORY)
        root = self.mem.backend.root  # type: ignore[attr-defined]  # a directory tier
        capacity = getattr(self.mem.spec.storage, "capacity_bytes", 0)
        manifest: ShardManifest | None = None
        deleted: list[int] = []
        try:
            held = [s for s in memory_tier.snapshots(root, self.job, self.rank) if s != step]
            with self._lock:
                copying = bool(self._pinned & set(held[:max(0, len(held) - memory_tier.KEEP + 1)]))
            if copying:
                self._unpinned.wait()  # the oldest snapshot is still being copied to the SSD: it goes after
            estimate = self._snap.buffer_bytes + self._snap.buffer_bytes // 100 + (256 << 10)  # + torch.save's framing
            deleted = memory_tier.admit(self.mem.backend, root, capacity, self.job, self.rank, step, estimate,
                                        f"the memory snapshot of step {step} (rank {self.rank})", set(self._pinned))
            manifest = self._write_shard(step, snap, self.mem)
            self._buffers_free.set()  # written: the next snapshot may take the buffers while this one commits
            response = self.agent.commit_shard(_manifest_proto(manifest), tier=MEMORY, cadence=self._cadence_text)
            result.ok, result.bytes, result.valid = True, manifest.total_bytes, response.checkpoint.valid
        except StorageFull as exc:  # the budget (MemoryFull), or tmpfs itself: refused, training goes on
            result.error = str(exc)
            self._report_failure(step, result.error, "memory_full")
        except (StorageError, OSError, RuntimeError, AgentUnavailable, CatalogRefused) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            self._report_failure(step, result.error, "error")
        if not result.ok:
            for old in deleted:  # the catalog must not keep offering what this node deleted
                self._record_gone(old, self.mem)
        result.persist_s = time.perf_counter() - started
        self._event(step, "done" if result.ok else "failed", persist_s=result.persist_s, bytes=result.bytes,
                    tier=MEMORY)
        self.results.append(result)
        if durable and manifest is not None:  # in memory (committed or not): the SSD copy is made from there
            with self._lock:
                self._pinned.add(step)
                self._unpinned.clear()
                self._durable = self._durable_pool.submit(self._copy_durable, step, manifest, blocked)
        elif durable:  # the buffers were not released: the snapshot is still there
            log.warning("step %d: no memory copy (%s); writing the durable checkpoint directly", step, result.error)
            return self._persist(step, snap, blocked)
        return result

    def _copy_durable(self, step: int, manifest: ShardManifest, blocked: float) -> SaveResult:
        """A durable step: the memory copy's files copied to the SSD tier (every file's CRC32C
        compared with the manifest as it streams), published with the same manifest, committed."""
        assert self.mem is not None
        started = time.perf_counter()
        result = SaveResult(step, ok=False, blocked_s=blocked)
        prefix = shard_prefix(self.job, step, self.rank)
        try:
            backend = self.ssd.backend
            if backend.is_published(prefix, MANIFEST):
                backend.delete_prefix(prefix, marker_name=MANIFEST)
            staging = backend.stage(prefix)
            try:
                with self.mem.backend.local_folder(prefix, [f.name for f in manifest.files]) as folder:
                    for entry in manifest.files:
                        info = staging.put_file(entry.name, folder / entry.name)
                        if (info.size, info.crc32c) != (entry.size, entry.crc32c):
                            raise StorageError(backend.name, prefix, f"{entry.name}: the memory copy changed while "
                                                                     f"copied ({info.crc32c}, not {entry.crc32c})")
                staging.publish(MANIFEST, manifest.encode())
            except BaseException:
                with contextlib.suppress(StorageError, OSError):
                    staging.abort()
                raise
            self._unpin(step)  # on the SSD: the memory snapshot may go while the commit is under way
            response = self.agent.commit_shard(_manifest_proto(manifest), tier="ssd", cadence=self._cadence_text)
            result.ok, result.bytes, result.valid = True, manifest.total_bytes, response.checkpoint.valid
        except StorageFull as exc:
            result.error = str(exc)
            self._report_failure(step, result.error, "disk_full")
        except (StorageError, OSError, RuntimeError, AgentUnavailable, CatalogRefused) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            self._report_failure(step, result.error, "error")
        finally:
            self._unpin(step)
        result.persist_s = time.perf_counter() - started
        self._event(step, "done" if result.ok else "failed", persist_s=result.persist_s, bytes=result.bytes)
        self.results.append(result)
        return result

    def _unpin(self, step: int) -> None:
        with self._lock:
            self._pinned.discard(step)
            if not self._pinned:
                self._unpinned.set()

    def _record_gone(self, step: int, tier: Tier, rank: int | None = None) -> None:
        """This node no longer holds its copy of ``step`` on ``tier`` (this rank's, or ``rank``'s)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.record_copy(checkpoint_pb2.RecordCopyRequest(
                job=self.job, step=step, rank=self.rank if rank is None else rank, tier=tier.name,
                location=tier.location, present=False))

    def _persist(self, step: int, snap: Any, blocked: float) -> SaveResult:
        started = time.perf_counter()
        result = SaveResult(step, ok=False, blocked_s=blocked)
        self._event(step, "started", blocked_s=blocked)
        try:
            manifest = self._write_shard(step, snap)
            self._buffers_free.set()  # written: the next snapshot may take the buffers while this one commits
            failpoint("ckpt.before_commit")
            response = self.agent.commit_shard(_manifest_proto(manifest), cadence=self._cadence_text)
            result.ok, result.bytes, result.valid = True, manifest.total_bytes, response.checkpoint.valid
        except StorageFull as exc:
            result.error = str(exc)
            self._report_failure(step, result.error, "disk_full")
        except (StorageError, OSError, RuntimeError, AgentUnavailable, CatalogRefused) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            self._report_failure(step, result.error, "error")
        result.persist_s = time.perf_counter() - started
        self._event(step, "done" if result.ok else "failed", persist_s=result.persist_s, bytes=result.bytes)
        self.results.append(result)
        return result

    def _event(self, step: int, phase: str, **figures: Any) -> None:
        """Tells the agent (metrics: save stall, persist duration, bytes, saves in flight)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.report(self.rank, checkpoint=agent_pb2.CheckpointEvent(step=step, phase=phase, **figures))

    def _report_failure(self, step: int, error: str, kind: str) -> None:
        self.last_error = f"save of step {step} (rank {self.rank}) failed: {error}"
        log.error("%s; training continues, earlier valid checkpoints are untouched", self.last_error)
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.report(self.rank, error=self.last_error, error_kind=kind)

    def _write_shard(self, step: int, snap: Any, tier: Tier | None = None) -> ShardManifest:
        backend = (tier or self.ssd).backend
        prefix = shard_prefix(self.job, step, self.rank)
        if backend.is_published(prefix, MANIFEST):
            # A published folder for this step: another timeline's (after a rollback) or a crash
            # between publish and commit. Never reused as is; replaced.
            log.info("replacing an existing unpublished-in-catalog shard folder %s", prefix)
            backend.delete_prefix(prefix, marker_name=MANIFEST)
        staging = backend.stage(prefix)
        try:
            directory = staging.local_dir()  # torch writes here; publish makes it durable, whatever the tier
            failpoint("ckpt.before_write")
            try:
                if self.format == "torch":
                    torch.save(snap, directory / "state.pt")
                else:
                    from torch.distributed.checkpoint import state_dict_saver

                    state_dict_saver.save(snap, checkpoint_id=str(directory), no_dist=True)
            except (OSError, RuntimeError) as exc:
                raise _storage_error(backend, prefix, directory, exc) from exc
            failpoint("ckpt.after_write")
            files = tuple(FileEntry(o.key, o.size, _crc(backend, prefix, o.key, o.crc32c)) for o in staging.objects())
            manifest = ShardManifest(self.job, step, self.epoch, self.rank, self.world_size, self.format, files)
            failpoint("ckpt.before_publish")
            staging.publish(MANIFEST, manifest.encode())
            failpoint("ckpt.after_publish")
            return manifest
        except BaseException:
            with contextlib.suppress(StorageError, OSError):
                staging.abort()
            raise

    # ---- restore -------------------------------------------------------------------------------

    def load_latest(self, map_location: Any = "cpu", template: dict[str, Any] | None = None,
                    weights_only: bool = True, attempts: int = 8,
                    replicated: bool = False) -> tuple[int, Any] | None:
        """``(step, state_dict)`` of the newest checkpoint this rank can verify, or ``None`` when
        there is no valid checkpoint. ``template`` is required for the ``dcp`` format (loaded in place).
        ``replicated=True`` (data parallel: every rank holds the same state) lets a world of another
        size restore: rank r reads shard ``r % old_world_size``."""
        for attempt in range(attempts):
            target = self.agent.restore_target(self.job, replicated=replicated)
            loaded: tuple[int, Any] | None = None
            if target.found:
                loaded = self._load_step(target.checkpoint, map_location, template, weights_only, replicated)
                if loaded is None:  # a copy's node unreachable for now, or the step just invalidated
                    time.sleep(min(5.0, 0.5 * (attempt + 1)))
            agreed = _agree(loaded[0] if loaded else (-1 if not target.found else -2))
            if agreed is None:  # ranks disagree: someone invalidated a step; everyone asks again
                continue
            if agreed == -1:
                return None
            if loaded is not None and loaded[0] == agreed:
                log.info("restored step %d (rank %d): %s", agreed, self.rank, target.reason)
                return loaded
        raise RestoreError(f"job {self.job} rank {self.rank}: no checkpoint could be restored after {attempts} tries")

    def _load_step(self, info: checkpoint_pb2.CheckpointInfo, map_location: Any, template: dict[str, Any] | None,
                   weights_only: bool, replicated: bool = False) -> tuple[int, Any] | None:
        record = from_info(info)
        want = self.rank % record.world_size if replicated and record.world_size != self.world_size else self.rank
        shard = record.shards.get(want)
        if shard is None:
            raise RestoreError(f"step {record.step} of job {self.job} has no shard for rank {self.rank} "
                               f"(world size {record.world_size}); was it saved with another world size?")
        problems: list[str] = []
        skipped: list[str] = []  # unreachable or not there: no proof of corruption
        # Replicated state (data parallel): when this rank's own copies cannot be read, any other
        # rank's copy of the step is the same state (its own copies first, then the others in order).
        shards = [shard, *(s for r, s in sorted(record.shards.items()) if r != want)] if replicated else [shard]
        for source, (copy, tier) in ((s, c) for s in shards for c in self._candidates(s)):
            try:
                state = (self._read(tier, record, source, map_location, template, weights_only) if tier is not None
                         else self._read_remote(copy, record, source, map_location, template, weights_only))
                self.restored_from = (f"{copy}" + ("" if tier is not None else " (pulled through the agent)")
                                      + ("" if source.rank == want else f" (rank {source.rank}'s copy: replicated)"))
                return record.step, state
            except _Skipped as exc:
                skipped.append(f"{copy}: {exc}")
                log.warning("rank %d step %d: copy on %s skipped (%s), trying the next one", self.rank, record.step,
                            copy, exc)
            except (StorageError, OSError, RuntimeError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                if copy.tier == MEMORY and tier is not None and isinstance(exc, (FileNotFoundError, ObjectNotFound)):
                    skipped.append(f"{copy}: gone ({why})")  # a newer snapshot replaced it: not corrupt
                    self._record_gone(record.step, tier, source.rank)
                    continue
                problems.append(f"{copy}: {why}")
                log.warning("rank %d step %d: copy on %s unusable, trying the next one: %s", self.rank, record.step,
                            copy, why)
                with contextlib.suppress(AgentUnavailable, CatalogRefused):  # a peer's copy: recorded by its node
                    self.agent.record_copy(checkpoint_pb2.RecordCopyRequest(
                        job=self.job, step=record.step, rank=source.rank, tier=copy.tier, location=copy.location,
                        present=True, corrupt_reason=why[:400]))
        if skipped:
            log.error("step %d of job %s: rank %d could read no copy now (%s); not invalidated: an unreachable copy is "
                      "no corrupt one", record.step, self.job, self.rank, "; ".join([*problems, *skipped])[:2000])
            return None
        reason = f"rank {self.rank}: no tier holds a verified copy ({'; '.join(problems) or 'no copy recorded'})"
        log.error("step %d of job %s is unrecoverable: %s", record.step, self.job, reason)
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.invalidate(self.job, record.step, reason[:500])
        return None

    def _candidates(self, shard: ShardRecord) -> list[tuple[CopyRef, Tier | None]]:
        """The copies not known to be corrupt, each with this node's tier that reads it (``None``: on
        another node, pulled through the agent), in the restore order: this node's memory, another
        node's memory (the buddy's), then this node's SSD, HDD (its own or shared), S3, and last the
        other nodes' disks."""
        mine = {(t.name, t.location): t for t in self.tiers}
        order = {name: i for i, name in enumerate(TIERS)}

        def rank(item: tuple[CopyRef, Tier | None]) -> tuple[int, int, str]:
            copy, tier = item
            speed = order.get(copy.tier, len(order))
            if copy.tier == MEMORY:
                return (0 if tier is not None else 1), speed, copy.location
            return (2 if tier is not None else 3), speed, copy.location

        return sorted(((c, mine.get((c.tier, c.location))) for c in shard.good_copies()), key=rank)

    def _read_remote(self, copy: CopyRef, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
                     template: dict[str, Any] | None, weights_only: bool) -> Any:
        """A copy on another node: the agent pulls it (``FetchShard``: its agent streams it, every
        file's CRC32C checked as it lands) into a local directory, then it is verified against the
        catalog and loaded like a local one."""
        request = agent_pb2.FetchShardRequest(
            job=self.job, step=record.step, rank=shard.rank, tier=copy.tier, location=copy.location,
            expected=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in shard.files])
        try:
            got = self.agent.fetch_shard(request)
        except AgentUnavailable as exc:
            raise _Skipped(f"unreachable: {exc}") from exc
        except CatalogRefused as exc:
            if exc.code == grpc.StatusCode.DATA_LOSS:
                raise ValueError(f"arrived corrupt: {exc}") from exc
            raise _Skipped(f"not readable there ({exc})") from exc
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        if got.verified:  # checked against these very checksums as the bytes landed: not read twice
            return self._load_checked(Path(got.path), expected, map_location, template, weights_only)
        return self._verify_and_load(Path(got.path), expected, map_location, template, weights_only)

    def _load_checked(self, directory: Path, expected: dict[str, tuple[int, str]], map_location: Any,
                      template: dict[str, Any] | None, weights_only: bool) -> Any:
        """Loads a pulled copy whose every file this node's agent checked against the catalog's
        CRC32C as it arrived (``FetchShardResponse.verified``) and renamed into place only then;
        the sizes are checked again here."""
        for name, (size, _) in expected.items():
            actual_size = (directory / name).stat().st_size
            if actual_size != size:
                raise ValueError(f"{directory / name}: {actual_size} bytes, the catalog says {size}")
        if self.format == "torch" or "state.pt" in expected:
            return torch.load(directory / "state.pt", map_location=map_location, mmap=True, weights_only=weights_only)
        if template is None:
            raise ValueError("a dcp checkpoint is loaded in place: pass template=model/optimizer state dict")
        return _load_dcp(directory, expected, template, weights_only)

    def _read(self, tier: Tier, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
              template: dict[str, Any] | None, weights_only: bool) -> Any:
        """Loads one shard copy from ``tier`` after verifying every file against the catalog; the
        tier hands out local files (in place on a directory tier, downloaded from an object store)."""
        prefix = shard_prefix(self.job, record.step, shard.rank)
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        with tier.backend.local_folder(prefix, expected) as directory:
            return self._verify_and_load(directory, expected, map_location, template, weights_only)

    def _verify_and_load(self, directory: Path, expected: dict[str, tuple[int, str]], map_location: Any,
                         template: dict[str, Any] | None, weights_only: bool) -> Any:
        for name, (size, crc) in expected.items():
            path = directory / name
            actual_size = path.stat().st_size
            if actual_size != size:
                raise ValueError(f"{path}: {actual_size} bytes, the catalog says {size}")
            actual = crc32c_file(path)
            if actual != crc:
                raise ValueError(f"{path}: crc32c {actual}, the catalog says {crc}")
        if self.format == "torch" or "state.pt" in expected:
            return torch.load(directory / "state.pt", map_location=map_location, mmap=True, weights_only=weights_only)
        if template is None:
            raise ValueError("a dcp checkpoint is loaded in place: pass template=model/optimizer state dict")
        return _load_dcp(directory, expected, template, weights_only)

    # ---- progress and emergencies ------------------------------------------------------------------

    def report_step(self, step: int, loss: float | None = None, grad_norm: float | None = None,
                    flops: float | None = None) -> None:
        """Tells the agent the training made progress (hang detection, dashboards). ``flops``: the
        model FLOPs of this rank's step (about 6 x parameters x tokens for a dense transformer), for
        the MFU gauge. The answer says whether a planned hand-over is pending (:meth:`should_stop`)."""
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            answer = self.agent.report(self.rank, step=step, loss=loss, grad_norm=grad_norm, flops=flops)
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
        if result is None or result.step != step or not result.ok:
            why = "no save" if result is None else f"step {result.step}: {result.error or 'ok'}"
            log.error("final checkpoint of step %d not committed (%s): the hand-over resumes from an older step",
                      step, why)
        else:
            log.warning("final checkpoint of step %d committed; waiting for the new world", step)
        self._handover.parked.set()
        threading.Event().wait(timeout_s)  # the agent's SIGTERM (handled by _on_signal) ends this wait
        raise HandoverTimeout(f"no new world within {timeout_s:g}s of the final checkpoint of step {step}")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: flushing the latest snapshot before exiting", signum)
        try:
            result = self.wait()
            if result is not None:
                log.warning("emergency flush: step %d %s", result.step, "persisted" if result.ok else result.error)
        finally:
            previous = self._previous_handlers.get(signum)
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    def _watch_preemption(self, path: Path) -> None:
        while not path.exists():
            time.sleep(1.0)
        log.warning("preemption notice %s: flushing the latest snapshot", path)
        self.wait()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        self._durable_pool.shutdown(wait=True)
        for sig, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, handler)
        self.agent.close()


# ---- dcp restore: nothing is unpickled before it is verified --------------------------------------------
#
# A dcp shard is a folder: ``.metadata`` (a pickle of torch.distributed.checkpoint's Metadata, which
# DCP's own FileSystemReader loads with plain ``pickle.load``, i.e. it can run any code) and data
# files (tensors as raw bytes; other objects as torch.save blobs that DCP loads with
# ``weights_only=True``). Before anything is read, every file the catalog lists was checked against
# its size and CRC32C (``_verify_and_load``); then:
#
# * ``.metadata`` must be one of those verified files (a manifest without it is refused);
# * ``weights_only=True`` (the default): ``.metadata`` is unpickled by a restricted unpickler that
#   builds only DCP's metadata classes, torch sizes, dtypes and layouts, and paths (anything else is
#   refused, naming it), so a crafted ``.metadata`` cannot run code even if its checksum was
#   recorded by a lying node; ``weights_only=False``: DCP's stock reader (plain pickle) reads it,
#   trusting whoever committed the shard, like ``torch.load(weights_only=False)``;
# * every data file the metadata points at must be one of the verified files (no reading outside the
#   shard, nothing unverified).

_DCP_METADATA = ".metadata"
_DCP_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"), ("collections", "OrderedDict"),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def _safe_dcp_metadata(path: Path) -> Any:
    """``.metadata`` unpickled with only DCP's metadata types allowed (see above)."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module == _DCP_METADATA_MODULE and not name.startswith("__"):
                found = super().find_class(module, name)
                if isinstance(found, type) and found.__module__ == module:  # its own classes, not imports
                    return found
            elif (module, name) in _DCP_ALLOWED:
                return super().find_class(module, name)
            elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"{path}: refusing to unpickle {module}.{name} (not a dcp metadata type; "
                                         "load with weights_only=False only if you trust whoever saved it)")

    with open(path, "rb") as f:
        try:
            return Restricted(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError, KeyError) as exc:
            raise ValueError(f"{path}: not a dcp metadata file this loader accepts: {exc}") from exc


def _load_dcp(directory: Path, expected: dict[str, tuple[int, str]], template: dict[str, Any],
              weights_only: bool) -> dict[str, Any]:
    """Loads a verified dcp shard into ``template`` in place (see above)."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    if _DCP_METADATA not in expected:
        raise ValueError(f"{directory}: the shard's manifest does not list {_DCP_METADATA}; refusing to unpickle "
                         "a file whose checksum nobody recorded")
    metadata = _safe_dcp_metadata(directory / _DCP_METADATA) if weights_only else None

    class Verified(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            loaded = metadata if metadata is not None else super().read_metadata(*args, **kwargs)
            if not isinstance(loaded, Metadata):
                raise ValueError(f"{directory}/{_DCP_METADATA} holds a {type(loaded).__name__}, not dcp Metadata")
            for info in (loaded.storage_data or {}).values():
                name = str(getattr(info, "relative_path", ""))
                if name not in expected or name == _DCP_METADATA:
                    raise ValueError(f"{directory}/{_DCP_METADATA} points at {name[:200]!r}, which is not a verified "
                                     "file of this shard")
            return loaded

    try:
        state_dict_loader.load(template, storage_reader=Verified(str(directory)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: the tier loop would not see it
        causes = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()) or str(exc)
        raise ValueError(f"{directory}: dcp load failed: {causes}") from exc
    return template


def _manifest_proto(m: ShardManifest) -> checkpoint_pb2.ShardManifest:
    return checkpoint_pb2.ShardManifest(
        job=m.job, step=m.step, epoch=m.epoch, rank=m.rank, world_size=m.world_size, format=m.format,
        files=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in m.files],
        created_unix_s=m.created_unix_s)


def _crc(backend: StorageBackend, prefix: str, name: str, crc32c: str | None) -> str:
    """A staged file's CRC32C, which :meth:`Staging.objects` always knows."""
    if crc32c is None:
        raise StorageError(backend.name, f"{prefix}/{name}", "the staging reported no CRC32C")
    return crc32c


def _storage_error(backend: StorageBackend, prefix: str, directory: Path, exc: BaseException) -> StorageError:
    """torch's writer reports ENOSPC as a RuntimeError; tell a full disk apart by looking at it."""
    import errno
    import shutil

    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full:
        with contextlib.suppress(OSError):
            full = shutil.disk_usage(directory).free < 1 << 20
    if full:
        return StorageFull(backend.name, prefix, f"no space left on the hot tier writing {directory}: {exc}")
    return StorageError(backend.name, prefix, f"writing {directory} failed: {exc}")


def _agree(step: int) -> int | None:
    """With torch.distributed initialised, every rank must load the same step: returns it when all
    agree, ``None`` when they do not (they try again). Without it, the rank's own answer."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return step
    t = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    low, high = int(t[0]), -int(t[1])
    return low if low == high else None

