"""The invariants every chaos scenario is judged by, as pure functions of what the cluster recorded:
the coordinator's event log (kept in etcd), the checkpoint catalog before and after the fault, and
the training job's own step log. Each returns a :class:`Check` with a reason, so a failing scenario
says which promise broke and where.

* epochs strictly increase, and no epoch is committed twice (never two worlds in one epoch);
* no valid checkpoint is lost except by retention (the newest ``keep`` valid steps per tier stay);
* training resumes at a step >= the newest step restorable before the fault;
* no node outside the fault is declared dead;
* the job finishes.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]  # seq, at_unix_s, kind, node_id, epoch, message (ListEvents as JSON)
Record = Mapping[str, Any]  # one line of the demo job's log: t, event, step, restored_step, ...


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def epochs_increase(events: Iterable[Event]) -> Check:
    """Every committed epoch (``epoch_changed``, in log order) is greater than the one before, and
    no epoch appears twice: two worlds in one epoch would be a split brain."""
    seen: list[int] = [int(e["epoch"]) for e in sorted(events, key=lambda e: int(e["seq"]))
                       if e["kind"] == "epoch_changed"]
    for before, after in itertools.pairwise(seen):
        if after == before:
            return Check("one_world_per_epoch", False, f"epoch {after} was committed twice")
        if after < before:
            return Check("one_world_per_epoch", False, f"epoch went back from {before} to {after}")
    return Check("one_world_per_epoch", True, f"{len(seen)} epoch change(s), strictly increasing")


def no_valid_checkpoint_lost(valid_before: Collection[int], valid_after: Collection[int], keep: int = 3) -> Check:
    """A step valid before the fault may be gone afterwards only if retention removed it: it is
    older than every one of the ``keep`` newest valid steps after."""
    newest = sorted(valid_after)[-keep:]
    floor = newest[0] if len(newest) == keep else None
    lost = sorted(s for s in valid_before if s not in valid_after and (floor is None or s > floor))
    if lost:
        return Check("no_valid_checkpoint_lost", False, f"valid step(s) {lost} disappeared (newest after: {newest})")
    return Check("no_valid_checkpoint_lost", True, f"valid before {sorted(valid_before)[-keep:]}, after {newest}")


def resumed_at_or_after(records: Iterable[Record], fault_unix: float, restorable_before: int) -> Check:
    """Every (re)start after the fault restored a step >= the newest one restorable before it."""
    starts = [r for r in records if r.get("event") == "start" and float(r["t"]) >= fault_unix]
    if not starts:
        return Check("resumed_from_newest", True, "no restart after the fault (the job was not interrupted)")
    low = min(int(r["restored_step"]) for r in starts)
    if low < restorable_before:
        return Check("resumed_from_newest", False,
                     f"a rank restored step {low} but step {restorable_before} was restorable before the fault")
    return Check("resumed_from_newest", True, f"restored step {low} >= {restorable_before}")


def only_faulted_declared_dead(events: Iterable[Event], after_seq: int, faulted: Collection[str]) -> Check:
    """Nodes declared dead after ``after_seq`` are all among ``faulted``: a fault elsewhere (etcd, a
    link, the leader) must never cost a healthy node its rank."""
    wrong = sorted({str(e["node_id"]) for e in events if int(e["seq"]) > after_seq and e["kind"] == "node_dead"
                    and e["node_id"] not in faulted})
    if wrong:
        return Check("no_false_death", False, f"declared dead outside the fault: {', '.join(wrong)}")
    return Check("no_false_death", True, f"only {sorted(faulted) or 'no node'} could be declared dead")


def no_false_straggler_replacement(events: Iterable[Event], after_seq: int, faulted: Collection[str]) -> Check:
    """No node outside the fault was drained as a straggler: a failure elsewhere (a death, a
    partition, a slow disk) must not make the straggler watch act on a healthy node."""
    wrong = sorted({str(e["node_id"]) for e in events if int(e["seq"]) > after_seq and e["kind"] == "drain_requested"
                    and "straggler" in str(e.get("message", "")) and e["node_id"] not in faulted})
    if wrong:
        return Check("no_false_straggler", False, f"drained as stragglers outside the fault: {', '.join(wrong)}")
    return Check("no_false_straggler", True, "no healthy node drained as a straggler")


def no_false_rollback(events: Iterable[Event], after_seq: int, expected: bool) -> Check:
    """No rollback outside a scenario that injects a bad step: every scenario runs with
    ``anomaly_action=rollback``, so a false step anomaly (a loss after a restore, a slow step) would
    roll the job back, not only alert."""
    got = [str(e.get("message", "")) for e in events if int(e["seq"]) > after_seq
           and e["kind"] in ("rollback", "rollback_budget_spent")]
    if got and not expected:
        return Check("no_false_rollback", False, f"rolled back without a bad step: {got[:3]}")
    return Check("no_false_rollback", True, f"{len(got)} rollback(s)" + (" (the scenario's bad step)" if got else ""))


def job_finished(records: Iterable[Record], last_step: int) -> Check:
    done = [r for r in records if r.get("event") == "done"]
    if not done:
        steps = [int(r["step"]) for r in records if r.get("event") == "step"]
        return Check("job_finished", False, f"no rank finished (last step seen {max(steps, default=-1)} of "
                                            f"{last_step})")
    return Check("job_finished", True, f"{len(done)} rank(s) finished at step {last_step}")


def summary(checks: Sequence[Check]) -> tuple[bool, dict[str, bool], str]:
    """(all passed, {name: ok}, the failing details joined)."""
    failing = "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.ok)
    return all(c.ok for c in checks), {c.name: c.ok for c in checks}, failing
