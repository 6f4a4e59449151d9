"""One rank's shard in torch.distributed.checkpoint (DCP) form: written as DCP writes it, read back
verified, in place, from mapped files.

**Writing** (:func:`save_dcp`): each rank writes its own shard folder (``no_dist``: no collective in
the background thread), its data file named ``__<rank>_0.distcp`` as a distributed ``dcp.save``
names rank r's file, and a ``.metadata`` holding this rank's chunks with their global offsets and
the tensors' global shapes (DTensor and ShardedTensor values keep them, :mod:`.snapshot`). So the
union of the ranks' folders is what one ``dcp.save`` of the whole job writes, less its
de-duplication of replicated values and with one ``.metadata`` per rank instead of their merge: a
checkpoint DCP can reshard.

**Reading** (:func:`load_dcp`): nothing is unpickled before it is verified. ``.metadata`` is a pickle
of DCP's Metadata, which DCP's own FileSystemReader loads with plain ``pickle.load`` (it can run any
code); data files hold tensors as ``torch.save`` blobs and other objects as bytes. Before anything
is read, every file the catalog lists was checked against its size and CRC32C
(:func:`ftd.training.restore.load_shard`); then:

* ``.metadata`` must be one of those verified files (a manifest without it is refused);
* ``weights_only=True`` (the default): ``.metadata`` is unpickled by a restricted unpickler that
  builds only DCP's metadata classes, torch sizes, dtypes and layouts, and paths (anything else is
  refused, naming it), so a crafted ``.metadata`` cannot run code even if its checksum was recorded
  by a lying node; ``weights_only=False``: DCP's stock reader (plain pickle) reads it, trusting
  whoever committed the shard, like ``torch.load(weights_only=False)``;
* every data file the metadata points at must be one of the verified files (no reading outside the
  shard, nothing unverified);
* tensors are read from the data files *mapped* (``UntypedStorage.from_file``, the way
  ``torch.load(mmap=True)`` maps): each is a view of the file's pages, copied once into the live
  tensor it is loaded into, with no staging buffer allocated, where DCP's stock reader reads each
  tensor into a fresh allocation (a page fault per 4 KiB) and copies it again; each record's pickle
  is read by a C unpickler that builds only a tensor (:class:`_TensorRecord`). From the memory tier
  that made the load 4.5 GB/s against 1.6-2.3 GB/s for the stock reader on a quiet moment here, and
  a whole shard read (CRC32Cs and load) 1.1-1.3 GB/s of CPU time against 0.7-0.8
  (``bench/restore_memory.py``). Where torch's private loading entry points differ from what this
  expects, DCP's stock reading is used.

The load is DCP's own, in place: a ``Stateful`` value of the template (an ``AppState`` around
``get_state_dict``/``set_state_dict``, which create the optimizer's lazily made state) gets its
``state_dict()`` loaded into and its ``load_state_dict()`` called.
"""

from __future__ import annotations

import functools
import io
import mmap
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

DCP_METADATA = ".metadata"
Expected = Mapping[str, tuple[int, str]]  # file name -> (size, crc32c), from the catalog

# Every rank writes and reads its own folder without a collective (no_dist): DCP warns about it each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

_DCP_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"), ("collections", "OrderedDict"),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def data_file(rank: int) -> str:
    """The data file rank ``rank`` writes (as a distributed ``dcp.save`` names it)."""
    return f"__{rank}_0.distcp"


def save_dcp(state: dict[str, Any], directory: Path, rank: int) -> None:
    """Writes ``state`` (a snapshot: plain, DTensor or ShardedTensor values) as rank ``rank``'s DCP
    shard into ``directory`` (see the module docstring)."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
    from torch.distributed.checkpoint.planner import SavePlan

    class RankWriter(FileSystemWriter):
        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            import dataclasses

            return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{rank}_")) for p in plans]

    state_dict_saver.save(state, storage_writer=RankWriter(str(directory)), no_dist=True)


def check_template(template: Mapping[str, Any]) -> None:
    """Refuses what DCP would load wrongly without a word: a bare optimizer (a fresh one's
    ``state_dict()`` has no state to load into, its keys are parameter ids, not names)."""
    for key, value in template.items():
        if isinstance(value, torch.optim.Optimizer):
            raise TypeError(f"state[{key!r}] is a bare optimizer: pass model and optimizer through "
                            "torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict (an AppState, "
                            "see ftd.training.checkpoint), which names the state by parameter and creates "
                            "the optimizer's lazily made state to load into")


def safe_metadata(path: Path) -> Any:
    """``.metadata`` unpickled with only DCP's metadata types allowed (see the module docstring)."""

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


_TENSOR_RECORD = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
                  ("collections", "OrderedDict"), ("torch.storage", "UntypedStorage")}


class _TensorRecord(pickle.Unpickler):
    """The pickle of one tensor as ``torch.save`` writes it, and nothing else: its rebuild function,
    ``OrderedDict``, dtypes (storage types are resolved by torch's loader before this is asked). The C
    unpickler: torch's ``weights_only`` one is pure Python, 0.2 ms a record, most of a restore's
    per-tensor cost. Anything else is refused and the record read again with ``weights_only``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _TENSOR_RECORD or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor record")


class _MappedRecord(io.RawIOBase):
    """One DCP item's bytes in the mapped data file, read without a system call. torch's zip reader
    makes about 20 small reads and seeks per record (its central directory, pickle and version
    records), each a seek and a read of the file through DCP's view of it; from the mapping, loading
    300 tensors of 227 MB took 0.146 CPU-s against 0.156 (most of the rest is torch's own record
    parsing)."""

    def __init__(self, mapped: memoryview, offset: int, length: int) -> None:
        super().__init__()
        self._bytes = mapped[offset:offset + length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._bytes)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._bytes) - self._pos))
        out[:n] = self._bytes[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._bytes.release()
        super().close()


def _mapped_loader() -> Any:
    """torch's zip-archive loading with an outside storage (what ``torch.load(mmap=True)`` does), or
    ``None`` where this torch has no such private entry points."""
    import types

    ser: Any = torch.serialization
    needed = ("_load", "_open_zipfile_reader", "_weights_only_unpickler")
    if not all(hasattr(ser, n) for n in needed):
        return None
    fast = types.SimpleNamespace(Unpickler=_TensorRecord)

    def load(view: Callable[[], Any], storage: torch.UntypedStorage) -> torch.Tensor:
        try:
            with ser._open_zipfile_reader(view()) as zf:
                loaded = ser._load(zf, "cpu", fast, overall_storage=storage)
        except pickle.UnpicklingError:  # not a plain tensor record: torch's weights_only unpickler reads it
            with ser._open_zipfile_reader(view()) as zf:
                loaded = ser._load(zf, "cpu", ser._weights_only_unpickler, overall_storage=storage)
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"a dcp tensor record holds a {type(loaded).__name__}")
        return loaded

    return load


def load_dcp(directory: Path, expected: Expected, template: dict[str, Any], weights_only: bool,
             merged: Any = None) -> dict[str, Any]:
    """Loads a verified dcp shard into ``template`` in place (see the module docstring). ``merged``:
    the Metadata to load with instead of the folder's ``.metadata`` (a resharded restore,
    :mod:`.reshard`: every old rank's, each verified and unpickled as above, merged); ``expected``
    then lists the data files it points at."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
    from torch.futures import Future

    check_template(template)
    if merged is None and DCP_METADATA not in expected:
        raise ValueError(f"{directory}: the shard's manifest does not list {DCP_METADATA}; refusing to unpickle "
                         "a file whose checksum nobody recorded")
    metadata = merged if merged is not None else safe_metadata(directory / DCP_METADATA) if weights_only else None
    mapped = _mapped_loader()

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

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            infos = [self.storage_data[item.storage_index] for item in plan.items]
            if mapped is None or any(getattr(i, "transform_descriptors", None) for i in infos):
                return super().read_data(plan, planner)
            per_file: dict[str, list[Any]] = {}
            for item, info in zip(plan.items, infos, strict=True):
                per_file.setdefault(str(info.relative_path), []).append((item, info))
            for name, items in per_file.items():
                path = directory / name
                size = path.stat().st_size
                whole = torch.UntypedStorage.from_file(str(path), False, size)  # mapped, private
                with open(path, "rb") as stream:  # the mapping outlives the descriptor; unmapped when unused
                    records = memoryview(mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
                for req, info in items:
                    view = functools.partial(_MappedRecord, records, info.offset, info.length)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(view().read(-1)))
                        continue
                    tensor = mapped(view, whole[info.offset:info.offset + info.length])
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise ValueError(f"{path}: {req.storage_index.fqn} holds {tuple(tensor.size())}, the "
                                         f"state has {tuple(target.size())}")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
            done: Future[None] = Future()
            done.set_result(None)
            return done

    try:
        state_dict_loader.load(template, storage_reader=Verified(str(directory)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: the tier loop would not see it
        causes = "; ".join(f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()) or str(exc)
        raise ValueError(f"{directory}: dcp load failed: {causes}") from exc
    return template


__all__ = ["DCP_METADATA", "check_template", "data_file", "load_dcp", "safe_metadata", "save_dcp"]
