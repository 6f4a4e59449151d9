"""The training side of a planned hand-over (a spot preemption notice, ``ftctl drain``): every rank
stops at the same step, saves a final checkpoint and waits for the new world, so no step is lost.

The agent says a hand-over is pending in its answer to each ``report_step``; ranks learn it at
slightly different steps, so :func:`agree_any` makes the decision collective (one 8-byte all-reduce
per step, on the device the default process group uses). Without ``torch.distributed`` the rank's
own flag decides.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("ftd.training.handover_stop")


def agree_any(flag: bool) -> bool:
    """True on every rank when it is true on any rank (the same answer at the same step)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class HandoverFlag:
    """The latest "hand-over pending" answer of the agent, written by ``report_step`` and read by
    ``should_stop`` (possibly another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = False
        self.reason = ""
        self.parked = threading.Event()  # set once this rank saved its final checkpoint

    def update(self, pending: bool, reason: str) -> None:
        with self._lock:
            if pending and not self._pending:
                log.warning("the agent reports a planned hand-over: %s", reason or "no reason given")
            self._pending, self.reason = pending, reason

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._pending
