"""The save loop of the training side: two-phase save, into the SSD or the memory tier.

:meth:`SaveLoop.save` copies the state into host memory (reused buffers, :mod:`.snapshot`) and
returns; a background thread writes the shard in a staging folder of the tier, checksums every file
(CRC32C), publishes it with its manifest written last (fsync + rename on the SSD) and commits it to
the catalog through the agent. The checkpoint becomes valid when every rank has committed.

A memory snapshot is written into the memory tier (room made by its keep rule, its budget checked
first: :class:`~ftd.storage_backends.memory.MemoryTier`) and committed there; the agent replicates
it to its buddy. For a durable step, a second thread then asks the agent to copy it to the SSD and
commit it there (``CommitShard`` with ``from_tier``: the agent's first tiering hop,
``ftd.agent.tiering.Tiering.persist``), so the next snapshot waits for the memory write only; the
step stays pinned in memory until its bytes are on the SSD.

Every phase ends through one error ladder (:class:`_Outcome`): a full tier is reported as
``memory_full`` or ``disk_full``, anything else as ``error``; the failure is logged, reported to the
agent (metric, alert) and kept in :attr:`SaveLoop.last_error`, and the training goes on.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import torch

from ftd.checkpoints.catalog import MEMORY
from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, check_step, parse_shard_key, shard_prefix
from ftd.storage_backends.base import StorageBackend, StorageError, StorageFull
from ftd.storage_backends.memory import evictions
from ftd.storage_backends.tiers import Tier
from ftd.v1 import agent_pb2, checkpoint_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused
from .checkpoint_signing import ShardSigner
from .dcp_io import save_dcp
from .rank_state import RankState
from .rank_state import write as write_rank_state
from .snapshot import Snapshotter, owning_storages

log = logging.getLogger("ftd.training.checkpoint")
_FAILPOINT_ENV = "FTD_FAILPOINTS"
_FAILPOINT_ARMED_ENV = "FTD_FAILPOINTS_ARMED"
HOP_FLOOR_BYTES_S = 100e6  # the durable hop's deadline allows at least this speed (and two minutes on top)


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


@dataclass(frozen=True)
class _Snapshot:
    """What one save writes: the state as snapshotted, and this rank's RNG states and data loader
    position captured with it (:mod:`.rank_state`; ``None`` when the job keeps neither)."""

    state: Any
    extra: dict[str, Any] | None


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


class SaveLoop:
    """The saves of one rank (see the module docstring); ``mem`` is ``None`` on a node without a
    memory tier (a memory snapshot is then never asked for)."""

    def __init__(self, job: str, rank: int, world_size: int, epoch: int, fmt: str, agent: AgentLink, ssd: Tier,
                 mem: Tier | None, cadence_text: str = "", extra: RankState | None = None,
                 snapshotter: Snapshotter | None = None, signer: ShardSigner | None = None) -> None:
        self.job, self.rank, self.world_size, self.epoch, self.format = job, rank, world_size, epoch, fmt
        self.signer = signer  # signs every shard with the node's key (None: a node without mTLS)
        self.agent = agent
        self.ssd = ssd
        self.mem = mem
        self.store = mem.memory if mem is not None else None
        if mem is not None and self.store is None:
            raise ValueError(f"the tier {mem.name} ({mem.backend.name}) is no memory tier")
        self.cadence_text = cadence_text
        self.last_error = ""
        self.last_blocked_s = 0.0
        self.results: collections.deque[SaveResult] = collections.deque(maxlen=1000)
        self._snap = snapshotter if snapshotter is not None else Snapshotter()
        self.extra = extra if extra is not None else RankState(rng=False)  # captured with every snapshot
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-ckpt-persist")
        self._inflight: Future[SaveResult] | None = None
        self._buffers_free = threading.Event()  # set: no save is reading the snapshot buffers
        self._buffers_free.set()
        self._holder = 0  # which save (a count) took the buffers last
        # The SSD copy of a memory snapshot (a durable step), and the steps it still reads from memory.
        self._durable_pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-ckpt-durable")
        self._durable: Future[SaveResult] | None = None
        self._pinned: set[int] = set()
        self._unpinned = threading.Event()  # set: no durable copy is reading a memory snapshot
        self._unpinned.set()
        self._lock = threading.Lock()
        self._quiet_at = time.monotonic()  # when the latest save's work (its write, commit, SSD copy) ended

    # ---- the training loop's side ----------------------------------------------------------------

    def save(self, step: int, state_dict: dict[str, Any], *, memory: bool = False,
             durable: bool = True) -> Future[SaveResult]:
        """:meth:`ftd.training.Checkpointer.save`: the snapshot now, the rest in the background."""
        check_step(step)
        memory = memory and self.mem is not None
        if not (memory or durable):
            raise ValueError("a save goes to memory, to durable storage, or both")
        started = time.perf_counter()
        self._buffers_free.wait()  # the previous save has read its snapshot (its commit may still run)
        self._buffers_free.clear()
        with self._lock:
            self._holder += 1  # this save holds the buffers until its shard is written
            holder = self._holder
        try:
            snap = _Snapshot(self._snap.snapshot(state_dict), self.extra.capture() if self.extra.enabled else None)
        except BaseException:
            self._buffers_free.set()
            raise
        blocked = time.perf_counter() - started
        self.last_blocked_s = blocked
        with self._lock:
            task = functools.partial(self._persist_memory, step, snap, blocked, durable) if memory else \
                functools.partial(self._persist, step, snap, blocked)
            self._inflight = self._pool.submit(self._releasing, task, holder)
            return self._inflight

    @property
    def snapshot_alloc_s(self) -> float:
        """How long the latest snapshot spent allocating its buffers."""
        return self._snap.last_alloc_s

    def prepare(self, state_dict: Any) -> int:
        """The snapshot buffers laid out and allocated for ``state_dict`` now (:meth:`Snapshotter.prepare`),
        so that no save stalls allocating them; returns their bytes."""
        self._buffers_free.wait()
        return self._snap.prepare(state_dict)

    def quiet_since(self) -> float | None:
        """Since when (``time.monotonic()``) no save has had work in flight here — its write,
        checksum, commit, SSD copy — or ``None`` while one has: the cadence times the steps that ran
        without snapshot work (:mod:`.cadence`)."""
        with self._lock:
            if any(f is not None and not f.done() for f in (self._inflight, self._durable)):
                return None
            return self._quiet_at

    def wait(self) -> SaveResult | None:
        """Blocks until the in-flight save (if any) is persisted and committed, its SSD copy too;
        returns its result (of the SSD copy when the newest save was durable)."""
        with self._lock:
            inflight = self._inflight
        result = inflight.result() if inflight is not None else None
        with self._lock:
            durable = self._durable
        if durable is not None:
            copied = durable.result()
            if result is None or copied.step >= result.step:
                return copied
        return result

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        self._durable_pool.shutdown(wait=True)

    def cleanup_leftovers(self) -> None:
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

    # ---- the background threads ------------------------------------------------------------------

    def _releasing(self, task: Callable[[], SaveResult], holder: int) -> SaveResult:
        """Runs a save's background part; at its end the buffers are free again, unless a newer save
        holds them already (this one released them once its shard was written, and the training
        loop's next snapshot is in them now: setting the flag then would let the snapshot after that
        overwrite them while the newer save is still writing them out — a torn shard)."""
        try:
            return task()
        finally:
            with self._lock:
                if holder == self._holder:
                    self._buffers_free.set()
            self._quiet_at = time.monotonic()

    def _persist(self, step: int, snap: _Snapshot, blocked: float) -> SaveResult:
        """A durable save: the shard written to the SSD and committed there."""
        result, started = self._start(step, blocked, self.ssd.name)
        with self._outcome(result, "disk_full"):
            manifest = self._write_shard(step, snap, self.ssd)
            self._buffers_free.set()  # written: the next snapshot may take the buffers while this one commits
            failpoint("ckpt.before_commit")
            self._commit(result, manifest, self.ssd.name)
        return self._finish(result, started)

    def _persist_memory(self, step: int, snap: _Snapshot, blocked: float, durable: bool) -> SaveResult:
        """The memory snapshot: room made (the oldest of this rank's snapshots go), the budget
        checked, the shard written into the memory tier and committed there; then, for a durable
        step, the SSD copy queued (or, if the memory write failed, the SSD written directly)."""
        assert self.mem is not None and self.store is not None
        result, started = self._start(step, blocked, MEMORY)
        manifest: ShardManifest | None = None
        deleted: list[int] = []
        with self._outcome(result, "memory_full"):  # the budget (MemoryFull), or tmpfs itself: refused
            going = evictions(self.store.snapshots(self.job, self.rank), step)
            with self._lock:
                copying = bool(self._pinned & set(going))
            if copying:
                self._unpinned.wait()  # the oldest snapshot is still being copied to the SSD: it goes after
            estimate = self._snap.buffer_bytes + self._snap.buffer_bytes // 100 + (256 << 10)  # + torch.save's framing
            deleted = self.store.admit(self.job, self.rank, step, estimate,
                                       f"the memory snapshot of step {step} (rank {self.rank})", set(self._pinned))
            manifest = self._write_shard(step, snap, self.mem)
            self._buffers_free.set()  # written: the next snapshot may take the buffers while this one commits
            self._commit(result, manifest, MEMORY)
        if not result.ok:
            for old in deleted:  # the catalog must not keep offering what this node deleted
                self.agent.record_gone(self.job, old, self.rank, self.mem.name, self.mem.location)
        self._finish(result, started)
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
        """A durable step held in memory: the agent copies it to the SSD (every file's CRC32C
        compared with the manifest as it streams), publishes it with the same manifest and commits
        it; the memory snapshot stays pinned until then."""
        assert self.mem is not None
        result, started = self._start(step, blocked, self.ssd.name, announce=False)
        with self._outcome(result, "disk_full", hop=True):
            try:
                self._commit(result, manifest, self.ssd.name, from_tier=self.mem.name,
                             timeout_s=120.0 + manifest.total_bytes / HOP_FLOOR_BYTES_S)
            finally:
                self._unpin(step)
                self._quiet_at = time.monotonic()
        return self._finish(result, started)

    def _unpin(self, step: int) -> None:
        with self._lock:
            self._pinned.discard(step)
            if not self._pinned:
                self._unpinned.set()

    # ---- the parts every save shares -------------------------------------------------------------

    def _start(self, step: int, blocked: float, tier: str, announce: bool = True) -> tuple[SaveResult, float]:
        if announce:
            self._event(step, "started", blocked_s=blocked, **({"tier": tier} if tier == MEMORY else {}))
        return SaveResult(step, ok=False, blocked_s=blocked, tier=tier if tier == MEMORY else "ssd"), \
            time.perf_counter()

    def _outcome(self, result: SaveResult, full: str, hop: bool = False) -> _Outcome:
        """The one error ladder around a phase of a save (see :class:`_Outcome`)."""
        return _Outcome(self, result, full, hop)

    def _commit(self, result: SaveResult, manifest: ShardManifest, tier: str, from_tier: str = "",
                timeout_s: float | None = None) -> None:
        response = self.agent.commit_shard(_manifest_proto(manifest), tier=tier if tier == MEMORY else "",
                                           cadence=self.cadence_text, from_tier=from_tier, timeout_s=timeout_s)
        result.ok, result.bytes, result.valid = True, manifest.total_bytes, response.checkpoint.valid

    def _finish(self, result: SaveResult, started: float) -> SaveResult:
        result.persist_s = time.perf_counter() - started
        self._event(result.step, "done" if result.ok else "failed", persist_s=result.persist_s, bytes=result.bytes,
                    **({"tier": MEMORY} if result.tier == MEMORY else {}))
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

    def _write_shard(self, step: int, snap: _Snapshot, tier: Tier) -> ShardManifest:
        backend = tier.backend
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
                with _ZipCrc.off():
                    if self.format == "torch":
                        torch.save(owning_storages(snap.state), directory / "state.pt")
                    else:
                        save_dcp(snap.state, directory, self.rank)
                    if snap.extra is not None:
                        write_rank_state(directory, snap.extra)
            except (OSError, RuntimeError) as exc:
                raise _storage_error(backend, prefix, directory, exc) from exc
            failpoint("ckpt.after_write")
            if self.signer is not None:  # SHARD.sig: one of the shard's files, listed and copied with the rest
                self.signer.sign(directory, job=self.job, step=step, epoch=self.epoch, rank=self.rank,
                                 world_size=self.world_size, fmt=self.format)
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


class _ZipCrc:
    """torch's zip CRC32 switched off while shards are written. Every file of a shard has ftd's
    CRC32C (in its manifest, checked on every copy and restore); torch.save computes a CRC32 of every
    record too (0.08 of its 0.18 CPU-s per 256 MiB here) which torch.load never checks (a flipped
    byte loads silently either way: tested). The switch is process-wide, so concurrent writers share
    it by count, and a user's own torch.save in another thread meanwhile writes no zip CRC either
    (which no torch.load reads)."""

    _lock = threading.Lock()
    _users = 0
    _prior = True

    @classmethod
    @contextlib.contextmanager
    def off(cls) -> Iterator[None]:
        try:
            from torch.utils.serialization import config
        except ImportError:  # a torch before the switch: it computes the CRC
            yield
            return
        with cls._lock:
            if cls._users == 0:
                cls._prior = config.save.compute_crc32
                config.save.compute_crc32 = False
            cls._users += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._users -= 1
                if cls._users == 0:
                    config.save.compute_crc32 = cls._prior


class _Outcome:
    """The one error ladder: a failure of the storage or of the agent inside the block ends the
    phase, is kept in the result and reported; the save loop goes on. A full tier is reported as
    ``full`` (``memory_full``, ``disk_full``; for the agent's ``hop``, its RESOURCE_EXHAUSTED answer:
    the SSD is full — the coordinator's per-node rate limit answers the same code, but only past a
    burst of 60 commits), anything else as ``error``."""

    def __init__(self, loop: SaveLoop, result: SaveResult, full: str, hop: bool) -> None:
        self.loop, self.result, self.full, self.hop = loop, result, full, hop

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None:
            return False
        if isinstance(exc, StorageFull):
            self.result.error, why = str(exc), self.full
        elif isinstance(exc, CatalogRefused):
            self.result.error = f"{type(exc).__name__}: {exc}"
            why = self.full if self.hop and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "error"
        elif isinstance(exc, (StorageError, OSError, RuntimeError, AgentUnavailable)):
            self.result.error, why = f"{type(exc).__name__}: {exc}", "error"
        else:
            return False
        self.loop._report_failure(self.result.step, self.result.error, why)
        return True


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
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full:
        with contextlib.suppress(OSError):
            full = shutil.disk_usage(directory).free < 1 << 20
    if full:
        return StorageFull(backend.name, prefix, f"no space left on the hot tier writing {directory}: {exc}")
    return StorageError(backend.name, prefix, f"writing {directory} failed: {exc}")


__all__ = ["SaveLoop", "SaveResult", "failpoint"]
