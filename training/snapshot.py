"""Snapshot of a state dict into host memory — the only part of a save the training loop waits for.

The state may be what torch's own helpers give for a sharded job: DTensor values (FSDP2's
``fully_shard``, tensor parallel), ShardedTensor values, and DCP ``Stateful`` objects (anything with
``state_dict()``/``load_state_dict()``: an ``AppState`` around ``get_state_dict(model, optim)``, a
module, a data loader), whose ``state_dict()`` is called and snapshotted, as ``dcp.save`` does. A
DTensor's *local* shard is copied (``to_local()``, never the global tensor) and the copy is wrapped
again with the original placements, device mesh and global shape, so that ``dcp.save`` of the snapshot
writes what ``dcp.save`` of the live state would write (a checkpoint DCP can reshard later).

The buffers live in one arena kept between saves and laid out again only when the state's shapes
change: copying into memory already mapped runs at memory bandwidth (0.12 s per GiB here) where a
fresh allocation pays a page fault per 4 KiB (1.6 s per GiB; 5-9 s stalls at 455 MB per rank under
load). :meth:`Snapshotter.prepare` (or :meth:`Snapshotter.reserve`, before the shapes are known, e.g.
in a standby's ``prepare()``) allocates and touches the arena ahead, so no save stalls on allocation.
Copying with two threads was measured no faster (memory bandwidth is the limit). GPU tensors go to a
pinned arena with non-blocking copies and one synchronisation at the end.

Each buffer is a tensor with a storage of its own over its slice of the arena (a slice of an
``UntypedStorage`` shares its memory and keeps it alive), not a view of the arena's storage:
``torch.save`` and DCP's writer write a tensor's whole storage, so both cloned every view first
(256 MiB copied into fresh memory per snapshot: a third of the save's CPU time).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("ftd.training.checkpoint")
ALIGN = 64  # bytes: every buffer starts on a cache line (and on any dtype's alignment)


def is_stateful(obj: Any) -> bool:
    """DCP's ``Stateful`` protocol (``state_dict`` and ``load_state_dict``), as DCP itself checks it;
    modules and optimizers are Stateful too."""
    return not isinstance(obj, (dict, list, tuple, torch.Tensor)) and callable(getattr(obj, "state_dict", None)) \
        and callable(getattr(obj, "load_state_dict", None))


def _dist_types() -> tuple[Any, Any] | None:
    """(DTensor, ShardedTensor), or ``None`` where torch.distributed is not built in."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    return DTensor, ShardedTensor


def resolve(state: Any) -> Any:
    """``state`` with every Stateful replaced by its ``state_dict()`` (recursively): what gets saved."""
    if is_stateful(state):
        return resolve(state.state_dict())
    if isinstance(state, dict):
        return type(state)((k, resolve(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(resolve(v) for v in state)
    return state


def local_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, the tensor this rank holds) for every tensor of a resolved state: a DTensor's local
    shard, each local shard of a ShardedTensor, a plain tensor itself."""
    types = _dist_types()
    if isinstance(obj, torch.Tensor):
        obj = _any(obj)  # a DTensor or ShardedTensor below: their methods are not the Tensor stub's
        if types is not None and isinstance(obj, types[0]):
            yield path, obj.to_local().detach()
        elif types is not None and isinstance(obj, types[1]):
            for i, shard in enumerate(obj.local_shards()):
                yield f"{path}#{i}", shard.tensor.detach()
        else:
            yield path, obj.detach()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from local_tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from local_tensors(v, f"{path}/{i}")


def owning_storages(obj: Any) -> Any:
    """``obj`` with every plain tensor that is a view into a larger storage (the arena) cloned into
    storage of its own. ``torch.save`` writes a tensor's whole storage, so a snapshot saved as it is
    would write the whole arena once per file — its unused tail and every other tensor of a larger
    earlier layout included (a 80 KB state written as 3.9 MB after a 4 MB one). DCP's writer does the
    same clone for the same reason; the dcp path needs nothing here."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        t = obj.detach()
        return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
    if isinstance(obj, dict):
        return type(obj)((k, owning_storages(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [owning_storages(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _any(obj: torch.Tensor) -> Any:
    return obj


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Snapshotter:
    """Copies states into its arena (see the module docstring); one snapshot at a time."""

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None  # uint8, every page touched
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        self._buffers: dict[str, torch.Tensor] = {}
        self.last_alloc_s = 0.0  # time the latest snapshot spent allocating (0 once the arena fits)
        self._warned = False

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the latest snapshot's tensors (what the shard will hold, framing aside)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def reserved_bytes(self) -> int:
        """The arena's size: what a snapshot can hold without allocating."""
        return 0 if self._arena is None else self._arena.numel()

    def reserve(self, nbytes: int, pin: bool = False) -> float:
        """Makes the arena at least ``nbytes`` (every page touched now); returns the seconds it took.
        ``pin``: page-locked, for copies from a GPU."""
        if self._arena is not None and self._arena.numel() >= nbytes and (self._arena.is_pinned() or not pin):
            return 0.0
        started = time.perf_counter()
        self._arena = None  # the old one goes first: never both at once
        self._layout, self._buffers = (), {}
        arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        arena.zero_()  # the page faults now, not during a save
        self._arena = arena
        return time.perf_counter() - started

    def prepare(self, state: Any) -> int:
        """Lays out the buffers for ``state`` (its Stateful objects' ``state_dict()`` is called) and
        allocates them now; returns their bytes."""
        self._fit(list(local_tensors(resolve(state))))
        return self.buffer_bytes

    def snapshot(self, state: Any) -> Any:
        """A copy of ``state`` (Stateful objects resolved) whose tensors live in this snapshotter's
        buffers. The result is valid until the next call (the buffers are reused)."""
        resolved = resolve(state)
        self.last_alloc_s = self._fit(list(local_tensors(resolved)))
        if self.last_alloc_s > 0.1 and not self._warned:
            self._warned = True
            log.warning("a save allocated its snapshot buffers (%.1f MB in %.2fs); Checkpointer.prepare(state) "
                        "allocates them ahead", self.buffer_bytes / 1e6, self.last_alloc_s)
        cuda = [False]
        out = self._copy(resolved, "", cuda, _dist_types())
        if cuda[0]:
            torch.cuda.synchronize()
        return out

    def _fit(self, leaves: list[tuple[str, torch.Tensor]]) -> float:
        """The buffers laid out for ``leaves`` (again only when their shapes changed; the arena
        grown only when they no longer fit); returns the seconds spent allocating."""
        layout = tuple((p, tuple(t.shape), t.dtype) for p, t in leaves)
        if layout == self._layout:
            return 0.0
        need = sum(_aligned(t.numel() * t.element_size()) for _, t in leaves)
        pin = any(t.is_cuda for _, t in leaves)
        took = self.reserve(need, pin=pin)
        assert self._arena is not None
        memory = self._arena.untyped_storage()  # its slices are storages of their own (module docstring)
        buffers: dict[str, torch.Tensor] = {}
        offset = 0
        for path, t in leaves:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                buffers[path] = torch.empty(t.shape, dtype=t.dtype)
                continue
            buffers[path] = torch.empty(0, dtype=t.dtype).set_(memory[offset:offset + nbytes]).view(t.shape)
            offset += _aligned(nbytes)
        self._layout, self._buffers = layout, buffers
        return took

    def _copy(self, obj: Any, path: str, cuda: list[bool], types: tuple[Any, Any] | None) -> Any:
        if isinstance(obj, torch.Tensor):
            obj = _any(obj)
            if types is not None and isinstance(obj, types[0]):  # DTensor: the local shard, same spec
                buf = self._fill(path, obj.to_local().detach(), cuda)
                return types[0](buf, obj._spec, requires_grad=False)
            if types is not None and isinstance(obj, types[1]):  # ShardedTensor: each local shard
                from torch.distributed._shard.sharded_tensor.shard import Shard

                shards = [Shard(self._fill(f"{path}#{i}", s.tensor.detach(), cuda), s.metadata)
                          for i, s in enumerate(obj.local_shards())]
                return types[1]._init_from_local_shards_and_global_metadata(
                    shards, obj.metadata(), process_group=obj._process_group)
            return self._fill(path, obj.detach(), cuda)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, f"{path}/{k}", cuda, types)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}/{i}", cuda, types) for i, v in enumerate(obj)]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return copy.deepcopy(obj)

    def _fill(self, path: str, src: torch.Tensor, cuda: list[bool]) -> torch.Tensor:
        buf = self._buffers[path]
        if src.is_cuda:
            cuda[0] = True
        buf.copy_(src, non_blocking=src.is_cuda)
        return buf
