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

**Emergency save**: on SIGTERM (and optional extra signals, or a preemption-notice file appearing)
the latest snapshot is persisted before the process exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from ftd.checkpoints.catalog import CheckpointRecord, CopyRef, ShardRecord, from_info
from ftd.checkpoints.layout import (
    MANIFEST,
    FileEntry,
    ShardManifest,
    check_job,
    check_step,
    parse_shard_key,
    shard_prefix,
)
from ftd.storage_backends.base import StorageBackend, StorageError, StorageFull, crc32c_file
from ftd.storage_backends.tiers import Tier, open_tiers, tiers_from_proto
from ftd.v1 import agent_pb2, checkpoint_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused
from .handover import HandoverFlag, agree_any
from .snapshot import Snapshotter

log = logging.getLogger("ftd.training.checkpoint")
_FAILPOINT_ENV = "FTD_FAILPOINTS"


def failpoint(name: str) -> None:
    """Chaos hook: when ``name`` is listed in ``$FTD_FAILPOINTS`` the process SIGKILLs itself here,
    which is how the crash-consistency tests stop a save at every interesting point."""
    if name in os.environ.get(_FAILPOINT_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)


class HandoverTimeout(RuntimeError):
    """A rank parked for a planned hand-over, and no new world came."""


class RestoreError(RuntimeError):
    pass


@dataclass
class SaveResult:
    step: int
    ok: bool
    error: str = ""
    blocked_s: float = 0.0  # how long save() held the training loop
    persist_s: float = 0.0  # background: write + checksum + publish + commit
    bytes: int = 0
    valid: bool = False  # the checkpoint was valid (all ranks in) when this rank committed


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
        self.ssd = self.tiers[0]
        self.last_error = ""
        self.results: list[SaveResult] = []
        self._snap = Snapshotter()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-ckpt-persist")
        self._inflight: Future[SaveResult] | None = None
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
        folders are left alone: they may be saving)."""
        backend = self.ssd.backend

        def mine(key: str) -> bool:
            ident = parse_shard_key(key)
            return ident is not None and ident[2] == self.rank

        try:
            removed = backend.cleanup(f"{self.job}/", older_than_s=0.0, marker_name=MANIFEST, select=mine)
        except (StorageError, OSError) as exc:
            log.warning("could not clean leftovers on %s: %s", backend.name, exc)
            return
        if removed:
            log.info("removed %d leftovers of interrupted saves of rank %d: %s", len(removed), self.rank, removed)

    # ---- save ----------------------------------------------------------------------------------

    def save(self, step: int, state_dict: dict[str, Any]) -> Future[SaveResult]:
        """Snapshots ``state_dict`` into host memory and returns; the write happens in the background.
        The previous save, if still in flight, is waited for first (its buffers are reused)."""
        check_step(step)
        started = time.perf_counter()
        self._wait_inflight()
        snap = self._snap.snapshot(state_dict)
        blocked = time.perf_counter() - started
        with self._lock:
            self._inflight = self._pool.submit(self._persist, step, snap, blocked)
            return self._inflight

    def wait(self) -> SaveResult | None:
        """Blocks until the in-flight save (if any) is persisted and committed; returns its result."""
        return self._wait_inflight()

    def _wait_inflight(self) -> SaveResult | None:
        with self._lock:
            inflight = self._inflight
        return inflight.result() if inflight is not None else None

    def _persist(self, step: int, snap: Any, blocked: float) -> SaveResult:
        started = time.perf_counter()
        result = SaveResult(step, ok=False, blocked_s=blocked)
        self._event(step, "started", blocked_s=blocked)
        try:
            manifest = self._write_shard(step, snap)
            failpoint("ckpt.before_commit")
            response = self.agent.commit_shard(_manifest_proto(manifest))
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

    def _write_shard(self, step: int, snap: Any) -> ShardManifest:
        backend = self.ssd.backend
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
        for _ in range(attempts):
            target = self.agent.restore_target(self.job)
            loaded: tuple[int, Any] | None = None
            if target.found:
                loaded = self._load_step(target.checkpoint, map_location, template, weights_only, replicated)
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
        problems = []
        for tier in self._candidates(shard):
            try:
                return record.step, self._read(tier, record, shard, map_location, template, weights_only)
            except (StorageError, OSError, RuntimeError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                problems.append(f"{CopyRef(tier.name, tier.location)}: {why}")
                log.warning("rank %d step %d: copy on %s unusable, trying the next tier: %s", self.rank, record.step,
                            tier.name, why)
                with contextlib.suppress(AgentUnavailable, CatalogRefused):
                    self.agent.record_copy(checkpoint_pb2.RecordCopyRequest(
                        job=self.job, step=record.step, rank=shard.rank, tier=tier.name, location=tier.location,
                        present=True, corrupt_reason=why[:400]))
        reason = f"rank {self.rank}: no tier holds a verified copy ({'; '.join(problems) or 'no copy recorded'})"
        log.error("step %d of job %s is unrecoverable: %s", record.step, self.job, reason)
        with contextlib.suppress(AgentUnavailable, CatalogRefused):
            self.agent.invalidate(self.job, record.step, reason[:500])
        return None

    def _candidates(self, shard: ShardRecord) -> list[Tier]:
        """Tiers that hold a copy not known to be corrupt, fastest first."""
        return [tier for tier in self.tiers if shard.has_good_copy(CopyRef(tier.name, tier.location))]

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
        from torch.distributed.checkpoint import state_dict_loader

        state_dict_loader.load(template, checkpoint_id=str(directory), no_dist=True)
        return template

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
        for sig, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, handler)
        self.agent.close()


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

