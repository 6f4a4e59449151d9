"""A job's goodput as the leader accounts it: the share of wall time spent on training progress that
is kept (ETTR), and where the rest went, incident by incident.

A pure fold over :class:`Record` lines (a step reported, a failure committed, a round started, what the
new world restored), each carrying the leader's wall clock ``at``, so that a recorded timeline replays
to the same figures (tests/test_goodput.py) and a new leader continues from the ledger its predecessor
persisted (:func:`encode` / :func:`decode`): productive time is counted from the steps kept, not from
who watched them, so a leader failover in the middle of an incident loses nothing.

* **Productive time** = steps kept x the failure-free step time, where the steps kept are the job's
  current step minus its first (a rollback to step 9 from step 15 takes 6 steps back) and the step time
  is the median of the recent step intervals outside incidents (a checkpoint stall or a slow node is
  not a failure-free step: it shows as ``other``).
* **An incident** opens with the first failure (a node declared dead, a hand-over, a worker failure, a
  stall, a rollback, a world change) and closes at the first step above the restored one in the new
  world. A failure while one is open (a second node dies during the recovery) joins it: one outage.
  Its cost: ``detection`` (the failure's start, e.g. the node's last heartbeat, to the leader's
  decision), ``restart`` (the decision to the first new step), ``redone_steps`` (steps run before the
  failure that the new world runs again, times the step time).
* ``other``: the wall time neither productive nor an incident's (slow steps, checkpoint stalls).
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

STEP, FAILURE, ROUND, RESTORED = "step", "failure", "round", "restored"
CAUSES = ("detection", "restart", "redone_steps")  # ftd_job_lost_seconds_total{cause}, plus "other" in reports
SAMPLE_EVERY_S = 30.0  # the (time, step) samples kept for windowed goodput
SAMPLES_KEPT_S = 2 * 3600.0
INCIDENTS_KEPT = 50
INTERVALS_KEPT = 64  # step intervals the median step time is taken over
MAX_STEP_GAP_S = 60.0  # a report gap longer than this is no step-time sample (an idle or blind leader)


@dataclass(frozen=True)
class Record:
    at: float  # the leader's wall clock when it learnt this (unix seconds)
    kind: str  # STEP, FAILURE, ROUND, RESTORED
    step: int = -1  # STEP: the step reported; ROUND: the restore target (-1: none); RESTORED: the step read
    reported_at: float = 0.0  # STEP/RESTORED: the training's clock of the report (stale ones are dropped)
    cause: str = ""  # FAILURE/ROUND: node_dead, hung, handed_over, worker_failed, stalled, rolled_back, rescaled
    node_id: str = ""
    since: float | None = None  # FAILURE: when it started (the node's last heartbeat); None: the last step


@dataclass
class Incident:
    kind: str
    node_id: str
    started: float  # unix s: the failure's start
    declared: float  # the leader's decision (a death committed, a round started)
    step_before: int  # the job's step when it failed
    also: list[str] = field(default_factory=list)  # failures that joined it ("kind node")
    round_at: float | None = None
    restore_target: int = -1
    restored: int | None = None  # what the new world reported restoring
    resumed: float | None = None  # the first step above the restored one
    step_time: float = 0.0  # the job's step time when it closed (prices the redone steps)

    @property
    def floor(self) -> int:
        return self.restored if self.restored is not None else self.restore_target

    @property
    def steps_redone(self) -> int:
        return max(0, self.step_before - self.floor) if self.round_at is not None else 0

    def costs(self, now: float, step_time: float) -> dict[str, float]:
        """Seconds lost by cause; an open incident's so far (its restart still running)."""
        end = self.resumed if self.resumed is not None else now
        return {"detection": max(0.0, self.declared - self.started),
                "restart": max(0.0, end - max(self.declared, self.started)),
                "redone_steps": self.steps_redone * (self.step_time or step_time)}

    def as_dict(self, now: float, step_time: float) -> dict[str, Any]:
        costs = self.costs(now, step_time)
        return {"kind": self.kind, "node_id": self.node_id, "started_unix_s": self.started,
                "declared_unix_s": self.declared, "detection_s": costs["detection"],
                "recovery_s": costs["restart"], "steps_redone": self.steps_redone,
                "redone_s": costs["redone_steps"], "lost_s": sum(costs.values()), "open": self.resumed is None,
                "step_before": self.step_before, "restored_step": self.floor, "also": list(self.also)}


@dataclass
class Ledger:
    job: str
    started: float | None = None  # the first step seen
    start_step: int = -1
    step: int = -1  # the job's current step (the newest round's highest)
    last_step_at: float | None = None
    last_reported_at: float = 0.0
    round_at: float = 0.0  # reports made before the current round started are the old world's
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVALS_KEPT))
    samples: list[tuple[float, int]] = field(default_factory=list)  # (at, step) every SAMPLE_EVERY_S
    open: Incident | None = None
    incidents: list[Incident] = field(default_factory=list)  # closed, newest last (INCIDENTS_KEPT)
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))  # closed incidents'

    @property
    def step_time(self) -> float:
        return statistics.median(self.intervals) if self.intervals else 0.0

    def apply(self, r: Record) -> Incident | None:
        """Folds one record in; returns the incident it closed, if any."""
        if r.kind == STEP:
            return self._step(r)
        if r.kind == FAILURE:
            self._fail(r.at, r.cause, r.node_id, r.since)
        elif r.kind == ROUND:
            self._round(r)
        elif r.kind == RESTORED:
            if self.open is not None and self.open.round_at is not None and r.reported_at >= self.round_at:
                self.open.restored = r.step
        else:
            raise ValueError(f"unknown goodput record kind {r.kind!r}")
        return None

    def _step(self, r: Record) -> Incident | None:
        if r.reported_at and r.reported_at < self.round_at:
            return None  # the old world's report, read after the new round started
        if self.started is None:
            self.started, self.start_step, self.step = r.at, r.step, r.step
            self.last_step_at, self.last_reported_at = r.at, r.reported_at or r.at
            self.samples.append((r.at, r.step))
            return None
        closed = None
        incident = self.open
        if incident is not None and incident.round_at is None:  # steps the old world still made
            incident.step_before = max(incident.step_before, r.step)
        elif incident is not None and r.step > incident.floor:
            incident.resumed, incident.step_time = r.at, self.step_time
            closed, self.open = incident, None
            self.incidents = [*self.incidents, incident][-INCIDENTS_KEPT:]
            for cause, seconds in incident.costs(r.at, self.step_time).items():
                self.lost[cause] += seconds
        if r.step > self.step:
            reported = r.reported_at or r.at
            gap = reported - self.last_reported_at
            if self.open is None and closed is None and 0 < gap <= MAX_STEP_GAP_S:
                self.intervals.append(gap / (r.step - self.step))
            self.step, self.last_step_at, self.last_reported_at = r.step, r.at, reported
        if r.at - self.samples[-1][0] >= SAMPLE_EVERY_S:
            self.samples.append((r.at, self.step))
            while self.samples and r.at - self.samples[0][0] > SAMPLES_KEPT_S:
                self.samples.pop(0)
        return closed

    def _fail(self, at: float, cause: str, node_id: str, since: float | None) -> None:
        if self.started is None:
            return  # the job made no step yet: nothing to lose
        if self.open is not None:
            self.open.also.append(f"{cause} {node_id}".strip())
            return
        start = since if since is not None else (self.last_step_at or at)
        self.open = Incident(cause, node_id, min(start, at), at, self.step)

    def _round(self, r: Record) -> None:
        self.round_at = r.at
        if self.started is None:
            return
        if self.open is None:  # a round no committed failure explains: a worker failure, a rollback, a rescale
            self._fail(r.at, r.cause or "restart", r.node_id, None)
        assert self.open is not None
        self.open.round_at, self.open.restore_target, self.open.restored = r.at, r.step, None
        self.step = r.step  # the new world starts from what it restores; its reports raise it again

    # ---- reading ----------------------------------------------------------------------------

    def step_at(self, t: float) -> int:
        """The job's step at time ``t`` by the samples (the first sample's before it)."""
        best = self.samples[0][1] if self.samples else self.step
        for at, step in self.samples:
            if at > t:
                break
            best = step
        return best

    def report(self, now: float, since: float | None = None) -> dict[str, Any]:
        """Goodput over ``[since, now]`` (``None``: since the first step) with the lost time by cause
        and the incidents that started in it, newest last."""
        if self.started is None:
            return {"job": self.job, "started": False, "goodput_ratio": None, "wall_s": 0.0, "incidents": []}
        t0 = self.started if since is None else max(since, self.started)
        wall = max(0.0, now - t0)
        step_time = self.step_time
        first = self.start_step if t0 == self.started else self.step_at(t0)
        kept = max(0, self.step - first)
        productive = min(wall, kept * step_time)
        shown = [i for i in [*self.incidents, *([self.open] if self.open else [])] if i.declared >= t0]
        lost = dict.fromkeys(CAUSES, 0.0)
        for incident in shown:
            for cause, seconds in incident.costs(now, step_time).items():
                lost[cause] += seconds
        other = max(0.0, wall - productive - sum(lost.values()))
        return {"job": self.job, "started": True, "since_unix_s": t0, "now_unix_s": now, "wall_s": wall,
                "step": self.step, "steps_kept": kept, "step_time_s": step_time, "productive_s": productive,
                "goodput_ratio": productive / wall if wall > 0 else None,
                "lost_s": {**lost, "other": other}, "failures": len(shown) + sum(len(i.also) for i in shown),
                "steps_redone": sum(i.steps_redone for i in shown),
                "incidents": [i.as_dict(now, step_time) for i in shown]}

    def lost_total(self, now: float) -> dict[str, float]:
        """Seconds lost by cause since the first step, for a counter: the closed incidents' and the
        open one's detection and restart so far (its redone steps count when it closes, once known)."""
        out = dict(self.lost)
        if self.open is not None:
            costs = self.open.costs(now, self.step_time)
            out["detection"] += costs["detection"]
            out["restart"] += costs["restart"]
        return out


# ---- persistence: a new leader continues the ledger ----------------------------------------------


def key(job: str) -> str:
    return f"goodput/{job}"


def encode(ledger: Ledger) -> bytes:
    data = asdict(ledger)
    data["intervals"] = list(ledger.intervals)
    return json.dumps(data, separators=(",", ":")).encode()


def _incident(data: dict[str, Any]) -> Incident:
    return Incident(**data)


def decode(raw: bytes) -> Ledger:
    """The ledger :func:`encode` wrote; ``ValueError``/``TypeError``/``KeyError`` when it is not one."""
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("job"), str):
        raise ValueError("not a goodput ledger (no job)")
    ledger = Ledger(
        job=data["job"], started=data["started"], start_step=int(data["start_step"]), step=int(data["step"]),
        last_step_at=data["last_step_at"], last_reported_at=float(data["last_reported_at"]),
        round_at=float(data["round_at"]), intervals=deque((float(x) for x in data["intervals"]), maxlen=INTERVALS_KEPT),
        samples=[(float(a), int(s)) for a, s in data["samples"]],
        open=_incident(data["open"]) if data["open"] else None,
        incidents=[_incident(i) for i in data["incidents"]],
        lost={c: float(data["lost"].get(c, 0.0)) for c in CAUSES})
    return ledger
