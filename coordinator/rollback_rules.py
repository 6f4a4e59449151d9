"""Rolling a job back past a bad step, as pure decisions over the job's state and its catalog.

A NaN, a loss spike or a silent data corruption poisons every later step and every later checkpoint:
resuming from the newest checkpoint resumes the fault. With ``anomaly_action = "rollback"`` the
leader answers a step anomaly (agent/step_anomalies.py, one report per incident) with
:func:`rollback_due`:

* **Once per incident**: an anomaly carries the job round its rank trained in; one from a round the
  job has left (the old timeline's ranks, still reporting until they are aborted) and the one a
  rollback already answered (a new leader reads the same report again) change nothing.
* **Gathered**: a NaN on one rank reaches every rank through the next all-reduce, so the other nodes
  report it a step later. The leader waits ``gather_s`` after the first report of a round (:func:`due`)
  and answers the earliest step, so that one rollback, not two, goes before the fault.
* **Never forward into the fault**: the target is the newest restorable checkpoint saved *before* the
  anomaly's step; every checkpoint at or after it is marked suspect (kept in the catalog, never
  offered). When the anomaly is the very first step after the node's ranks restored a step, the
  restored state itself produced it: the target goes before that one too.
* **A budget stops a loop**: after ``max_rollbacks`` rollbacks of a job (a fault that comes back
  every time) the next anomaly closes the job with the reason instead (as the restart budget does).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from ftd.checkpoints.catalog import CheckpointRecord

from .rendezvous import JobState

ALERT, ROLLBACK = "alert", "rollback"
FINGERPRINT = "fingerprint"  # Seen.kind of a confirmed replica disagreement (coordinator/fingerprints.py)
SUSPECT = "suspect: "  # how a suspect checkpoint's invalid_reason starts


@dataclass(frozen=True)
class RollbackConfig:
    action: str = ALERT  # "alert" (an event, the FtdStepAnomaly alert) or "rollback"
    max_rollbacks: int = 3  # per job; the next anomaly closes the job
    gather_s: float = 2.0  # after a round's first anomaly, wait this long for the other nodes' reports
    skip_batches: bool = False  # the rolled-back job skips the data of the steps up to the anomaly

    def __post_init__(self) -> None:
        if self.action not in (ALERT, ROLLBACK):
            raise ValueError(f"anomaly action must be {ALERT!r} or {ROLLBACK!r}, got {self.action!r}")
        if self.max_rollbacks < 0 or self.gather_s < 0:
            raise ValueError("anomaly max_rollbacks and gather_s must be >= 0")


@dataclass(frozen=True)
class Seen:
    """One step anomaly as the leader received it."""

    node_id: str
    step: int
    rank: int
    kind: str
    round: int | None  # the job round the rank trained in (None: an agent that does not say)
    reason: str
    at: float  # when the leader received it (monotonic seconds)
    restored: int | None = None  # the step the node's ranks restored when this world started (None: not said)

    @property
    def key(self) -> str:
        return f"{'?' if self.round is None else self.round}/{self.step}/{self.rank}/{self.kind}"


@dataclass(frozen=True)
class RollbackPlan:
    job: str
    anomaly: Seen
    target: int  # the newest step restorable before the bad one now (-1 with close); the ranks ask again
    # when they restart, and may find a newer one still before it (a memory snapshot's buddy copy landed)
    suspects: tuple[int, ...]  # checkpoints at or after the first bad step, to mark suspect
    first_bad: int  # the first step whose checkpoint is suspect
    close: bool  # the rollback budget is spent: close the job instead
    reason: str


def job_of(node_id: str, jobs: Iterable[JobState]) -> JobState | None:
    """The open job whose current round has ``node_id`` as a member."""
    return next((j for j in jobs if not j.closed and node_id in j.members), None)


def due(pending: Sequence[Seen], now: float, config: RollbackConfig) -> bool:
    """Whether the gathered anomalies are to be answered now (``gather_s`` after the first)."""
    return bool(pending) and now - min(s.at for s in pending) >= config.gather_s


def rollback_due(pending: Sequence[Seen], job: JobState, records: Iterable[CheckpointRecord], config: RollbackConfig,
                 unreachable: Collection[str] = ()) -> tuple[RollbackPlan | None, str]:
    """What to do about the anomalies gathered for ``job`` (its catalog ``records``): a plan, or
    None and why not. ``unreachable``: locations whose copies cannot be read (dead nodes)."""
    if config.action != ROLLBACK:
        return None, "anomaly_action is alert: alerted only"
    if job.closed:
        return None, f"job {job.job} is closed"
    current = [s for s in pending if s.key != job.last_rollback and (s.round is None or s.round >= job.round)]
    if not current:
        old = sorted({str(s.round) for s in pending if s.round is not None and s.round < job.round})
        return None, (f"anomalies of round(s) {', '.join(old)}, which job {job.job} has left (round {job.round})"
                      if old else "this anomaly was already rolled back")
    first = min(current, key=lambda s: (s.step, s.rank))
    first_bad = first.step
    if first.restored is not None and first.restored >= 0 and first.step == first.restored + 1:
        first_bad = first.restored  # the restored state produced the bad step at once: it is bad too
    what = first.reason if first.kind == FINGERPRINT else f"{first.kind} at step {first.step} on rank {first.rank} " \
                                                        f"({first.node_id})"
    if job.rollbacks >= config.max_rollbacks:
        return RollbackPlan(job.job, first, -1, (), first_bad, True,
                            f"rollback budget of job {job.job} exhausted: {job.rollbacks} rollbacks "
                            f"(max_rollbacks {config.max_rollbacks}); {what} again"), "close"
    records = [r for r in records if r.job == job.job]
    before = sorted(r.step for r in records if r.step < first_bad and r.valid and r.readable(unreachable))
    if not before:
        return None, f"{what}: no restorable checkpoint before step {first_bad}; cannot roll back (alerted only)"
    target = before[-1]
    suspects = tuple(sorted(r.step for r in records if r.step >= first_bad and not r.invalid_reason))
    return RollbackPlan(job.job, first, target, suspects, first_bad, False,
                        f"{what}: rolled back before step {first_bad} (restorable now: step {target}; rollback "
                        f"{job.rollbacks + 1} of {config.max_rollbacks}); steps {list(suspects)[:10] or 'none'} "
                        "suspect"), "rollback"


def suspect_reason(plan: RollbackPlan) -> str:
    a = plan.anomaly
    return (f"{SUSPECT}saved at or after step {plan.first_bad}, where {a.kind} on rank {a.rank} ({a.node_id}) "
            f"began; the job was rolled back before it")[:500]


__all__ = ["ALERT", "FINGERPRINT", "ROLLBACK", "SUSPECT", "RollbackConfig", "RollbackPlan", "Seen", "due", "job_of",
           "rollback_due", "suspect_reason"]
