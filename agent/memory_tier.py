"""The memory tier: checkpoint shards held in RAM, in a tmpfs directory owned by the node's agent.

A memory snapshot is a shard folder like on any tier (``<job>/step-…/rank-…/`` + ``SHARD.json``
published last), written through the same :class:`~ftd.storage_backends.base.Staging` protocol into
a directory on tmpfs (default ``/dev/shm/ftd/<node_id>``): the files belong to no process, so a
snapshot survives a crash of the training process that wrote it, and reading it back is a page-cache
``mmap``. The agent replicates each snapshot to its buddy's memory tier (:mod:`.replicator`).

Two rules keep it from ever taking the node down:

* **At most :data:`KEEP` (2) snapshots per rank** on one node: before a new one is written the
  oldest are deleted (:func:`make_room`), so a rank holds the newest complete snapshot and the one
  being written. The catalog applies the same rule to its records
  (:func:`ftd.checkpoints.catalog.prune_memory`).
* **A byte budget** (``capacity_bytes``, default a quarter of the node's memory): a write that would
  exceed it, or the filesystem's free space, is refused *before* a byte is written with
  :class:`MemoryFull`, naming the sizes; the training goes on (the refusal is reported and counted)
  and nothing is ever allocated past the budget, so the memory tier cannot cause an OOM.

Used by both sides: the training process (:class:`ftd.training.Checkpointer`) before a memory
snapshot, the agent before accepting a buddy's replica.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path

from ftd.checkpoints.catalog import MEM_KEEP
from ftd.checkpoints.layout import MANIFEST, check_job, shard_prefix
from ftd.storage_backends.base import StorageBackend, StorageError, StorageFull

log = logging.getLogger("ftd.agent.memory_tier")

KEEP = MEM_KEEP
DEFAULT_ROOT = Path("/dev/shm/ftd")
DEFAULT_FRACTION = 0.25  # of MemTotal: the default budget of the memory tier
_STEP = re.compile(r"step-([0-9]{12})")


class MemoryFull(StorageFull):
    """Holding one more snapshot would exceed the memory tier's budget (or its filesystem's free
    space); refused before anything was written."""


def default_capacity(meminfo: Path = Path("/proc/meminfo"), fraction: float = DEFAULT_FRACTION) -> int:
    """``fraction`` of the node's memory (MemTotal); 0 (no budget but the filesystem's) when unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(int(line.split()[1]) * 1024 * fraction)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def used_bytes(root: Path) -> int:
    """Bytes held under ``root`` (every file: snapshots, replicas, staging, peer copies)."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # deleted meanwhile
    return total


def snapshots(root: Path, job: str, rank: int) -> list[int]:
    """The published steps of ``rank`` of ``job`` on the memory tier at ``root``, oldest first."""
    steps = []
    base = root / check_job(job)
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        m = _STEP.fullmatch(entry.name)
        if m and (Path(entry.path) / f"rank-{rank:05d}" / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def make_room(backend: StorageBackend, root: Path, job: str, rank: int, step: int, keep: int = KEEP,
              pinned: Collection[int] = ()) -> list[int]:
    """Deletes the oldest published snapshots of (``job``, ``rank``) so that writing ``step`` leaves
    at most ``keep``; a published folder of ``step`` itself (another timeline's) goes too. Steps in
    ``pinned`` (still being copied to the SSD) are not deleted. Returns the steps deleted."""
    held = [s for s in snapshots(root, job, rank) if s != step]
    deleted = []
    if (root / shard_prefix(job, step, rank)).exists():
        backend.delete_prefix(shard_prefix(job, step, rank), marker_name=MANIFEST)
    for old in held[:max(0, len(held) - (keep - 1))]:
        if old in pinned:
            continue
        backend.delete_prefix(shard_prefix(job, old, rank), marker_name=MANIFEST)
        deleted.append(old)
    return deleted


def check_capacity(root: Path, capacity_bytes: int, incoming: int, what: str) -> None:
    """Raises :class:`MemoryFull` when ``incoming`` more bytes would exceed ``capacity_bytes`` (0: no
    budget) or the free space of the filesystem holding ``root``; the message names every size."""
    used = used_bytes(root)
    try:
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise StorageError(f"local:{root}", "", f"cannot measure the memory tier: {exc}") from exc
    if capacity_bytes and used + incoming > capacity_bytes:
        raise MemoryFull(f"local:{root}", "", (
            f"memory tier full: {what} needs {_size(incoming)}, {_size(used)} of its {_size(capacity_bytes)} "
            f"budget are held (at most {KEEP} snapshots per rank; raise mem_capacity_bytes or snapshot less "
            "often); refused, nothing written"))
    if incoming > free:
        raise MemoryFull(f"local:{root}", "", (
            f"memory tier full: {what} needs {_size(incoming)}, its filesystem has {_size(free)} free "
            f"({_size(used)} held by the tier); refused, nothing written"))


def admit(backend: StorageBackend, root: Path, capacity_bytes: int, job: str, rank: int, step: int,
          incoming: int, what: str, pinned: Collection[int] = ()) -> list[int]:
    """Makes room for a new snapshot of (``job``, ``rank``) at ``step`` (the oldest go first, see
    :func:`make_room`) and checks its ``incoming`` bytes against the budget (:func:`check_capacity`).
    Returns the steps deleted."""
    root.mkdir(parents=True, exist_ok=True)
    deleted = make_room(backend, root, job, rank, step, KEEP, pinned)
    check_capacity(root, capacity_bytes, incoming, what)
    return deleted


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


__all__ = ["DEFAULT_ROOT", "KEEP", "MemoryFull", "admit", "check_capacity", "default_capacity", "make_room",
           "snapshots", "used_bytes"]
