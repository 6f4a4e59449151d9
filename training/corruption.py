"""What a restore counts as corruption, and what it does not.

A copy is **corrupt** only when a file does not match the catalog's size or CRC32C
(:func:`verify_files` raises :class:`CorruptCopy`), or arrived so from another node: it is recorded
corrupt and the next copy is read. A copy that cannot be read *now* (its node unreachable, a memory
snapshot a newer one replaced, an I/O error) is skipped (:class:`SkippedCopy`), never recorded. A load
that fails after every file checked out (a tensor of another shape, an unpickling or DCP planner
error, a torch-format step of another world size) is :class:`IncompatibleCheckpoint`: the bytes are
the committed ones, so nothing is recorded corrupt, no step is invalidated, nothing is deleted, and
the error names the step, rank and tensor. :mod:`.restore` and :mod:`.reshard` both classify by these.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ftd.storage_backends.base import crc32c_file, crc32c_mapped

Expected = Mapping[str, tuple[int, str]]  # file name -> (size, crc32c), from the catalog


class RestoreError(RuntimeError):
    pass


class IncompatibleCheckpoint(RestoreError):
    """A verified copy (every file matched the catalog) that this rank's state cannot take: a tensor
    of another shape, an unpickling or DCP planner error, a torch-format step of another world size.
    Raised on every rank (the ranks agree on it), never recorded as corruption: the job's code or
    configuration must change, not the checkpoint."""

    def __init__(self, why: str, *, step: int = -1, rank: int = -1, tensor: str = "", source: str = "") -> None:
        self.why, self.step, self.rank, self.source = why, step, rank, source
        self.tensor = tensor or _tensor_named(why)
        where = [f"step {step}" if step >= 0 else "", f"rank {rank}" if rank >= 0 else "",
                 f"tensor {self.tensor!r}" if self.tensor else "", f"copy {source}" if source else ""]
        super().__init__(f"{', '.join(w for w in where if w)}: {why}" if any(where) else why)

    def at(self, step: int, rank: int, source: str) -> IncompatibleCheckpoint:
        """This error with where it happened."""
        return IncompatibleCheckpoint(self.why, step=step, rank=rank, tensor=self.tensor, source=source)


class CorruptCopy(ValueError):
    """A file of a copy does not match the catalog's size or CRC32C, or it arrived so: the one proof of
    corruption (the copy is recorded corrupt and the next one read)."""


class SkippedCopy(Exception):
    """A copy that could not be read now (its node unreachable, or it is not there): skipped, not
    recorded corrupt."""


def _tensor_named(why: str) -> str:
    """The tensor a DCP or torch load error names, best effort ("" when none)."""
    for pattern in (r"Missing key in checkpoint state_dict: ([\w.\-\[\]]+?)\.?(?:\s|$)",
                    r"\bfor ([\w.\-\[\]]+?)\.?(?:\s|$|;)", r"\bfqn[= ]'?([\w.\-\[\]]+)",
                    r": ([\w.\-\[\]]+) holds \("):
        found = re.search(pattern, why)
        if found:
            return found.group(1)
    return ""


def verify_files(directory: Path, expected: Expected, *, checked: bool = False, in_memory: bool = False) -> None:
    """Every file the catalog lists has its size and CRC32C (``checked``: the CRC32Cs were checked as
    the bytes landed, only the sizes are checked again; ``in_memory``: hashed mapped). A mismatch is
    :class:`CorruptCopy`; a missing file raises ``FileNotFoundError`` (a memory snapshot replaced
    since, or a durable copy damaged: the caller tells)."""
    for name, (size, crc) in expected.items():
        path = directory / name
        actual_size = path.stat().st_size
        if actual_size != size:
            raise CorruptCopy(f"{path}: {actual_size} bytes, the catalog says {size}")
        if not checked and (actual := (crc32c_mapped if in_memory else crc32c_file)(path)) != crc:
            raise CorruptCopy(f"{path}: crc32c {actual}, the catalog says {crc}")


@dataclass
class Missed:
    """Why no copy of a shard could be read: proven corrupt (``problems``), or not now (``skipped``)."""

    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


__all__ = ["CorruptCopy", "Expected", "IncompatibleCheckpoint", "Missed", "RestoreError", "SkippedCopy",
           "crc32c_mapped", "verify_files"]
