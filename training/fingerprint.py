"""Replica fingerprints: an exact checksum of a rank's parameters, for data-parallel jobs.

Replicas of a data-parallel job hold bit-identical parameters after every step (DDP all-reduces the
gradients; every rank applies the same update). A silent data corruption (a flipped bit in a GPU's
memory or a wrong result from a faulty ALU) makes one replica differ, and nothing else notices: the
loss stays plausible while the corrupted rank's gradients leak into every update. Every N steps
each rank reports :func:`replica_fingerprint` through ``Checkpointer.report_step(fingerprint=...)``;
the coordinator compares them (coordinator/fingerprints.py), and a rank that disagrees with the
majority twice in a row is fenced and the job rolled back to before the disagreement.

Only for replicated state: FSDP/TP shards differ by design (compare within a replica group instead).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

MASK = (1 << 63) - 1
CHUNK = 1 << 22  # bytes per step of the sum: bounds the int64 temporaries (8 bytes per byte hashed)
_PRIME = 1_000_003


def replica_fingerprint(params: Iterable[torch.Tensor]) -> int:
    """A 63-bit checksum of the parameters' bytes, in order: any single flipped bit changes it (each
    byte is weighted by its position, modulo a prime, so no flip cancels). A DTensor contributes its
    local shard. Costs one pass over the parameters on their device."""
    total = 0
    for index, tensor in enumerate(params):
        t = tensor.detach()
        if hasattr(t, "to_local"):
            t = t.to_local()
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        part = 0
        for start in range(0, raw.numel(), CHUNK):
            chunk = raw[start:start + CHUNK].to(torch.int64)
            weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
            part += int((chunk * (weights % _PRIME + 1)).sum())
        total = (total * 1_000_033 + part + index + 1) & MASK
    return total


__all__ = ["replica_fingerprint"]
