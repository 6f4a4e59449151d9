"""Step anomalies as a pure decision over each rank's recent losses and gradient norms.

A NaN, a loss spike or a gradient explosion poisons every checkpoint saved after it, and a silent
data corruption looks like one. The agent sees every ``report_step(loss, grad_norm)`` of its ranks
and judges each against that rank's trailing window (:func:`judge_step`):

* **NaN/Inf** in the loss or the gradient norm: always an anomaly.
* **Loss spike**: above ``loss_spike_factor`` times the trailing median (Megatron's rerun machine
  calls a loss spiky above 10x the largest seen; a median is not moved by the spike's own history).
* **Gradient-norm jump**: above ``1 + grad_norm_jump`` times the trailing median (the seed's alert
  threshold, 30 %).

Nothing is judged before ``min_history`` steps (the first steps of a run, or of a world restored
from a checkpoint, move fast), and a step that goes backwards (a restore) starts the window afresh.
The anomaly travels with the node's heartbeat progress to the coordinator (an event, a counter, the
FtdStepAnomaly alert); acting on it (a rollback) is the job's policy, not this module's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from ftd.v1 import cluster_pb2

NAN, LOSS_SPIKE, GRAD_JUMP = "nan", "loss_spike", "grad_norm_jump"


@dataclass(frozen=True)
class AnomalyConfig:
    loss_spike_factor: float = 10.0
    grad_norm_jump: float = 0.30
    window: int = 50  # trailing steps per rank
    min_history: int = 10

    def __post_init__(self) -> None:
        if self.loss_spike_factor <= 1 or self.grad_norm_jump <= 0:
            raise ValueError("anomaly loss_spike_factor must be > 1 and grad_norm_jump > 0")
        if not 1 <= self.min_history <= self.window:
            raise ValueError("anomaly min_history must be in [1, window]")


@dataclass(frozen=True)
class Anomaly:
    step: int
    rank: int
    kind: str  # NAN, LOSS_SPIKE or GRAD_JUMP
    value: float
    baseline: float  # the trailing median it was compared with (nan for NaN/Inf)
    reason: str


@dataclass
class RankHistory:
    losses: deque[float] = field(default_factory=deque)
    grads: deque[float] = field(default_factory=deque)
    last_step: int = -1


def judge_step(history: RankHistory, step: int, rank: int, loss: float | None, grad_norm: float | None,
               config: AnomalyConfig) -> Anomaly | None:
    """Whether this step of this rank is anomalous, against ``history`` (the caller then records the
    step with :func:`remember`). Pure: the same history and values give the same answer."""
    for name, value in (("loss", loss), ("gradient norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            return Anomaly(step, rank, NAN, value, math.nan, f"rank {rank} step {step}: {name} is {value}")
    if step <= history.last_step:
        return None  # a restore: the window starts again (remember() clears it)
    if loss is not None and len(history.losses) >= config.min_history:
        median = statistics.median(history.losses)
        if median > 0 and loss > config.loss_spike_factor * median:
            return Anomaly(step, rank, LOSS_SPIKE, loss, median,
                           f"rank {rank} step {step}: loss {loss:.4g} is {loss / median:.1f}x the median "
                           f"{median:.4g} of its last {len(history.losses)} steps (limit "
                           f"{config.loss_spike_factor:g}x)")
    if grad_norm is not None and len(history.grads) >= config.min_history:
        median = statistics.median(history.grads)
        if median > 0 and grad_norm > (1 + config.grad_norm_jump) * median:
            return Anomaly(step, rank, GRAD_JUMP, grad_norm, median,
                           f"rank {rank} step {step}: gradient norm {grad_norm:.4g} is "
                           f"{grad_norm / median - 1:+.0%} over the median {median:.4g} of its last "
                           f"{len(history.grads)} steps (limit +{config.grad_norm_jump:.0%})")
    return None


def remember(history: RankHistory, step: int, loss: float | None, grad_norm: float | None,
             config: AnomalyConfig) -> None:
    """Adds a step's values to the window (finite ones only); a step that went backwards (the world
    restored a checkpoint) empties it first."""
    if step <= history.last_step:
        history.losses.clear()
        history.grads.clear()
    history.last_step = step
    for values, value in ((history.losses, loss), (history.grads, grad_norm)):
        if value is not None and math.isfinite(value):
            values.append(value)
            while len(values) > config.window:
                values.popleft()


class NodeJudge:
    """The windows of one node's ranks (at most ``max_ranks``) and what a report does to the node's
    progress: an anomaly rides in it until a newer incident, and a NaN or Inf figure is left out (the
    anomaly says it; the coordinator takes finite figures only).

    An **incident** is a run of anomalous steps of one kind on one rank: a NaN poisons the model, so
    every later step is NaN too. Its first step is what matters (the rollback goes before it) and
    what is reported, once; a clean step of that rank ends the incident, and so does a restore (its
    step going back: a rollback restarts the rank, and the same fault again is a new incident)."""

    def __init__(self, config: AnomalyConfig, max_ranks: int = 256) -> None:
        self.config = config
        self.max_ranks = max_ranks
        self.histories: dict[int, RankHistory] = {}
        self._incidents: dict[int, str] = {}  # rank -> the kind of its ongoing incident

    def judge(self, previous: cluster_pb2.Progress, progress: cluster_pb2.Progress, rank: int,
              round_: int | None = None) -> Anomaly | None:
        """Updates ``progress`` (a rank's new report, replacing ``previous``) in place; ``round_`` is
        the job round the rank trains in (an anomaly carries it)."""
        if previous.HasField("anomaly") and not progress.HasField("anomaly"):
            progress.anomaly.CopyFrom(previous.anomaly)
        loss = progress.loss if progress.HasField("loss") else None
        grad = progress.grad_norm if progress.HasField("grad_norm") else None
        for name, value in (("loss", loss), ("grad_norm", grad)):
            if value is not None and not math.isfinite(value):
                progress.ClearField(name)  # type: ignore[arg-type]
        if (loss is None and grad is None) or (len(self.histories) >= self.max_ranks and rank not in self.histories):
            return None
        history = self.histories.setdefault(rank, RankHistory())
        if progress.step <= history.last_step:
            self._incidents.pop(rank, None)  # restored (a rollback, a new world): a new timeline
        found = judge_step(history, progress.step, rank, loss, grad, self.config)
        remember(history, progress.step, loss, grad, self.config)
        if found is None:
            self._incidents.pop(rank, None)
            return None
        if self._incidents.get(rank) == found.kind:
            return None  # the same incident goes on: its first step stays the one reported
        self._incidents[rank] = found.kind
        if progress.HasField("anomaly") and _same_fault(progress.anomaly, found.rank, found.step, round_):
            return found  # an earlier rank's report of the same fault stays (its first step is the one to act on)
        progress.anomaly.CopyFrom(cluster_pb2.StepAnomaly(step=found.step, rank=found.rank, kind=found.kind,
                                                          value=found.value, baseline=found.baseline,
                                                          reason=found.reason[:300]))
        if round_ is not None:
            progress.anomaly.round = round_
        return found


SAME_FAULT_STEPS = 16  # another rank's anomaly this soon after the carried one is the same fault spreading


def _same_fault(carried: cluster_pb2.StepAnomaly, rank: int, step: int, round_: int | None) -> bool:
    """A NaN on one rank reaches the node's other ranks at the next collective, a step later: with
    several ranks per node the heartbeat must keep carrying the *first* one, or the leader would
    roll back to a step the fault had already reached."""
    same_round = (carried.round if carried.HasField("round") else None) == round_
    return same_round and rank != carried.rank and carried.step <= step <= carried.step + SAME_FAULT_STEPS


__all__ = ["GRAD_JUMP", "LOSS_SPIKE", "NAN", "Anomaly", "AnomalyConfig", "NodeJudge", "RankHistory", "judge_step",
           "remember"]
