"""Restore from the training side: the newest step this rank can verify, from the fastest copy.

:meth:`Restorer.load_latest` asks the catalog (through the agent) for the newest valid step, then
reads this rank's shard from its copies in the order :func:`order_copies` gives: this node's memory,
another node's memory (the buddy's, pulled through the agent: ``FetchShard``), this node's SSD, HDD
(its own or shared), S3, and last the other nodes' disks. Every file is checked against the
catalog's size and CRC32C before a byte is unpickled (:func:`load_shard`); a copy that fails is
recorded corrupt and the next one is tried. A copy that cannot be read *now* (its node unreachable,
a memory snapshot a newer one replaced) is :class:`SkippedCopy`: skipped, never recorded corrupt,
and the step is invalidated only when every copy was proven corrupt. With ``torch.distributed``
initialised the ranks agree on one step.

Nothing here saves: the save loop (:mod:`.save_loop`) and the facade (:mod:`.checkpoint`) import
this module, never the other way round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import torch

from ftd.checkpoints.catalog import MEMORY, TIERS, CheckpointRecord, CopyRef, ShardRecord, from_info
from ftd.checkpoints.layout import shard_prefix
from ftd.storage_backends.base import ObjectNotFound, StorageError, crc32c_file
from ftd.storage_backends.tiers import Tier
from ftd.v1 import agent_pb2, checkpoint_pb2

from .agent_link import AgentLink, AgentUnavailable, CatalogRefused

log = logging.getLogger("ftd.training.restore")
Expected = Mapping[str, tuple[int, str]]  # file name -> (size, crc32c), from the catalog


class RestoreError(RuntimeError):
    pass


class SkippedCopy(Exception):
    """A copy that could not be read now (its node unreachable, or it is not there): skipped, not
    recorded corrupt."""


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
               weights_only: bool, *, checked: bool = False) -> Any:
    """Loads one shard copy from local files once every file the catalog lists matched its size and
    CRC32C (``checked``: this node's agent checked the CRC32Cs against these very sums as the bytes
    landed, ``FetchShardResponse.verified``, and renamed the files into place only then; the sizes
    are checked again here). A ``dcp`` shard is loaded into ``template`` in place."""
    for name, (size, crc) in expected.items():
        path = directory / name
        actual_size = path.stat().st_size
        if actual_size != size:
            raise ValueError(f"{path}: {actual_size} bytes, the catalog says {size}")
        if not checked and (actual := crc32c_file(path)) != crc:
            raise ValueError(f"{path}: crc32c {actual}, the catalog says {crc}")
    if fmt == "torch" or "state.pt" in expected:
        return torch.load(directory / "state.pt", map_location=map_location, mmap=True, weights_only=weights_only)
    if template is None:
        raise ValueError("a dcp checkpoint is loaded in place: pass template=model/optimizer state dict")
    return _load_dcp(directory, expected, template, weights_only)


class Restorer:
    """Reads this rank's shard of the newest step it can verify (see the module docstring)."""

    def __init__(self, job: str, rank: int, world_size: int, fmt: str, tiers: list[Tier], agent: AgentLink) -> None:
        self.job, self.rank, self.world_size, self.format = job, rank, world_size, fmt
        self.tiers = tiers
        self.agent = agent
        self.restored_from = ""  # the copy the last restore loaded ("mem@node-2", "ssd@node-0", ...)

    def load_latest(self, map_location: Any = "cpu", template: dict[str, Any] | None = None,
                    weights_only: bool = True, attempts: int = 8,
                    replicated: bool = False) -> tuple[int, Any] | None:
        """``(step, state_dict)`` of the newest checkpoint this rank can verify, or ``None`` when
        there is no valid checkpoint (:meth:`ftd.training.Checkpointer.load_latest`)."""
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
        for source, (copy, tier) in ((s, c) for s in shards for c in order_copies(s, self.tiers)):
            try:
                state = (self.read(tier, record, source, map_location, template, weights_only) if tier is not None
                         else self._read_remote(copy, record, source, map_location, template, weights_only))
                self.restored_from = (f"{copy}" + ("" if tier is not None else " (pulled through the agent)")
                                      + ("" if source.rank == want else f" (rank {source.rank}'s copy: replicated)"))
                return record.step, state
            except SkippedCopy as exc:
                skipped.append(f"{copy}: {exc}")
                log.warning("rank %d step %d: copy on %s skipped (%s), trying the next one", self.rank, record.step,
                            copy, exc)
            except (StorageError, OSError, RuntimeError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                if copy.tier == MEMORY and tier is not None and isinstance(exc, (FileNotFoundError, ObjectNotFound)):
                    skipped.append(f"{copy}: gone ({why})")  # a newer snapshot replaced it: not corrupt
                    self.agent.record_gone(self.job, record.step, source.rank, tier.name, tier.location)
                    continue
                problems.append(f"{copy}: {why}")
                log.warning("rank %d step %d: copy on %s unusable, trying the next one: %s", self.rank, record.step,
                            copy, why)
                self.agent.record_corrupt(self.job, record.step, source.rank, copy.tier, copy.location, why[:400])
        if skipped:
            log.error("step %d of job %s: rank %d could read no copy now (%s); not invalidated: an unreachable copy is "
                      "no corrupt one", record.step, self.job, self.rank, "; ".join([*problems, *skipped])[:2000])
            return None
        reason = f"rank {self.rank}: no tier holds a verified copy ({'; '.join(problems) or 'no copy recorded'})"
        log.error("step %d of job %s is unrecoverable: %s", record.step, self.job, reason)
        try:
            self.agent.invalidate(self.job, record.step, reason[:500])
        except (AgentUnavailable, CatalogRefused) as exc:
            log.warning("could not invalidate step %d: %s", record.step, exc)
        return None

    def read(self, tier: Tier, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
             template: dict[str, Any] | None, weights_only: bool) -> Any:
        """Loads one shard copy from one of this node's tiers (:func:`load_shard`); the tier hands
        out local files (in place on a directory tier, downloaded from an object store)."""
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        with tier.backend.local_folder(shard_prefix(self.job, record.step, shard.rank), expected) as directory:
            return load_shard(directory, expected, self.format, map_location, template, weights_only)

    def _read_remote(self, copy: CopyRef, record: CheckpointRecord, shard: ShardRecord, map_location: Any,
                     template: dict[str, Any] | None, weights_only: bool) -> Any:
        """A copy on another node: the agent pulls it (``FetchShard``: its agent streams it, every
        file's CRC32C checked as it lands) into a local directory, then it is loaded like a local one."""
        request = agent_pb2.FetchShardRequest(
            job=self.job, step=record.step, rank=shard.rank, tier=copy.tier, location=copy.location,
            expected=[checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in shard.files])
        try:
            got = self.agent.fetch_shard(request)
        except AgentUnavailable as exc:
            raise SkippedCopy(f"unreachable: {exc}") from exc
        except CatalogRefused as exc:
            if exc.code == grpc.StatusCode.DATA_LOSS:
                raise ValueError(f"arrived corrupt: {exc}") from exc
            raise SkippedCopy(f"not readable there ({exc})") from exc
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        return load_shard(Path(got.path), expected, self.format, map_location, template, weights_only,
                          checked=got.verified)


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


# ---- dcp restore: nothing is unpickled before it is verified --------------------------------------------
#
# A dcp shard is a folder: ``.metadata`` (a pickle of torch.distributed.checkpoint's Metadata, which
# DCP's own FileSystemReader loads with plain ``pickle.load``, i.e. it can run any code) and data
# files (tensors as raw bytes; other objects as torch.save blobs that DCP loads with
# ``weights_only=True``). Before anything is read, every file the catalog lists was checked against
# its size and CRC32C (:func:`load_shard`); then:
#
# * ``.metadata`` must be one of those verified files (a manifest without it is refused);
# * ``weights_only=True`` (the default): ``.metadata`` is unpickled by a restricted unpickler that
#   builds only DCP's metadata classes, torch sizes, dtypes and layouts, and paths (anything else is
#   refused, naming it), so a crafted ``.metadata`` cannot run code even if its checksum was
#   recorded by a lying node; ``weights_only=False``: DCP's stock reader (plain pickle) reads it,
#   trusting whoever committed the shard, like ``torch.load(weights_only=False)``;
# * every data file the metadata points at must be one of the verified files (no reading outside the
#   shard, nothing unverified).

DCP_METADATA = ".metadata"
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


def _load_dcp(directory: Path, expected: Expected, template: dict[str, Any], weights_only: bool) -> dict[str, Any]:
    """Loads a verified dcp shard into ``template`` in place (see above)."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    if DCP_METADATA not in expected:
        raise ValueError(f"{directory}: the shard's manifest does not list {DCP_METADATA}; refusing to unpickle "
                         "a file whose checksum nobody recorded")
    metadata = _safe_dcp_metadata(directory / DCP_METADATA) if weights_only else None

    class Verified(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            loaded = metadata if metadata is not None else super().read_metadata(*args, **kwargs)
            if not isinstance(loaded, Metadata):
                raise ValueError(f"{directory}/{DCP_METADATA} holds a {type(loaded).__name__}, not dcp Metadata")
            for info in (loaded.storage_data or {}).values():
                name = str(getattr(info, "relative_path", ""))
                if name not in expected or name == DCP_METADATA:
                    raise ValueError(f"{directory}/{DCP_METADATA} points at {name[:200]!r}, which is not a verified "
                                     "file of this shard")
            return loaded

    try:
        state_dict_loader.load(template, storage_reader=Verified(str(directory)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: the tier loop would not see it
        causes = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()) or str(exc)
        raise ValueError(f"{directory}: dcp load failed: {causes}") from exc
    return template


__all__ = ["DCP_METADATA", "RestoreError", "Restorer", "SkippedCopy", "load_shard", "order_copies"]
