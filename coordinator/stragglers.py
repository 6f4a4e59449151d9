"""Straggler detection as pure decisions over a short window of per-node step timings.

A synchronous job runs at its slowest rank's pace while every heartbeat stays green, so a throttled
GPU, a flapping link or a noisy neighbour costs every step of every rank. The agents report per step
the compute time of their slowest rank (``Progress.timing``: time the rank spent computing, not
waiting in collectives); the leader keeps a short window per node (:class:`StepWindow`) and judges
it with :func:`judge_stragglers`:

* **Relative, never absolute**: a node's score is its median compute time over the median of the
  *other* nodes' medians (NVRx scores ranks against the best; DLRover flags 2x the median). The
  whole job slowing down together (a bigger batch, a slower filesystem, every node throttled alike)
  scores 1 everywhere and flags nobody.
* **Robust to single slow steps**: medians over the window, so a checkpoint step, a garbage
  collection or one slow batch moves nothing; a step the training marked as a save step (one a
  durable checkpoint's write ran beside: a memory snapshot, at one every step, is every step's cost) is
  left out.
* **Noise is not a straggler**: a node is slow only when it is also ``min_excess_s`` slower per step
  (a job whose timed compute is a millisecond would otherwise be judged on scheduler jitter).
* **Evidence before action**: a node is judged only once it has ``min_samples`` steps spanning
  ``min_evidence_s`` in the window, none from the warm-up after a round started, and it is a
  straggler only when ``k`` of its last ``n`` judgements flagged it (hysteresis, as ByteRobust asks
  an alert to repeat before it evicts).

The action (alert, or a planned hand-over to a spare) is :func:`replacement_due`'s, also pure.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ALERT, REPLACE = "alert", "replace"


@dataclass(frozen=True)
class StragglerConfig:
    threshold: float = 1.5  # score (node median / others' median) at or above which a judgement flags
    k: int = 3  # flagged in k ...
    n: int = 5  # ... of the node's last n judgements: a straggler
    window_s: float = 60.0  # samples older than this are dropped
    min_samples: int = 5  # steps a node needs in the window to be judged
    min_evidence_s: float = 10.0  # and the time they span
    warmup_s: float = 20.0  # steps within this of a round's start are not evidence (compilation, caches)
    action: str = ALERT  # "alert" or "replace" (a planned hand-over of the node to a healthy spare)
    min_replace_interval_s: float = 600.0  # at most one replacement per this long
    strong_score: float = 2.0  # below this a score is marginal: the last spare is never spent on it
    min_excess_s: float = 0.01  # and a node is slow only when this much slower per step (noise at small scales)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0:
            raise ValueError(f"straggler threshold must be > 1 (a ratio to the others' median), got {self.threshold}")
        if not 1 <= self.k <= self.n:
            raise ValueError(f"straggler hysteresis needs 1 <= k <= n, got k={self.k} n={self.n}")
        if self.window_s <= 0 or self.min_samples < 1 or self.min_evidence_s < 0 or self.warmup_s < 0:
            raise ValueError("straggler window_s must be > 0, min_samples >= 1, min_evidence_s and warmup_s >= 0")
        if self.action not in (ALERT, REPLACE):
            raise ValueError(f"straggler action must be {ALERT!r} or {REPLACE!r}, got {self.action!r}")
        if self.min_replace_interval_s < 0 or self.strong_score < self.threshold or self.min_excess_s < 0:
            raise ValueError("straggler min_replace_interval_s and min_excess_s must be >= 0 and strong_score "
                             ">= threshold")


@dataclass(frozen=True)
class StepSample:
    at: float  # when the leader received it (monotonic seconds)
    step: int
    compute_s: float
    wall_s: float = 0.0
    data_s: float = 0.0
    save: bool = False  # the step also took a checkpoint: not evidence


@dataclass(frozen=True)
class Judgement:
    node_id: str
    score: float  # 0: not judged (too little evidence)
    straggler: bool  # k of the last n judgements flagged it
    reason: str


@dataclass
class StepWindow:
    """The leader's soft state: the newest samples per node and each node's recent flags."""

    samples: dict[str, deque[StepSample]] = field(default_factory=dict)
    flags: dict[str, tuple[bool, ...]] = field(default_factory=dict)
    round_started_at: float = float("-inf")

    def add(self, node_id: str, sample: StepSample, config: StragglerConfig) -> None:
        """One step of ``node_id`` (only a new step: a repeated report of the same step is ignored)."""
        got = self.samples.setdefault(node_id, deque(maxlen=512))
        if got and got[-1].step == sample.step:
            return
        got.append(sample)
        while got and got[0].at < sample.at - config.window_s:
            got.popleft()

    def round_started(self, now: float) -> None:
        """A new world trains: the old samples describe another world (and its warm-up follows)."""
        self.samples.clear()
        self.flags.clear()
        self.round_started_at = now

    def forget(self, keep: Iterable[str]) -> None:
        kept = set(keep)
        for table in (self.samples, self.flags):
            for node_id in [n for n in table if n not in kept]:
                table.pop(node_id)


def evidence(samples: Sequence[StepSample], now: float, config: StragglerConfig,
             round_started_at: float) -> list[float]:
    """The compute times that count: in the window, past the warm-up, not a save step."""
    start = max(now - config.window_s, round_started_at + config.warmup_s)
    return [s.compute_s for s in samples if start <= s.at <= now and not s.save and s.compute_s > 0]


def _enough(samples: Sequence[StepSample], now: float, config: StragglerConfig, round_started_at: float) -> str:
    start = max(now - config.window_s, round_started_at + config.warmup_s)
    used = [s for s in samples if start <= s.at <= now and not s.save and s.compute_s > 0]
    if len(used) < config.min_samples:
        return f"{len(used)} of the {config.min_samples} steps needed"
    span = used[-1].at - used[0].at
    if span < config.min_evidence_s:
        return f"{span:.1f}s of the {config.min_evidence_s:g}s of evidence needed"
    return ""


def judge_stragglers(window: StepWindow, config: StragglerConfig, now: float,
                     nodes: Sequence[str]) -> tuple[list[Judgement], dict[str, tuple[bool, ...]]]:
    """Scores every node of ``nodes`` (the world) against the median of the others' medians. Returns
    the judgements and the new flag history (the caller stores it in ``window.flags``): pure, so the
    same window, config and ``now`` always give the same answer."""
    medians: dict[str, float] = {}
    short: dict[str, str] = {}
    for node_id in nodes:
        samples = window.samples.get(node_id, ())
        lacking = _enough(list(samples), now, config, window.round_started_at)
        if lacking:
            short[node_id] = lacking
        else:
            medians[node_id] = statistics.median(evidence(list(samples), now, config, window.round_started_at))
    judged: list[Judgement] = []
    flags = dict(window.flags)
    for node_id in nodes:
        if node_id in short or len(medians) < 2:
            why = f"not judged: {short[node_id]}" if node_id in short else \
                "not judged: fewer than 2 nodes with evidence"
            judged.append(Judgement(node_id, 0.0, _is_straggler(flags.get(node_id, ()), config), why))
            continue
        others = statistics.median(m for n, m in medians.items() if n != node_id)
        score = medians[node_id] / others if others > 0 else 0.0
        slow = score >= config.threshold and medians[node_id] - others >= config.min_excess_s
        history = (*flags.get(node_id, ()), slow)[-config.n:]
        flags[node_id] = history
        straggler = _is_straggler(history, config)
        times = f"median compute {medians[node_id] * 1e3:.0f} ms against the others' {others * 1e3:.0f} ms"
        if straggler:
            why = (f"straggler: score {score:.2f} ({times}); slow in {sum(history)} of its last {len(history)} "
                   "judgements")
        elif slow:
            why = f"slow once more: score {score:.2f} ({times}); {sum(history)} of {config.k} judgements needed"
        else:
            why = f"score {score:.2f} ({times})"
        judged.append(Judgement(node_id, round(score, 3), straggler, why))
    return judged, flags


def _is_straggler(history: Sequence[bool], config: StragglerConfig) -> bool:
    return sum(history) >= config.k


@dataclass(frozen=True)
class Replacement:
    node_id: str
    why: str


def replacement_due(now: float, judged: Sequence[Judgement], config: StragglerConfig, spares: int,
                    last_replaced_at: float | None, draining: bool) -> tuple[Replacement | None, str]:
    """Whether to hand a straggler over to a spare now, and why (or why not). At most one replacement
    per ``min_replace_interval_s``, one at a time (no other hand-over pending), never without a spare,
    and never the last spare for a marginal score (below ``strong_score``)."""
    worst = max((j for j in judged if j.straggler), key=lambda j: j.score, default=None)
    if worst is None:
        return None, "no straggler"
    if config.action != REPLACE:
        return None, f"{worst.node_id} is a straggler (score {worst.score:.2f}); straggler_action is alert"
    if draining:
        return None, f"{worst.node_id} is a straggler; another hand-over is pending"
    if last_replaced_at is not None and now - last_replaced_at < config.min_replace_interval_s:
        left = config.min_replace_interval_s - (now - last_replaced_at)
        return None, f"{worst.node_id} is a straggler; the last replacement was {now - last_replaced_at:.0f}s ago " \
                     f"(next allowed in {left:.0f}s)"
    if spares < 1:
        return None, f"{worst.node_id} is a straggler; no healthy spare to take its rank"
    if spares == 1 and worst.score < config.strong_score:
        return None, (f"{worst.node_id} is a straggler with a marginal score {worst.score:.2f} "
                      f"(< {config.strong_score:g}); the last spare is kept for a failure")
    return Replacement(worst.node_id, worst.reason), "replace"


__all__ = ["ALERT", "REPLACE", "Judgement", "Replacement", "StepSample", "StepWindow", "StragglerConfig",
           "evidence", "judge_stragglers", "replacement_due"]
