"""A dcp step saved by a world of another size, loaded through DCP's load-time resharding.

A world that shrank for want of a spare (the job's ``on_no_spare = "shrink"``), or grew when nodes
came back, restores the newest step whatever world size saved it. Each rank's shard of a dcp step is
its own DCP checkpoint (:mod:`.dcp_io`: a ``.metadata`` listing the chunks that rank held, at their
offsets in the global tensors, and its data file), so a rank of the new world needs the chunks that
overlap its own new shards, wherever they are. :func:`load_resharded`:

1. reads every old rank's ``.metadata`` from its fastest copy (this node's memory or disks in place,
   S3 downloading only that file, another node's copy pulled whole by the agent), checked against
   the catalog's size and CRC32C before it is unpickled by :func:`~.dcp_io.safe_metadata`;
2. merges them (:func:`merge_metadata`) into one Metadata whose data files are named per old rank
   (:func:`link_name`); a chunk several ranks saved (a replicated tensor, a ``Replicate``
   placement, a plain tensor every rank holds) and a non-tensor value come from the lowest rank
   holding it, as DCP's own de-duplication keeps one; ranks disagreeing on a tensor's global shape,
   or chunks not covering it, are refused naming the tensor;
3. asks DCP's planner which chunks this rank's state reads (:func:`needed_ranks`), hence which old
   ranks' data it needs: only those are made local, every file checked;
4. links them into one local folder (symbolic links: no copy) and lets DCP load the state in place
   from there (:func:`~.dcp_io.load_dcp` with the merged metadata).

A copy that fails its check is recorded corrupt and the next copy of that rank is read; one that
cannot be read now is skipped (:meth:`~.restore.Restorer.first_readable`). A failure after the
check (a tensor of another shape, a planner error, a merge refused) is
:class:`~.corruption.IncompatibleCheckpoint`, never corruption. The RNG states and data loader
position (:mod:`.rank_state`) are per rank: new rank r takes old rank ``r % old_world_size``'s (its
file checked with that rank's ``.metadata``), so a loader's position carries over; the random
streams of another world size are no continuation of any run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import pickle
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ftd.checkpoints.catalog import MEMORY, CheckpointRecord, CopyRef, ShardRecord
from ftd.checkpoints.layout import shard_prefix
from ftd.checkpoints.signing import SIGNATURE
from ftd.storage_backends.base import StorageError
from ftd.storage_backends.tiers import Tier
from ftd.v1 import agent_pb2

from .corruption import IncompatibleCheckpoint, Missed, verify_files
from .dcp_io import DCP_METADATA, load_dcp, safe_metadata
from .rank_state import FILE as RANK_STATE
from .rank_state import read as read_rank_state
from .snapshot import is_stateful

log = logging.getLogger("ftd.training.reshard")
T = TypeVar("T")


class ShardReader(Protocol):
    """What the resharder needs of the restore (:class:`~.restore.Restorer`): one copy of a shard read
    with corruption classified, the end of a step no copy of some shard could be read of, and a copy
    on another node pulled through the agent."""

    rank: int
    world_size: int

    def first_readable(self, record: CheckpointRecord, shards: Sequence[ShardRecord],
                       read: Callable[[CopyRef, Tier | None, ShardRecord], T]
                       ) -> tuple[T, CopyRef, Tier | None, ShardRecord] | Missed: ...

    def missed(self, record: CheckpointRecord, missed: Missed) -> None: ...

    def pull(self, copy: CopyRef, record: CheckpointRecord, shard: ShardRecord) -> agent_pb2.FetchShardResponse: ...

    def signature_check(self, record: CheckpointRecord, shard: ShardRecord,
                        names: Collection[str] | None = None) -> Callable[[Path], None] | None: ...


@dataclasses.dataclass(frozen=True)
class Resharded:
    state: dict[str, Any]  # the template, loaded in place
    sources: str  # which copy of which old rank was read
    rank_state: dict[str, Any] | None  # old rank ``rank % old_world_size``'s RNG and data loader states


class ReshardMismatch(ValueError):
    """The old ranks' metadata cannot be merged into one checkpoint; ``tensor`` names the culprit."""

    def __init__(self, tensor: str, why: str) -> None:
        super().__init__(f"{tensor}: {why}")
        self.tensor = tensor


@dataclasses.dataclass
class Opened:
    """One old rank's shard as far as it was made local: its folder, the copy read, and whether every
    file (not only ``.metadata``) is there and checked."""

    folder: Path
    copy: CopyRef
    tier: Tier | None  # None: pulled through the agent
    full: bool
    metadata: Any
    rank_state: dict[str, Any] | None = None  # the shard's rank state, when it was asked for and is there


def link_name(rank: int, name: str) -> str:
    """What old rank ``rank``'s file ``name`` is called in the folder DCP reads."""
    return f"rank-{rank:05d}.{name}"


def rank_of_link(name: str) -> int:
    return int(name[len("rank-"):len("rank-") + 5])


def merge_metadata(parts: Mapping[int, Any]) -> Any:
    """One DCP Metadata over every old rank's (``parts``: rank -> Metadata), its data files renamed
    :func:`link_name` (see the module docstring). Raises :class:`ReshardMismatch`."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if not parts:
        raise ReshardMismatch("(none)", "no rank's metadata to merge")
    merged: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for rank in sorted(parts):
        md = parts[rank]
        own = md.storage_data or {}
        if isinstance(md.planner_data, dict):
            for key, value in md.planner_data.items():
                planner.setdefault(key, value)
        for fqn, item in md.state_dict_metadata.items():
            have = merged.get(fqn)
            if not isinstance(item, TensorStorageMetadata):
                if have is None:
                    merged[fqn] = item
                    storage[MetadataIndex(fqn)] = _renamed(own, MetadataIndex(fqn), rank)
                elif isinstance(have, TensorStorageMetadata):
                    raise ReshardMismatch(fqn, f"rank {rank} saved a value, a lower rank a tensor")
                continue
            if have is None:
                have = merged[fqn] = TensorStorageMetadata(item.properties, item.size, [])
            elif not isinstance(have, TensorStorageMetadata):
                raise ReshardMismatch(fqn, f"rank {rank} saved a tensor, a lower rank a value")
            elif have.size != item.size or have.properties.dtype != item.properties.dtype:
                raise ReshardMismatch(fqn, f"rank {rank} saved it as {_shape(item)}, a lower rank as {_shape(have)}")
            for chunk in item.chunks:
                same = next((c for c in have.chunks if c.offsets == chunk.offsets), None)
                if same is not None:  # held by several ranks: the lowest one's
                    if same.sizes != chunk.sizes:
                        raise ReshardMismatch(fqn, f"rank {rank} saved a chunk at {tuple(chunk.offsets)} of "
                                                   f"{tuple(chunk.sizes)}, a lower rank one of {tuple(same.sizes)}")
                    continue
                have.chunks.append(chunk)
                storage[MetadataIndex(fqn, chunk.offsets)] = _renamed(own, MetadataIndex(fqn, chunk.offsets), rank)
    for fqn, item in merged.items():
        if isinstance(item, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in item.chunks)
            if covered != math.prod(item.size):
                raise ReshardMismatch(fqn, f"the saved chunks hold {covered} of its {math.prod(item.size)} elements "
                                           f"{_shape(item)}: not one sharded tensor across the old ranks")
    return dataclasses.replace(parts[min(parts)], state_dict_metadata=merged, planner_data=planner,
                               storage_data=storage)


def _renamed(own: Mapping[Any, Any], index: Any, rank: int) -> Any:
    info = own.get(index)
    if info is None:
        raise ReshardMismatch(index.fqn, f"rank {rank}'s metadata lists it but says not where it is stored")
    return dataclasses.replace(info, relative_path=link_name(rank, str(info.relative_path)))


def _shape(item: Any) -> str:
    return f"{tuple(item.size)} {str(item.properties.dtype).removeprefix('torch.')}"


def needed_ranks(state: dict[str, Any], metadata: Any) -> set[int]:
    """The old ranks whose data DCP's planner reads to load ``state`` (its Stateful values already
    turned into their state dicts) from ``metadata`` (:func:`merge_metadata`'s). Raises what the
    planner raises (a missing key, a tensor of another shape)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=True)
    plan = planner.create_local_plan()
    return {rank_of_link(str(metadata.storage_data[item.storage_index].relative_path)) for item in plan.items}


def only_ranks(metadata: Any, ranks: set[int]) -> Any:
    """``metadata`` keeping the chunks and values stored by ``ranks`` (the ones made local): what the
    planner reads is unchanged, and nothing points at a file that is not there."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    kept: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            info = metadata.storage_data[MetadataIndex(fqn)]
            if rank_of_link(str(info.relative_path)) in ranks:
                kept[fqn], storage[MetadataIndex(fqn)] = item, info
            continue
        chunks = [c for c in item.chunks
                  if rank_of_link(str(metadata.storage_data[MetadataIndex(fqn, c.offsets)].relative_path)) in ranks]
        kept[fqn] = TensorStorageMetadata(item.properties, item.size, chunks)
        for c in chunks:
            storage[MetadataIndex(fqn, c.offsets)] = metadata.storage_data[MetadataIndex(fqn, c.offsets)]
    return dataclasses.replace(metadata, state_dict_metadata=kept, storage_data=storage)


def _read_metadata(path: Path, weights_only: bool) -> Any:
    """A verified ``.metadata``: the restricted unpickler (``weights_only``), else plain pickle (the
    caller trusts whoever saved it)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if weights_only:
        loaded = safe_metadata(path)
    else:
        with open(path, "rb") as f:
            loaded = pickle.load(f)  # weights_only=False: the caller trusts whoever saved it
    if not isinstance(loaded, Metadata):
        raise IncompatibleCheckpoint(f"{path} holds a {type(loaded).__name__}, not dcp Metadata")
    return loaded


class _Reshard:
    """One resharded restore: the old ranks' shards opened (their temporary folders live as long as
    the ``stack``)."""

    def __init__(self, restorer: ShardReader, record: CheckpointRecord, stack: contextlib.ExitStack[Any],
                 weights_only: bool) -> None:
        self.restorer, self.record, self.stack, self.weights_only = restorer, record, stack, weights_only
        self.state_rank = restorer.rank % record.world_size  # whose rank state this rank takes

    def expected(self, shard: ShardRecord) -> dict[str, tuple[int, str]]:
        return {f.name: (f.size, f.crc32c) for f in shard.files}

    def metadata(self, copy: CopyRef, tier: Tier | None, shard: ShardRecord) -> Opened:
        """Phase 1: the shard's ``.metadata`` (and the rank state this rank takes), checked, then
        unpickled."""
        expected = self.expected(shard)
        if DCP_METADATA not in expected:
            raise IncompatibleCheckpoint(f"the shard's manifest lists no {DCP_METADATA}: not a dcp shard")
        names = [DCP_METADATA, *([RANK_STATE] if shard.rank == self.state_rank and RANK_STATE in expected else [])]
        signed = self.restorer.signature_check(self.record, shard, names)
        if tier is not None:
            prefix = shard_prefix(self.record.job, self.record.step, shard.rank)
            fetch = [*names, *([SIGNATURE] if signed is not None and SIGNATURE in expected else [])]
            folder = self.stack.enter_context(tier.backend.local_folder(prefix, fetch))
            verify_files(folder, {n: expected[n] for n in names}, in_memory=tier.name == MEMORY)
            full = False
        else:  # another node's copy comes whole: its data is then at hand too
            got = self.restorer.pull(copy, self.record, shard)
            folder = Path(got.path)
            verify_files(folder, expected, checked=got.verified)
            full = True
        if signed is not None:  # before anything of it is unpickled
            signed(folder)
        try:
            metadata = _read_metadata(folder / DCP_METADATA, self.weights_only)
            saved = read_rank_state(folder) if RANK_STATE in names else None
        except (ValueError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, RuntimeError) as exc:
            raise IncompatibleCheckpoint(f"{type(exc).__name__}: {exc}") from exc
        return Opened(folder, copy, tier, full, metadata, saved)

    def data(self, copy: CopyRef, tier: Tier | None, shard: ShardRecord, opened: Opened) -> Opened:
        """Phase 2: every file of the shard, checked (``opened``: what phase 1 read of it)."""
        expected = self.expected(shard)
        if tier is not None:
            prefix = shard_prefix(self.record.job, self.record.step, shard.rank)
            folder = self.stack.enter_context(tier.backend.local_folder(prefix, list(expected)))
            verify_files(folder, expected, in_memory=tier.name == MEMORY)
        else:
            got = self.restorer.pull(copy, self.record, shard)
            folder = Path(got.path)
            verify_files(folder, expected, checked=got.verified)
        if (signed := self.restorer.signature_check(self.record, shard)) is not None:
            signed(folder)
        return Opened(folder, copy, tier, True, opened.metadata, opened.rank_state)


def load_resharded(restorer: ShardReader, record: CheckpointRecord, template: dict[str, Any] | None,
                   weights_only: bool) -> Resharded | None:
    """Loads ``record`` (a dcp step of another world size) into ``template`` in place for this rank
    (see the module docstring). ``None``: some old rank's shard cannot be read now (or every copy of
    it was proven corrupt: then the step is invalidated)."""
    step, rank = record.step, restorer.rank
    if template is None:
        raise IncompatibleCheckpoint("a dcp checkpoint is loaded in place: pass the state to load into",
                                     step=step, rank=rank)
    with contextlib.ExitStack() as stack:
        job = _Reshard(restorer, record, stack, weights_only)
        opened: dict[int, Opened] = {}
        for old in range(record.world_size):
            got = restorer.first_readable(record, [record.shards[old]], job.metadata)
            if isinstance(got, Missed):
                restorer.missed(record, got)
                return None
            opened[old] = got[0]
        # DCP's own load turns a Stateful value into its state dict, loads that, and hands it back.
        state = {k: (v.state_dict() if is_stateful(v) else v) for k, v in template.items()}
        try:
            merged = merge_metadata({old: o.metadata for old, o in opened.items()})
            needed = needed_ranks(state, merged)
        except ReshardMismatch as exc:
            raise IncompatibleCheckpoint(str(exc), step=step, rank=rank, tensor=exc.tensor,
                                         source=f"world size {record.world_size}") from exc
        except Exception as exc:  # the planner: a key this state has and the step not, another shape
            raise IncompatibleCheckpoint(f"{type(exc).__name__}: {exc}", step=step, rank=rank,
                                         source=f"world size {record.world_size}") from exc
        for old in sorted(needed):
            if not opened[old].full:
                got = restorer.first_readable(record, [record.shards[old]],
                                              functools.partial(job.data, opened=opened[old]))
                if isinstance(got, Missed):
                    restorer.missed(record, got)
                    return None
                opened[old] = got[0]
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ftd-reshard-")))
        expected: dict[str, tuple[int, str]] = {}
        for old in sorted(needed):
            for f in record.shards[old].files:
                if f.name not in (DCP_METADATA, RANK_STATE):
                    os.symlink(opened[old].folder / f.name, folder / link_name(old, f.name))
                    expected[link_name(old, f.name)] = (f.size, f.crc32c)
        try:
            load_dcp(folder, expected, state, weights_only, merged=only_ranks(merged, needed))
        except (OSError, StorageError) as exc:  # a copy went away while read: no proof of corruption
            log.warning("rank %d: resharding step %d failed reading (%s: %s); trying again", rank, step,
                        type(exc).__name__, exc)
            return None
        except Exception as exc:
            raise IncompatibleCheckpoint(f"{type(exc).__name__}: {exc}", step=step, rank=rank,
                                         source=f"world size {record.world_size}") from exc
    for key, value in template.items():
        if is_stateful(value):
            value.load_state_dict(state[key])
        else:
            template[key] = state[key]
    sources = ", ".join(f"{old}: {opened[old].copy}{'' if opened[old].tier is not None else ' (pulled)'}"
                        for old in sorted(needed))
    log.info("rank %d: step %d resharded from world size %d (read old ranks %s)", rank, step, record.world_size,
             sorted(needed))
    return Resharded(template, f"resharded from world size {record.world_size} to {restorer.world_size}; "
                               f"old rank(s) {sources}", opened[job.state_rank].rank_state)


__all__ = ["ReshardMismatch", "link_name", "load_resharded", "merge_metadata", "needed_ranks", "only_ranks"]
