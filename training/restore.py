"""Restore from the training side: the newest step this rank can verify, from the fastest copy.

:meth:`Restorer.load_latest` asks the catalog (through the agent) for the newest valid step, then
reads this rank's shard from its copies in the order :func:`order_copies` gives: this node's memory,
another node's memory (the buddy's, pulled through the agent: ``FetchShard``), this node's SSD, HDD
(its own or shared), S3, and last the other nodes' disks. Every file is checked against the
catalog's size and CRC32C before a byte is unpickled (:func:`load_shard`); a copy that fails is
recorded corrupt and the next one is tried. A copy that cannot be read *now* (its node unreachable,
a memory snapshot a newer one replaced, an I/O error) is skipped, never recorded corrupt, and the
step is invalidated only when every copy was proven corrupt. With ``torch.distributed`` initialised
the ranks agree on one step.

**In place, at memory speed**: a ``dcp`` shard is loaded into the live state by DCP itself (a
``Stateful`` value's ``state_dict()`` loaded into, its ``load_state_dict()`` called:
:mod:`.dcp_io`), its tensors copied straight from the mapped files; a copy in this node's memory tier
is hashed from its mapped pages (``crc32c_mapped``), not read into buffers. Once the ranks agreed on
the step, the shard's :mod:`.rank_state` (RNG states, data loader position) is set back.

**What is corruption**: only a file that does not match the catalog's size or CRC32C, or is missing
from a durable copy (:class:`CorruptCopy`). A load that fails *after* every file checked out (a
tensor of another shape, an unpickling or DCP planner error, a torch-format step of another world
size) is :class:`IncompatibleCheckpoint`: the bytes are the ones committed, so it is raised on every
rank with the step, rank and tensor, never recorded as corruption, never invalidates a step, and
deletes nothing.

**Another world size** (a world that shrank for want of a spare, or grew): the catalog offers a
``dcp`` job the newest restorable step of any size, and :mod:`.reshard` loads it through DCP's
load-time resharding from every old rank's shard it needs; replicated (data-parallel) state reads
one rank's shard. The restore is reported to the agent (``ReportProgress.restored``: what the new
world resumed from, for drills and the demo), and its step bounds the abandoned timeline
(``CommitShardRequest.restored_step``).

Nothing here saves: the save loop (:mod:`.save_loop`) and the facade (:mod:`.checkpoint`) import
this module, never the other way round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from ftd.checkpoints.catalog import MEMORY, TIERS, CheckpointRecord, CopyRef, ShardRecord, from_info
from ftd.checkpoints.layout import shard_prefix
from ftd.storage_backends.base import ChecksumMismatch, ObjectNotFound, StorageError
from ftd.storage_backends.tiers import Tier
from ftd.v1 import agent_pb2, checkpoint_pb2, cluster_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused
from .checkpoint_signing import ShardSigner
from .corruption import (
    CorruptCopy,
    Expected,
    IncompatibleCheckpoint,
    Missed,
    RestoreError,
    SkippedCopy,
    crc32c_mapped,
    verify_files,
)
from .dcp_io import DCP_METADATA, load_dcp
from .rank_state import FILE as RANK_STATE
from .rank_state import RankState
from .rank_state import read as read_rank_state
from .reshard import load_resharded
from .snapshot import is_stateful

log = logging.getLogger("ftd.training.restore")
T = TypeVar("T")
Readable = tuple[T, CopyRef, Tier | None, ShardRecord]  # what was read, from which copy, tier and shard
_REFUSED = -3  # a rank's answer in the agreement: it cannot load the target (IncompatibleCheckpoint)


def order_copies(shard: ShardRecord, my_tiers: Iterable[Tier],
                 alive: Collection[str] | None = None) -> list[tuple[CopyRef, Tier | None]]:
    """The copies of ``shard`` not known to be corrupt, each with this node's tier that reads it
    (``None``: on another node, pulled through the agent), in the restore order: this node's memory,
    another node's memory (the buddy's), then this node's SSD, HDD (its own or shared), S3, and last
    the other nodes' disks; fastest tier first within each, then by location. ``alive``: the other
    nodes known to be up (``None``: not known); a copy on any other node comes after all of them."""
    mine = {(t.name, t.location): t for t in my_tiers}
    order = {name: i for i, name in enumerate(TIERS)}

    def rank(item: tuple[CopyRef, Tier | None]) -> tuple[int, int, int, str]:
        copy, tier = item
        gone = int(tier is None and alive is not None and copy.location not in alive)
        speed = order.get(copy.tier, len(order))
        if copy.tier == MEMORY:
            return gone, (0 if tier is not None else 1), speed, copy.location
        return gone, (2 if tier is not None else 3), speed, copy.location

    return sorted(((c, mine.get((c.tier, c.location))) for c in shard.good_copies()), key=rank)


def load_shard(directory: Path, expected: Expected, fmt: str, map_location: Any, template: dict[str, Any] | None,
               weights_only: bool, *, checked: bool = False, in_memory: bool = False,
               verify: Callable[[Path], None] | None = None) -> Any:
    """Loads one shard copy from local files once every file the catalog lists matched its size and
    CRC32C (``checked``: this node's agent checked the CRC32Cs against these very sums as the bytes
    landed, ``FetchShardResponse.verified``, and renamed the files into place only then; the sizes
    are checked again here; ``in_memory``: the files are in RAM, hashed mapped). A ``torch`` shard is
    mapped (``torch.load(mmap=True)``); a ``dcp`` shard is loaded into ``template`` in place, its
    tensors copied straight from the mapped files (:func:`ftd.training.dcp_io.load_dcp`).

    A file that does not match is :class:`CorruptCopy`; once every file matched, a load that fails
    is :class:`IncompatibleCheckpoint` (I/O errors keep their type: the copy is skipped). ``verify``:
    the shard's signature check (:mod:`.checkpoint_signing`), run before anything is unpickled. It
    hashes every file the signature covers, which are exactly the catalog's (sizes included), so a
    copy in memory skips the CRC32C pass then: one hash of the bytes, not two (0.03 s of a 0.22 s
    restore of 227 MB); a disk copy keeps it, whose mismatch names plain damage as such."""
    verify_files(directory, expected, checked=checked or (in_memory and verify is not None), in_memory=in_memory)
    if verify is not None:
        verify(directory)
    try:
        if fmt == "torch" or "state.pt" in expected:
            return torch.load(directory / "state.pt", map_location=map_location, mmap=True,
                              weights_only=weights_only)
        if template is None:
            raise ValueError("a dcp checkpoint is loaded in place: pass template=model/optimizer state dict")
        return load_dcp(directory, expected, template, weights_only)
    except (OSError, StorageError, MemoryError):
        raise
    except Exception as exc:  # the bytes are the committed ones: whatever fails now is no corruption
        raise IncompatibleCheckpoint(f"{type(exc).__name__}: {exc}") from exc


def saved_rank_state(directory: Path, expected: Expected) -> dict[str, Any] | None:
    """The shard's :mod:`.rank_state` file (RNG states, data loader position), verified with the rest
    by :func:`load_shard`; ``None`` for a shard written without one."""
    return read_rank_state(directory) if RANK_STATE in expected else None


def load_into(state: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """A loaded ``torch``-format state put into the live ``state`` in place: a Stateful value gets
    ``load_state_dict``, a tensor is copied into, a dict is filled the same way, anything else replaced."""
    for key, value in loaded.items():
        target: Any = state.get(key)
        if is_stateful(target):
            target.load_state_dict(value)
        elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        elif isinstance(target, dict) and isinstance(value, Mapping):
            load_into(target, value)
        else:
            state[key] = value


class Restorer:
    """Reads this rank's shard of the newest step it can verify (see the module docstring)."""

    def __init__(self, job: str, rank: int, world_size: int, fmt: str, tiers: list[Tier], agent: AgentLink,
                 extra: RankState | None = None, epoch: int = -1, signer: ShardSigner | None = None) -> None:
        self.job, self.rank, self.world_size, self.format = job, rank, world_size, fmt
        self.signer = signer  # every copy's signature checked before it is loaded (None: a node without mTLS)
        self.epoch = epoch  # of this world: reported with what it restored
        self.restored_step: int | None = None  # the step the last restore resumed from (-1: none); None: not asked
        self.tiers = tiers
        self.agent = agent
        self.extra = extra if extra is not None else RankState(rng=False)  # RNG states, data loader position
        self.restored_from = ""  # the copy the last restore loaded ("mem@node-2", "ssd@node-0", ...)
        self.restored_extra: list[str] = []  # what the last restore set besides the state ("python", "torch"...)
        self._extra: dict[str, Any] | None = None  # the rank state of the copy just read (applied once agreed)
        # where the last restore's time went: asking the catalog, reading and loading, waiting for the
        # other ranks' answers (the slowest rank's read shows in everybody else's agree_s)
        self.timings: dict[str, float] = {}

    def load_latest(self, map_location: Any = "cpu", template: dict[str, Any] | None = None,
                    weights_only: bool = True, attempts: int = 8,
                    replicated: bool = False) -> tuple[int, Any] | None:
        """``(step, state_dict)`` of the newest checkpoint this rank can verify, or ``None`` when
        there is no valid checkpoint (:meth:`ftd.training.Checkpointer.load_latest`)."""
        self.timings = {"target_s": 0.0, "read_s": 0.0, "agree_s": 0.0}
        for attempt in range(attempts):
            began = time.monotonic()
            target = self.agent.restore_target(self.job, replicated=replicated, world_size=self.world_size,
                                               fmt=self.format)
            asked = time.monotonic()
            self.timings["target_s"] += asked - began
            loaded: tuple[int, Any] | None = None
            refused: IncompatibleCheckpoint | None = None
            if target.found:
                try:
                    loaded = self._load_step(target.checkpoint, map_location, template, weights_only, replicated)
                except IncompatibleCheckpoint as exc:
                    refused = exc
                    log.error("rank %d cannot load step %d of job %s (not corruption: nothing is recorded corrupt, "
                              "invalidated or deleted): %s", self.rank, target.checkpoint.step, self.job, exc)
                if loaded is None and refused is None:  # a copy's node unreachable for now, or just invalidated
                    time.sleep(min(5.0, 0.5 * (attempt + 1)))
            read = time.monotonic()
            self.timings["read_s"] += read - asked
            low, high = _agree_all(_REFUSED if refused else loaded[0] if loaded else (-1 if not target.found else -2))
            self.timings["agree_s"] += time.monotonic() - read
            if low == _REFUSED:  # every rank stops with the reason, none hangs in a collective
                raise refused or IncompatibleCheckpoint(
                    "another rank cannot load it (its error names the tensor)", step=target.checkpoint.step,
                    rank=self.rank)
            if low != high:  # ranks disagree: someone invalidated a step; everyone asks again
                continue
            if low == -1:
                self._report_restored(-1, target.reason)
                return None
            if loaded is not None and loaded[0] == low:
                self.restored_extra = self.extra.apply(self._extra) if self._extra is not None else []
                self.restored_extra += self.extra.skip(target.skip_until_step - low)
                log.info("restored step %d (rank %d): %s%s", low, self.rank, target.reason,
                         f" (and {', '.join(self.restored_extra)})" if self.restored_extra else "")
                self._report_restored(low, target.reason, target.checkpoint.world_size)
                return loaded
        raise RestoreError(f"job {self.job} rank {self.rank}: no checkpoint could be restored after {attempts} tries")

    def _report_restored(self, step: int, reason: str, saved_world_size: int = 0) -> None:
        """What this world resumed from, to the agent (drills and the demo report it) and with every
        later commit (the abandoned timeline is bounded by it)."""
        self.restored_step = step
        self.agent.restored_step = step
        self.agent.report_restored(cluster_pb2.Restored(
            step=step, source=(self.restored_from if step >= 0 else f"nothing: {reason}")[:300],
            epoch=max(self.epoch, 0), world_size=self.world_size, saved_world_size=saved_world_size or self.world_size,
            at_unix_s=time.time(), rank=self.rank))

    def _load_step(self, info: checkpoint_pb2.CheckpointInfo, map_location: Any, template: dict[str, Any] | None,
                   weights_only: bool, replicated: bool = False) -> tuple[int, Any] | None:
        record = from_info(info)
        if record.world_size != self.world_size and not replicated:
            if self.format == "dcp" and record.format == "dcp":
                return self._resharded(record, template, weights_only)
            raise IncompatibleCheckpoint(
                f"saved by a world of {record.world_size} ranks in {record.format} format, and this world has "
                f"{self.world_size}: a {record.format} shard is one rank's state and cannot be resharded (save with "
                "format='dcp' to reshard, load data-parallel state with replicated=True, or set the job's "
                "on_no_spare='wait')", step=record.step, rank=self.rank)
        want = self.rank % record.world_size if replicated and record.world_size != self.world_size else self.rank
        shard = record.shards.get(want)
        if shard is None:
            raise RestoreError(f"step {record.step} of job {self.job} has no shard for rank {self.rank} "
                               f"(world size {record.world_size}); was it saved with another world size?")
        # Replicated state (data parallel): when this rank's own copies cannot be read, any other
        # rank's copy of the step is the same state (its own copies first, then the others in order).
        shards = [shard, *(s for r, s in sorted(record.shards.items()) if r != want)] if replicated else [shard]
        got = self.first_readable(record, shards, lambda copy, tier, source: (
            self.read(tier, record, source, map_location, template, weights_only) if tier is not None
            else self._read_remote(copy, record, source, map_location, template, weights_only)))
        if isinstance(got, Missed):
            self.missed(record, got)
            return None
        state, copy, tier, source = got
        self.restored_from = (f"{copy}" + ("" if tier is not None else " (pulled through the agent)")
                              + ("" if source.rank == want else f" (rank {source.rank}'s copy: replicated)"))
        return record.step, state

    def first_readable(self, record: CheckpointRecord, shards: Sequence[ShardRecord],
                       read: Callable[[CopyRef, Tier | None, ShardRecord], T]) -> Readable[T] | Missed:
        """``read`` of the first copy of ``shards`` (in order, each shard's copies fastest first) that
        works, with the copy, its tier (``None``: pulled through the agent) and its shard. A copy
        proven corrupt (:class:`CorruptCopy`, a missing file of a durable copy) is recorded corrupt;
        a memory copy gone is recorded gone; one unreachable or failing with an I/O error is skipped
        (no proof of corruption). :class:`IncompatibleCheckpoint` is raised with where it happened."""
        missed = Missed()
        for source, (copy, tier) in ((s, c) for s in shards for c in order_copies(s, self.tiers)):
            try:
                return read(copy, tier, source), copy, tier, source
            except IncompatibleCheckpoint as exc:
                raise exc.at(record.step, source.rank, str(copy)) from exc
            except SkippedCopy as exc:
                missed.skipped.append(f"{copy}: {exc}")
                log.warning("rank %d step %d: copy on %s skipped (%s), trying the next one", self.rank, record.step,
                            copy, exc)
            except (CorruptCopy, ChecksumMismatch, FileNotFoundError, ObjectNotFound) as exc:
                why = f"{type(exc).__name__}: {exc}"
                if copy.tier == MEMORY and tier is not None and isinstance(exc, (FileNotFoundError, ObjectNotFound)):
                    missed.skipped.append(f"{copy}: gone ({why})")  # a newer snapshot replaced it: not corrupt
                    self.agent.record_gone(self.job, record.step, source.rank, tier.name, tier.location)
                    continue
                missed.problems.append(f"{copy}: {why}")
                log.warning("rank %d step %d: copy on %s is corrupt, trying the next one: %s", self.rank, record.step,
                            copy, why)
                self.agent.record_corrupt(self.job, record.step, source.rank, copy.tier, copy.location, why[:400])
            except (StorageError, OSError) as exc:  # could not be read now: no proof of corruption
                missed.skipped.append(f"{copy}: {type(exc).__name__}: {exc}")
                log.warning("rank %d step %d: copy on %s unreadable now (%s: %s), trying the next one", self.rank,
                            record.step, copy, type(exc).__name__, exc)
        return missed

    def missed(self, record: CheckpointRecord, missed: Missed) -> None:
        """No copy could be read: the step is invalidated only when every copy was proven corrupt."""
        if missed.skipped:
            log.error("step %d of job %s: rank %d could read no copy now (%s); not invalidated: an unreachable copy is "
                      "no corrupt one", record.step, self.job, self.rank,
                      "; ".join([*missed.problems, *missed.skipped])[:2000])
            return
        reason = f"rank {self.rank}: no tier holds a verified copy ({'; '.join(missed.problems) or 'no copy recorded'})"
        log.error("step %d of job %s is unrecoverable: %s", record.step, self.job, reason)
        try:
            self.agent.invalidate(self.job, record.step, reason[:500])
        except (AgentUnavailable, CatalogRefused) as exc:
            log.warning("could not invalidate step %d: %s", record.step, exc)

    def read(self, tier: Tier, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
             template: dict[str, Any] | None, weights_only: bool) -> Any:
        """Loads one shard copy from one of this node's tiers (:func:`load_shard`); the tier hands
        out local files (in place on a directory tier, downloaded from an object store)."""
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        with tier.backend.local_folder(shard_prefix(self.job, record.step, shard.rank), expected) as directory:
            state = load_shard(directory, expected, self.format, map_location, template, weights_only,
                               in_memory=tier.name == MEMORY, verify=self.signature_check(record, shard))
            self._extra = saved_rank_state(directory, expected) if self.extra.enabled else None
            return state

    def signature_check(self, record: CheckpointRecord, shard: ShardRecord,
                        names: Collection[str] | None = None) -> Callable[[Path], None] | None:
        """The check of a copy's signature against the catalog's writer (``names``: the files about to
        be read); ``None`` on a node without mTLS."""
        signer = self.signer
        if signer is None:
            return None
        return lambda directory: signer.verify(directory, self.job, record.step, shard, names)

    def _resharded(self, record: CheckpointRecord, template: dict[str, Any] | None,
                   weights_only: bool) -> tuple[int, Any] | None:
        """A dcp step of another world size, loaded through DCP's resharding (:mod:`.reshard`)."""
        done = load_resharded(self, record, template, weights_only)
        if done is None:
            return None
        self.restored_from = done.sources
        self._extra = done.rank_state if self.extra.enabled else None  # old rank ``rank % old size``'s
        return record.step, done.state

    def pull(self, copy: CopyRef, record: CheckpointRecord, shard: ShardRecord) -> agent_pb2.FetchShardResponse:
        """A copy on another node made local by the agent (``FetchShard``: its agent streams it, every
        file's CRC32C checked as it lands): :class:`SkippedCopy` when it cannot be had now,
        :class:`CorruptCopy` when it arrived corrupt."""
        request = agent_pb2.FetchShardRequest(
            job=self.job, step=record.step, rank=shard.rank, tier=copy.tier, location=copy.location,
            expected=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in shard.files])
        try:
            return self.agent.fetch_shard(request)
        except AgentUnavailable as exc:
            raise SkippedCopy(f"unreachable: {exc}") from exc
        except CatalogRefused as exc:
            if exc.code == grpc.StatusCode.DATA_LOSS:
                raise CorruptCopy(f"arrived corrupt: {exc}") from exc
            raise SkippedCopy(f"not readable there ({exc})") from exc

    def _read_remote(self, copy: CopyRef, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
                     template: dict[str, Any] | None, weights_only: bool) -> Any:
        """A copy on another node: the agent pulls it (:meth:`pull`) into a local directory, then it is
        loaded like a local one."""
        got = self.pull(copy, record, shard)
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        state = load_shard(Path(got.path), expected, self.format, map_location, template, weights_only,
                           checked=got.verified, verify=self.signature_check(record, shard))
        self._extra = saved_rank_state(Path(got.path), expected) if self.extra.enabled else None
        return state


def _agree_all(value: int) -> tuple[int, int]:
    """With torch.distributed initialised, every rank must load the same step: the lowest and the
    highest of the ranks' answers (one all-reduce; equal: they agree). Without it, the rank's own."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value, value
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]), -int(t[1])


__all__ = ["DCP_METADATA", "CorruptCopy", "IncompatibleCheckpoint", "RestoreError", "Restorer", "SkippedCopy",
           "crc32c_mapped", "load_shard", "order_copies", "verify_files"]
