"""Planned hand-over of a node's ranks (a spot preemption notice, ``ftctl drain``) as pure decisions.

Unlike a failure, a hand-over is announced: the job saves a final checkpoint first, and only then is
the new world (a spare in the leaving node's rank) committed, so no step is lost and the job's restart
budget is not charged. The notice fixes a deadline (AWS gives two minutes, GCE and Azure about 30 s):
past ``deadline - margin`` the hand-over is committed without waiting for the final checkpoint, since
a node that vanishes mid-save costs more than the steps since the last checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Drain:
    """A pending hand-over, kept in etcd until the new world is committed."""

    node_id: str
    reason: str  # e.g. "aws spot terminate notice (deadline 2026-12-01T10:00:00Z)", "ftctl drain"
    requested_unix_s: float
    deadline_unix_s: float = 0.0  # when the node goes away; 0 = no deadline (maintenance)
    baseline_step: int = -1  # the newest restorable step when the drain began (shown by ftctl)


@dataclass(frozen=True)
class HandoverPolicy:
    margin_s: float = 5.0  # commit this long before the notice's deadline at the latest
    max_wait_s: float = 60.0  # without a deadline: how long to wait for the final checkpoint

    def __post_init__(self) -> None:
        if self.margin_s < 0 or self.max_wait_s <= 0:
            raise ValueError("hand-over margin must be >= 0 and max wait > 0 seconds")


def handover_due(now_unix: float, drain: Drain, restore_step: int, has_job: bool,
                 policy: HandoverPolicy = HandoverPolicy(), parked_step: int | None = None) -> tuple[bool, str]:
    """Whether to commit the hand-over of ``drain.node_id`` now, and why.

    ``parked_step``: the step the job's ranks stopped at for the hand-over (their final checkpoint;
    -1: they parked but that save failed), None while none has parked. The hand-over waits for that
    step, not for any step newer than the drain's baseline: an ordinary snapshot committed while the
    ranks were still heading for their agreed stop step would otherwise win, and the new world would
    redo the steps between it and the stop step."""
    if not has_job:
        return True, f"no training job runs: {drain.node_id} hands over at once"
    if parked_step is not None:
        if parked_step < 0:
            return True, (f"the ranks parked but their final checkpoint failed: {drain.node_id} hands over "
                          f"from step {restore_step}")
        if restore_step >= parked_step:
            return True, f"final checkpoint at step {parked_step} is valid: {drain.node_id} hands over"
    if drain.deadline_unix_s > 0:
        left = drain.deadline_unix_s - now_unix
        if left <= policy.margin_s:
            return True, (f"{drain.node_id} goes in {max(left, 0.0):.1f}s: handing over without a final "
                          f"checkpoint (resuming from step {restore_step})")
        return False, f"waiting for the final checkpoint of {drain.node_id} ({_stop(parked_step)}, " \
                      f"{left:.1f}s before it goes)"
    waited = now_unix - drain.requested_unix_s
    if waited >= policy.max_wait_s:
        return True, (f"no final checkpoint after {waited:.0f}s: {drain.node_id} hands over from step "
                      f"{restore_step}")
    return False, f"waiting for the final checkpoint of {drain.node_id} ({_stop(parked_step)}, {waited:.1f}s so far)"


def _stop(parked_step: int | None) -> str:
    return "no rank parked yet" if parked_step is None else f"ranks parked at step {parked_step}"


def parked_step_of(steps: list[int]) -> int | None:
    """The world's parked step from what its nodes report (None: no node parked). Every rank agreed
    on one stop step (an all-reduce), so nodes differ only while some have not parked yet; a failed
    final save anywhere (-1) means the step will never be valid."""
    if not steps:
        return None
    return -1 if min(steps) < 0 else max(steps)


def encode(drain: Drain) -> bytes:
    return json.dumps(asdict(drain), sort_keys=True).encode()


def decode(raw: bytes) -> Drain:
    data: dict[str, Any] = json.loads(raw)
    return Drain(**data)


def key(node_id: str) -> str:
    return f"drains/{node_id}"
