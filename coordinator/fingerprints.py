"""Replica fingerprints compared across a data-parallel world, as pure decisions.

Every N steps each rank reports a checksum of its parameters (ftd.training.replica_fingerprint);
replicas must agree bit for bit. :func:`compare` judges one step once every rank of the world
reported it; :func:`confirmed` says when a disagreement is a silent data corruption to act on:

* **A majority names the suspect**: the ranks outside a strict majority value are the suspects.
  Without a majority (two replicas, or every rank different) nobody can be blamed: the job is rolled
  back, nobody is fenced.
* **A confirming recheck**: a flipped bit in a parameter stays flipped (DDP never re-broadcasts the
  parameters), so the same ranks disagree again at the next fingerprint step; a transient misread of
  one report does not. Action needs ``confirmations`` disagreeing comparisons in a row, each with
  the same suspects.
* **Never on state that is not replicated**: a job whose replicas never agreed in this round (FSDP
  or TP shards fingerprinted by mistake) gets an alert, not a fence.
* **Before the disagreement**: the first suspect step is the one after the newest comparison where
  every replica agreed; the rollback restores a checkpoint before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    step: int
    agreed: bool
    dissent: tuple[int, ...]  # ranks outside the majority (empty: agreed, or no majority)
    majority: bool  # a strict majority value exists
    reason: str


@dataclass(frozen=True)
class Finding:
    ranks: tuple[int, ...]  # to fence (empty: no majority: roll back only)
    first_bad: int  # the first step whose checkpoints are suspect
    reason: str


def compare(values: Mapping[int, int], world_size: int, step: int) -> Comparison | None:
    """One step's fingerprints by rank; None until every rank of ``world_size`` reported."""
    if world_size < 1 or len(values) < world_size:
        return None
    counts = Counter(values.values())
    value, most = counts.most_common(1)[0]
    if len(counts) == 1:
        return Comparison(step, True, (), True, f"step {step}: the {world_size} replicas agree")
    if 2 * most > world_size:
        dissent = tuple(sorted(r for r, v in values.items() if v != value))
        return Comparison(step, False, dissent, True,
                          f"step {step}: rank(s) {', '.join(map(str, dissent))} disagree with the other "
                          f"{most} replica(s)")
    return Comparison(step, False, (), False,
                      f"step {step}: the {world_size} replicas disagree with no majority ({len(counts)} values)")


def confirmed(history: Sequence[Comparison], confirmations: int) -> tuple[Finding | None, str]:
    """Whether the newest comparisons (of one job round, oldest first) call for action, and why."""
    if not history or history[-1].agreed:
        return None, "the replicas agree"
    agreed = [c.step for c in history if c.agreed]
    if not agreed:
        return None, ("the replicas never agreed in this round: not replicated state (fingerprints are for "
                      "data-parallel replicas); alerted only")
    recent = list(history[-confirmations:])
    if len(recent) < confirmations or any(c.agreed for c in recent):
        return None, f"{history[-1].reason}; waiting for a confirming recheck ({confirmations} in a row)"
    if len({(c.dissent, c.majority) for c in recent}) != 1:
        return None, f"{history[-1].reason}; the suspects changed between rechecks"
    first_bad = max(agreed) + 1
    last = recent[-1]
    who = (f"rank(s) {', '.join(map(str, last.dissent))} disagree with the majority" if last.majority
           else "the replicas disagree with no majority")
    return Finding(last.dissent, first_bad,
                   f"silent data corruption: {who} at steps {', '.join(str(c.step) for c in recent)} (they agreed "
                   f"at step {first_bad - 1})"), "act"


__all__ = ["Comparison", "Finding", "compare", "confirmed"]
