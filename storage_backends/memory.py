"""The memory tier: checkpoint shards held in RAM, in a tmpfs directory owned by the node's agent.

A memory snapshot is a shard folder like on any tier (``<job>/step-…/rank-…/`` + ``SHARD.json``
published last), written through the same :class:`~.base.Staging` protocol: :class:`MemoryTier` is a
:class:`~.local.LocalBackend` on a tmpfs directory (default ``/dev/shm/ftd/<node_id>``), so it passes
the same storage contract. The files belong to no process: a snapshot survives a crash of the
training process that wrote it, and reading it back is a page-cache ``mmap``. The agent replicates
each snapshot to its buddy's memory tier (``ftd.agent.replicator``).

Two rules keep it from ever taking the node down, both owned here:

* **At most :data:`KEEP` (2) snapshots per rank** on one node (:func:`evictions`, the one place
  the rule is written): before a new one is written the oldest go (:meth:`MemoryTier.make_room`),
  so a rank holds the newest complete snapshot and the one being written. The catalog mirrors the
  rule on its records (:func:`ftd.checkpoints.catalog.prune_memory`), and a buddy does not take a
  replica the rule would drop at once (:func:`superseded`).
* **A byte budget** (``capacity_bytes``, default a quarter of the node's memory): a write that would
  exceed it, or the filesystem's free space, is refused *before* a byte is written with
  :class:`MemoryFull`, naming the sizes; the training goes on (the refusal is reported and counted)
  and nothing is ever allocated past the budget, so the memory tier cannot cause an OOM.

Used by both sides: the training process before a memory snapshot, the agent before accepting a
buddy's replica.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection, Iterable
from pathlib import Path

from ftd.checkpoints.layout import MANIFEST, check_job, shard_prefix

from .base import StorageError, StorageFull, crc32c_mapped
from .local import LocalBackend

NAME = "mem"  # the memory tier's name among a node's tiers (TierSpec.name)
KEEP = 2  # snapshots held per rank on one node: the newest and the one being written
DEFAULT_ROOT = Path("/dev/shm/ftd")
DEFAULT_FRACTION = 0.25  # of MemTotal: the default budget of the memory tier
_STEP = re.compile(r"step-([0-9]{12})")


class MemoryFull(StorageFull):
    """Holding one more snapshot would exceed the memory tier's budget (or its filesystem's free
    space); refused before anything was written."""


def evictions(held: Iterable[int], incoming: int, keep: int = KEEP) -> list[int]:
    """The keep rule: when a snapshot of ``incoming`` comes in, a rank keeps it and the newest
    ``keep - 1`` of its other steps ``held``; the rest go. Returns those, oldest first (``incoming``
    itself, if held, is replaced, never listed)."""
    others = sorted({s for s in held if s != incoming})
    return others[:max(0, len(others) - (keep - 1))]


def superseded(held: Collection[int], incoming: int, keep: int = KEEP) -> bool:
    """A copy pushed from elsewhere (a buddy's replica) of a step not held, older than ``keep`` held
    ones: the newest ``keep`` are what the rule keeps, so it would be the first to go."""
    return incoming not in held and sum(1 for s in held if s > incoming) >= keep


def default_capacity(meminfo: Path = Path("/proc/meminfo"), fraction: float = DEFAULT_FRACTION) -> int:
    """``fraction`` of the node's memory (MemTotal); 0 (no budget but the filesystem's) when unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(int(line.split()[1]) * 1024 * fraction)
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemoryTier(LocalBackend):
    """The memory tier's directory, its byte budget (``capacity_bytes``; 0: only the filesystem's
    free space) and its keep rule."""

    def __init__(self, root: Path | str, capacity_bytes: int = 0) -> None:
        super().__init__(root)
        if capacity_bytes < 0:
            raise ValueError(f"memory tier {root}: capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes

    @staticmethod
    def hash_file(path: Path) -> str:
        """From the mapped tmpfs pages: a snapshot's staging hash costs 0.036 CPU-s per 256 MiB
        here, against 0.07-0.10 through buffered reads (the snapshot's budget is a step's 10 %)."""
        return crc32c_mapped(path)

    def create(self) -> None:
        """Makes the directory, owner only: the snapshots are the job's state."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)

    def used_bytes(self) -> int:
        """Bytes held in the directory (every file: snapshots, replicas, staging, peer copies)."""
        total = 0
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue  # deleted meanwhile
        return total

    def snapshots(self, job: str, rank: int) -> list[int]:
        """The published steps of ``rank`` of ``job`` held here, oldest first."""
        steps = []
        base = self.root / check_job(job)
        try:
            entries = list(os.scandir(base))
        except OSError:
            return []
        for entry in entries:
            m = _STEP.fullmatch(entry.name)
            if m and (Path(entry.path) / f"rank-{rank:05d}" / MANIFEST).is_file():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def make_room(self, job: str, rank: int, step: int, pinned: Collection[int] = ()) -> list[int]:
        """Deletes what :func:`evictions` says goes before ``step`` of (``job``, ``rank``) is written;
        a published folder of ``step`` itself (another timeline's) goes too. Steps in ``pinned``
        (still being copied to the SSD) stay. Returns the steps deleted."""
        prefix = shard_prefix(job, step, rank)
        if (self.root / prefix).exists():
            self.delete_prefix(prefix, marker_name=MANIFEST)
        deleted = []
        for old in evictions(self.snapshots(job, rank), step):
            if old in pinned:
                continue
            self.delete_prefix(shard_prefix(job, old, rank), marker_name=MANIFEST)
            deleted.append(old)
        return deleted

    def check_capacity(self, incoming: int, what: str) -> None:
        """Raises :class:`MemoryFull` when ``incoming`` more bytes would exceed the budget or the
        filesystem's free space; the message names every size."""
        used = self.used_bytes()
        try:
            free = shutil.disk_usage(self.root).free
        except OSError as exc:
            raise StorageError(self.name, "", f"cannot measure the memory tier: {exc}") from exc
        if self.capacity_bytes and used + incoming > self.capacity_bytes:
            raise MemoryFull(self.name, "", (
                f"memory tier full: {what} needs {_size(incoming)}, {_size(used)} of its "
                f"{_size(self.capacity_bytes)} budget are held (at most {KEEP} snapshots per rank; raise "
                "mem_capacity_bytes or snapshot less often); refused, nothing written"))
        if incoming > free:
            raise MemoryFull(self.name, "", (
                f"memory tier full: {what} needs {_size(incoming)}, its filesystem has {_size(free)} free "
                f"({_size(used)} held by the tier); refused, nothing written"))

    def admit(self, job: str, rank: int, step: int, incoming: int, what: str,
              pinned: Collection[int] = ()) -> list[int]:
        """Makes room for a new snapshot of (``job``, ``rank``) at ``step`` (:meth:`make_room`) and
        checks its ``incoming`` bytes against the budget (:meth:`check_capacity`). Returns the steps
        deleted."""
        self.root.mkdir(parents=True, exist_ok=True)
        deleted = self.make_room(job, rank, step, pinned)
        self.check_capacity(incoming, what)
        return deleted


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


__all__ = ["DEFAULT_ROOT", "KEEP", "NAME", "MemoryFull", "MemoryTier", "default_capacity", "evictions",
           "superseded"]
