"""Measures each recovery as it happens, for the metrics: from a node's last heartbeat to the job's
first training step in the new world, split into detect / commit / rendezvous / resume.

Fed by the membership (a death committed, training progress in heartbeats) and the job keeper (a round
started); every input carries its ``now`` so the phases are computed without a clock of
their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Incident:
    last_heartbeat: float  # the dead node's last sign of life (monotonic)
    declared: float  # judged dead
    committed: float  # the new epoch committed
    round_started: float | None = None
    resume_after_step: int = -1  # the first step above this, after the round started, ends it


@dataclass(frozen=True)
class Recovery:
    total_s: float
    phases: dict[str, float]


class RecoveryTracker:
    def __init__(self) -> None:
        self.open: Incident | None = None

    def death_committed(self, now: float, silent_s: float, declared: float) -> None:
        """Keeps the earliest open incident: a second death during a recovery is the same outage."""
        if self.open is None:
            self.open = Incident(last_heartbeat=declared - silent_s, declared=declared, committed=now)

    def round_started(self, now: float, restore_step: int) -> None:
        if self.open is not None and self.open.round_started is None:
            self.open.round_started = now
            self.open.resume_after_step = restore_step

    def progress(self, now: float, step: int) -> Recovery | None:
        incident = self.open
        if incident is None or incident.round_started is None or step <= incident.resume_after_step:
            return None
        self.open = None
        return Recovery(now - incident.last_heartbeat, {
            "detect": incident.declared - incident.last_heartbeat,
            "commit": incident.committed - incident.declared,
            "rendezvous": incident.round_started - incident.committed,
            "resume": now - incident.round_started,
        })
