"""When to snapshot into memory and when to persist to disk: the save cadence, measured and agreed.

Lost work per failure is about half the interval between the checkpoints a restore can use, plus
the recovery time. A durable checkpoint every 1000 steps (the deployment guide's figure) loses tens
of minutes at a few seconds a step; a snapshot in memory, replicated to a peer, every step loses at
most one. The memory snapshot is taken every ``memory_every_steps`` (default 1) unless it slows the
training by more than ``max_stall_fraction``; durable persistence follows ``persist_every_steps``
and/or ``persist_every_s``.

What a snapshot costs is more than the time :meth:`~ftd.training.Checkpointer.step_end` blocks:
its background write, checksum, commit and the agent's replication compete with the training for
the node's CPUs and memory bandwidth (measured: a step took 6.28 s with a snapshot every step
against 4.73 s without, +33 %, while the loop blocked for 1 % of a step). So the cadence times the
**whole step** (from one ``step_end`` to the next) two ways: the mean over whole windows of
snapshot cycles at the current interval (snapshot work included), and an EWMA of the steps during
which no snapshot work ran. Their ratio is the slowdown; when it exceeds ``max_stall_fraction`` the
interval widens (the configured one times a power of two) until the predicted slowdown fits, and it
narrows again only below half of it. At an interval of one step no step runs without snapshot
work, so every ``probe_every_steps`` one snapshot (more when the work outlasts a step) is skipped to
time a step without (the first as soon as a whole window with snapshot work was timed: two
decisions in, so that a slow snapshot is noticed in tens of steps, not hundreds): a failure during
that step loses one step more.

**Agreed by all ranks**: a snapshot step is worth something only when every rank holds it, and
ranks measure differently (one rank widened to every 4 steps and another to every 2, and steps 1-3
were never complete in memory). Every decision (each ``decide_every_steps`` steps, a whole number of
snapshot cycles) is one all-reduce (MAX) of each rank's proposal — the interval, a probe, a
time-based durable checkpoint — so every rank adopts the same interval at the same step. Without
``torch.distributed`` (or when the Checkpointer's world is not the process group's) a rank decides
alone.

Everything that decides is a pure function of (policy, state, measurements) returning a reason:
:func:`observe`, :func:`propose`, :func:`adopt`, :func:`decide`, :func:`record_save`.
:class:`CadenceTracker` is the shell around them (the clocks, the all-reduce).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

log = logging.getLogger("ftd.training.cadence")

ALPHA = 0.3  # weight of a new sample in the EWMAs
MAX_PROBE_STEPS = 4  # snapshots a probe skips at most (when the work outlasts a step)
MAX_WIDEN = 1024  # the interval never exceeds the configured one times this (nor the durable interval)


@dataclass(frozen=True)
class CadencePolicy:
    memory_every_steps: int = 1  # 0: no memory snapshots
    persist_every_steps: int = 1000  # 0: not by steps
    persist_every_s: float = 0.0  # 0: not by time
    max_stall_fraction: float = 0.1  # memory snapshots may slow the training by this share of a step at most
    decide_every_steps: int = 8  # the ranks agree on the interval this often (one all-reduce)
    probe_every_steps: int = 200  # a step timed without snapshot work at least this often (0: never)

    def __post_init__(self) -> None:
        if self.memory_every_steps < 0 or self.persist_every_steps < 0 or self.persist_every_s < 0:
            raise ValueError("cadence intervals must be >= 0 (0 turns that trigger off)")
        if self.persist_every_steps == 0 and self.persist_every_s == 0:
            raise ValueError("durable checkpoints need persist_every_steps or persist_every_s")
        if not 0 < self.max_stall_fraction <= 1:
            raise ValueError(f"max_stall_fraction must be in (0, 1], got {self.max_stall_fraction}")
        if self.decide_every_steps < 1 or self.probe_every_steps < 0:
            raise ValueError("decide_every_steps must be >= 1 and probe_every_steps >= 0")

    def describe(self) -> str:
        """The policy as the catalog keeps it with each step (``ftctl checkpoints list``), readable by
        people and by :meth:`parse`: ``memory_every_steps=1 persist_every_steps=1000 persist_every_s=0``."""
        return (f"memory_every_steps={self.memory_every_steps} persist_every_steps={self.persist_every_steps} "
                f"persist_every_s={self.persist_every_s:g}")

    @classmethod
    def parse(cls, text: str) -> CadencePolicy:
        """The inverse of :meth:`describe` (fields left out keep their defaults); ``ValueError`` for
        anything else."""
        fields: dict[str, float] = {}
        for part in text.split():
            name, sep, value = part.partition("=")
            if not sep or name not in _FIELDS:
                raise ValueError(f"not a cadence setting: {part!r}")
            fields[name] = float(value)
        return cls(**{name: (float if name in _FLOATS else int)(fields.get(name, getattr(cls, name)))
                      for name in _FIELDS})  # type: ignore[arg-type]

    def ladder(self) -> list[int]:
        """The intervals the cadence may use: the configured one times a power of two (two ranks'
        intervals then always share steps), up to the durable interval (a durable step snapshots
        anyway) or :data:`MAX_WIDEN` times the configured one."""
        base = self.memory_every_steps
        if base == 0:
            return [0]
        cap = base * MAX_WIDEN
        if self.persist_every_steps:
            cap = min(cap, max(base, self.persist_every_steps))
        out = [base]
        while out[-1] * 2 <= cap:
            out.append(out[-1] * 2)
        return out


_FIELDS = ("memory_every_steps", "persist_every_steps", "persist_every_s", "max_stall_fraction",
           "decide_every_steps", "probe_every_steps")
_FLOATS = ("persist_every_s", "max_stall_fraction")


@dataclass(frozen=True)
class Decision:
    memory: bool
    persist: bool
    reason: str


@dataclass(frozen=True)
class CadenceState:
    """What one rank knows of its cadence; times are ``time.monotonic()`` seconds, ``wall`` ones
    ``time.time()``."""

    every: int = -1  # the agreed memory interval (-1: no step seen yet)
    first_step: int = -1
    step_start: float = 0.0  # when the current step began (the previous step_end)
    last_took: float = 0.0  # the latest step's duration
    # The window since the latest decision: whole snapshot cycles at `every`.
    window_from: int = -1
    window_s: float = 0.0
    window_n: int = 0
    window_ok: bool = False  # a whole window at `every`: no probe, no durable save, not the first one
    with_s: float = 0.0  # EWMA over windows at `every`: the mean step, snapshot work included (0: none yet)
    without_s: float = 0.0  # EWMA: steps during which no snapshot work ran (0: none measured)
    cost_steps: float = -1.0  # EWMA: what one snapshot costs the training, in steps (-1: not measured yet)
    clean_n: int = 0
    last_clean: int = -1  # the step of the latest such step
    probe_until: int = -1  # memory snapshots are skipped after the latest decision up to this step
    blocked_s: float = 0.0  # EWMA: how long a memory snapshot blocks the loop
    work_s: float = 0.0  # EWMA: from a save to the end of its background work
    pending_save: float | None = None  # when the save whose work has not been seen to end was issued
    saves: int = 0
    last_persist_step: int = -1
    last_persist_s: float = 0.0  # wall clock
    persist_due: bool = False  # a time-based durable checkpoint, agreed at the latest decision
    reason: str = ""  # why the interval is what it is


@dataclass(frozen=True)
class Proposal:
    """One rank's wish at a decision (the all-reduce takes each field's maximum)."""

    every: int
    probe: int  # snapshots to skip for a probe (0: none)
    persist: bool  # a time-based durable checkpoint is due
    reason: str

    def vector(self) -> list[int]:
        return [self.every, self.probe, int(self.persist)]


def _ewma(old: float, new: float) -> float:
    return new if old == 0 else (1 - ALPHA) * old + ALPHA * new


def cycle(policy: CadencePolicy, every: int) -> int:
    """Steps between decisions: at least ``decide_every_steps``, a whole number of snapshot cycles."""
    if every <= 0:
        return policy.decide_every_steps
    return every * math.ceil(policy.decide_every_steps / every)


def is_decision_step(policy: CadencePolicy, state: CadenceState, step: int) -> bool:
    return state.every >= 0 and step > state.window_from and step % cycle(policy, state.every) == 0


def observe(policy: CadencePolicy, state: CadenceState, step: int, now: float,
            quiet_since: float | None) -> CadenceState:
    """The step that ended at ``now``. ``quiet_since``: since when no save of this rank has had
    work in flight (its write, commit, durable copy), ``None`` while one has."""
    if state.every < 0:
        return replace(state, every=policy.memory_every_steps, first_step=step, step_start=now, window_from=step,
                       reason=f"memory snapshot every {policy.memory_every_steps} step(s), as configured")
    took = max(0.0, now - state.step_start)
    s = replace(state, step_start=now, last_took=took, window_s=state.window_s + took, window_n=state.window_n + 1)
    if quiet_since is not None and s.pending_save is not None and quiet_since >= s.pending_save:
        s = replace(s, work_s=_ewma(s.work_s, quiet_since - s.pending_save), pending_save=None)
    if quiet_since is not None and quiet_since <= state.step_start:  # no snapshot work during the whole step
        s = replace(s, without_s=_ewma(s.without_s, took), clean_n=s.clean_n + 1, last_clean=step)
    return s


def propose(policy: CadencePolicy, state: CadenceState, step: int, wall: float) -> Proposal:
    """This rank's wish at the decision of ``step`` (after the window ending there was closed by
    :func:`close_window`)."""
    persist = bool(policy.persist_every_s) and wall - state.last_persist_s >= policy.persist_every_s
    every, why = _interval(policy, state)
    probe = 0
    since_clean = step - (state.last_clean if state.last_clean >= 0 else state.first_step)
    gap = policy.probe_every_steps if state.clean_n >= 2 else policy.probe_every_steps // 2
    if state.clean_n == 0:  # the first probe as soon as a whole window with snapshot work was timed
        gap = min(gap, 2 * cycle(policy, state.every))
    if every > 0 and policy.probe_every_steps and since_clean >= max(1, gap):
        per_step = state.without_s or state.with_s or state.last_took
        probe = min(MAX_PROBE_STEPS, max(1, math.ceil(state.work_s / per_step))) if per_step > 0 else 1
    return Proposal(every, probe, persist, why)


def _interval(policy: CadencePolicy, state: CadenceState) -> tuple[int, str]:
    """The interval this rank's measurements ask for, and why: the smallest of the ladder at which
    one snapshot's cost, spread over the interval, stays within ``max_stall_fraction`` of a step
    (narrower only when it stays within half of it)."""
    ladder = policy.ladder()
    every, f = state.every, policy.max_stall_fraction
    if ladder == [0]:
        return 0, "memory snapshots off"
    costs: list[tuple[float, str]] = []  # one snapshot's cost in step times, and what says so
    per_step = state.without_s or state.with_s or state.last_took
    if state.blocked_s > 0 and per_step > 0:
        costs.append((state.blocked_s / per_step, f"the loop blocks {state.blocked_s * 1e3:.0f} ms a snapshot"))
    cost_steps = state.cost_steps
    if cost_steps >= 0 and state.without_s > 0:
        costs.append((cost_steps, f"a step takes {state.without_s:.3g} s without snapshot work and "
                                  f"{cost_steps / every:+.0%} with a snapshot every {every}"))
    if not costs:
        return every, state.reason or f"memory snapshot every {every} step(s), as configured"
    cost, what = max(costs)

    def smallest(limit: float) -> int:
        return next((k for k in ladder if cost / k <= limit), ladder[-1])

    wanted = smallest(f)
    if wanted < every:
        wanted = min(every, smallest(f / 2))  # narrow only well below the limit: no flapping
    if wanted == every:
        return every, f"memory snapshot every {every} step(s): {what}"
    verb = "widened" if wanted > every else "narrowed"
    return wanted, f"memory snapshot every {wanted} step(s) ({verb} from {every}: {what}; the limit is {f:.0%})"


def close_window(state: CadenceState) -> CadenceState:
    """Folds the window that ends at a decision (when it is whole) into the mean step with snapshot
    work and, against the steps without, into the cost of one snapshot."""
    if not (state.window_ok and state.window_n):
        if state.cost_steps < 0 and state.with_s > 0 and state.without_s > 0 and state.every > 0:
            # the first probe just ended: the windows before it timed the steps with snapshot work
            return replace(state, cost_steps=max(0.0, state.with_s / state.without_s - 1) * state.every)
        return state
    with_s = _ewma(state.with_s, state.window_s / state.window_n)
    if state.without_s <= 0 or state.every <= 0:
        return replace(state, with_s=with_s)
    cost = max(0.0, state.window_s / state.window_n / state.without_s - 1) * state.every
    return replace(state, with_s=with_s, cost_steps=cost if state.cost_steps < 0 else _ewma(state.cost_steps, cost))


def adopt(policy: CadencePolicy, state: CadenceState, step: int, mine: Proposal,
          agreed: Sequence[int]) -> CadenceState:
    """What every rank adopts at the decision of ``step``: the all-reduced maxima ``agreed`` of
    every rank's :meth:`Proposal.vector`. A new interval starts a new measurement."""
    every, probe, persist = int(agreed[0]), int(agreed[1]), bool(agreed[2])
    reason = mine.reason if every == mine.every else \
        f"memory snapshot every {every} step(s), as another rank's measurements ask (this one's: {mine.reason})"
    changed = every != state.every
    return replace(state, every=every, probe_until=step + probe if probe else -1, persist_due=persist,
                   window_from=step, window_s=0.0, window_n=0, window_ok=not changed and not probe,
                   with_s=0.0 if changed else state.with_s, reason=reason)


def decide(policy: CadencePolicy, state: CadenceState, step: int, wall: float) -> tuple[Decision, CadenceState]:
    """What to save at ``step`` (a persisted step is snapshotted in memory too: it is the newest)."""
    persist_why = ""
    if state.last_persist_step < 0:
        persist_why = "the first step of the cadence"
    elif policy.persist_every_steps and step - state.last_persist_step >= policy.persist_every_steps:
        persist_why = f"{policy.persist_every_steps} steps since the last durable checkpoint"
    elif state.persist_due and step == state.window_from:
        persist_why = f"{policy.persist_every_s:g}s since the last durable checkpoint (agreed by every rank)"
    if persist_why:
        # The durable copy's work runs in this window: no measure of the memory snapshots' cost.
        s = replace(state, last_persist_step=step, last_persist_s=wall, persist_due=False, window_ok=False)
        return Decision(True, True, persist_why), s
    every = state.every
    if every <= 0:
        return Decision(False, False, "memory snapshots off"), state
    if state.window_from < step <= state.probe_until:
        return Decision(False, False, f"a probe: no snapshot until after step {state.probe_until}, to time a "
                                      "step without snapshot work"), state
    if step % every == 0:
        return Decision(True, False, state.reason or f"memory snapshot every {every} step(s)"), state
    return Decision(False, False, f"next memory snapshot in {every - step % every} step(s)"), state


def record_save(state: CadenceState, now: float, blocked_s: float, memory: bool) -> CadenceState:
    """A save was issued at ``now`` and blocked the loop ``blocked_s`` (the first save of the
    cadence is not counted: it may map the snapshot buffers)."""
    s = replace(state, pending_save=state.pending_save if state.pending_save is not None else now,
                saves=state.saves + 1)
    return replace(s, blocked_s=_ewma(s.blocked_s, blocked_s)) if memory and state.saves else s


# ---- the shell: clocks and the all-reduce ------------------------------------------------------------------


def agree_max(values: Sequence[int], world_size: int) -> list[int]:
    """Each value's maximum over the ranks of the default process group (one all-reduce), when that
    group is this job's world of ``world_size`` ranks; else the values themselves."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


class CadenceTracker:
    """The cadence of one rank (see the module docstring): call :meth:`step_end` at the end of every
    step — on every rank, at the same steps: a decision is a collective — and :meth:`saved` after
    the save it asked for was issued."""

    def __init__(self, policy: CadencePolicy, agree: Callable[[Sequence[int]], list[int]] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.agree: Callable[[Sequence[int]], list[int]] = agree or list
        self.clock, self.wall = clock, wall
        self.state = CadenceState()
        self.last: Decision | None = None

    @property
    def every(self) -> int:
        """The memory interval in force (the configured one before the first step)."""
        return self.state.every if self.state.every >= 0 else self.policy.memory_every_steps

    def step_end(self, step: int, quiet_since: float | None) -> Decision:
        policy = self.policy
        self.state = observe(policy, self.state, step, self.clock(), quiet_since)
        if is_decision_step(policy, self.state, step):
            self.state = close_window(self.state)
            mine = propose(policy, self.state, step, self.wall())
            before = self.state.every
            self.state = adopt(policy, self.state, step, mine, self.agree(mine.vector()))
            if self.state.every != before:
                log.warning("step %d: %s", step, self.state.reason)
        decision, self.state = decide(policy, self.state, step, self.wall())
        self.last = decision
        return decision

    def saved(self, decision: Decision, blocked_s: float) -> None:
        self.state = record_save(self.state, self.clock(), blocked_s, decision.memory)


__all__ = ["CadencePolicy", "CadenceState", "CadenceTracker", "Decision", "Proposal", "adopt", "agree_max",
           "close_window", "cycle", "decide", "is_decision_step", "observe", "propose", "record_save"]
