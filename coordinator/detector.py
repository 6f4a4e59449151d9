"""Failure detection as a pure function of ``(now, last-seen table, settings)``.

Two kinds of evidence, both on the leader's monotonic clock:

* **silence**: no heartbeat for ``dead_after_s`` → dead (a hung, stopped or partitioned node);
* **a closed stream**: the agent's heartbeat stream ended (the kernel closes the socket of a
  SIGKILLed process at once) and no new stream came within ``disconnect_dead_after_s`` → dead.

Between ``suspect_after_s`` and death a node is *suspect*: shown, never acted on. A node under a
*grace* deadline (a new leader that just loaded state from etcd) is never judged dead before the
deadline, so a failover cannot kill a live node; the deadline is stretched while nodes keep re-opening
their streams (:func:`reconnect_grace_until`), and a node heard from again keeps it (:class:`Reconnects`).
If the judge itself was not run for longer than ``stall_after_s`` (the coordinator was starved of CPU)
every silence is suspect evidence, so the caller must grant grace rather than act; :func:`judge` says
so in :attr:`Judgement.stalled`. The exception are the ``watched`` nodes: their evidence waited for the
leader (beacons queued in a socket that lost none, read before the judgement), so their silence is
theirs, and a death during a busy moment of the leader is not declared 2.5 s late.

A *mass silence* (:func:`mass_hold`) is the other way the leader's own state shows: more than a
fraction of the nodes falling silent together is far likelier the leader being overloaded (a
failover's reconnect storm, a registration storm) or cut off than that many nodes dying in one
``dead_after_s``. Declaring them dead would re-form the world around a fraction of it, and each
epoch's push to every stream loads the leader further (a cascade: 1,835 of 2,000 simulated nodes
fenced after a failover, none dead). Their deaths are held for ``hold_s`` (Kubernetes' node
lifecycle controller stops evicting in a fully disrupted zone for the same reason); then the
ones still silent are declared. Fewer than ``min_nodes`` is never a mass.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


class State(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(frozen=True)
class DetectorSettings:
    suspect_after_s: float = 1.2
    dead_after_s: float = 2.5
    disconnect_dead_after_s: float = 1.5
    stall_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.suspect_after_s < self.dead_after_s:
            raise ValueError("suspect_after_s must be positive and below dead_after_s")
        if not 0 < self.disconnect_dead_after_s <= self.dead_after_s:
            raise ValueError("disconnect_dead_after_s must be positive and at most dead_after_s")
        if self.stall_after_s <= 0:
            raise ValueError("stall_after_s must be positive")


@dataclass(slots=True)
class Liveness:
    """What the leader knows of one node's heartbeats. Mutated in place by the heartbeat handler
    (the hot path) and only read by :func:`judge`."""

    last_seen: float  # monotonic seconds: last heartbeat, or registration, on this leader
    connected: bool = False
    disconnected_at: float | None = None
    grace_until: float = 0.0


@dataclass(frozen=True)
class Verdict:
    state: State
    reason: str
    silent_s: float


@dataclass(frozen=True)
class Judgement:
    verdicts: Mapping[str, Verdict]
    stalled: bool = False
    stall_reason: str = ""


HEARTBEATING = "heartbeating"  # the reason of a node heard from lately: its verdict is reused (judge's previous)
IN_GRACE = "in grace"  # the reason of a node in grace heard from lately: reused as well


def judge_one(now: float, live: Liveness, settings: DetectorSettings) -> Verdict:
    silent = max(0.0, now - live.last_seen)
    if now < live.grace_until:
        if silent >= settings.suspect_after_s:
            return Verdict(State.SUSPECT, f"silent {silent:.2f}s, in grace for {live.grace_until - now:.2f}s",
                           silent)
        return Verdict(State.ALIVE, IN_GRACE, silent)
    if silent >= settings.dead_after_s:
        return Verdict(
            State.DEAD, f"no heartbeat for {silent:.2f}s (dead_after_s={settings.dead_after_s:g})", silent
        )
    if not live.connected and live.disconnected_at is not None:
        closed = now - live.disconnected_at
        if closed >= settings.disconnect_dead_after_s:
            return Verdict(
                State.DEAD,
                f"heartbeat stream closed {closed:.2f}s ago and not reopened "
                f"(disconnect_dead_after_s={settings.disconnect_dead_after_s:g})",
                silent,
            )
        return Verdict(State.SUSPECT, f"heartbeat stream closed {closed:.2f}s ago", silent)
    if silent >= settings.suspect_after_s:
        return Verdict(State.SUSPECT, f"no heartbeat for {silent:.2f}s", silent)
    return Verdict(State.ALIVE, HEARTBEATING, silent)


def judge(
    now: float,
    table: Mapping[str, Liveness],
    settings: DetectorSettings,
    last_judged: float | None = None,
    previous: Mapping[str, Verdict] | None = None,
    watched: Collection[str] = (),
) -> Judgement:
    """Judges every node. ``last_judged`` is when the previous judgement ran; a gap longer than
    ``stall_after_s`` means this process was not running, so silences are not evidence, but for the
    ``watched`` nodes' (their evidence was kept for the leader: see the module's note).

    With ``previous`` (the last judgement's verdicts) a node heard from within ``suspect_after_s``,
    connected and out of grace keeps its previous "heartbeating" verdict object as it was, and one heard
    from as lately in grace its "in grace" one (its ``silent_s`` is then that of the judgement that made
    it): the same states and reasons as a full judgement, at a fraction of the cost per node, and the
    caller can skip unchanged verdicts by identity."""
    if last_judged is not None and now - last_judged > settings.stall_after_s:
        gap = now - last_judged
        reason = f"coordinator did not run for {gap:.2f}s (> stall_after_s={settings.stall_after_s:g})"
        verdicts: dict[str, Verdict] = {}
        for node_id, live in table.items():
            verdict = judge_one(now, live, settings)
            if verdict.state is State.DEAD and node_id not in watched:
                verdict = Verdict(State.SUSPECT, f"{verdict.reason}; not judged: {reason}", verdict.silent_s)
            verdicts[node_id] = verdict
        return Judgement(verdicts, stalled=True, stall_reason=reason)
    if previous is None:
        return Judgement({node_id: judge_one(now, live, settings) for node_id, live in table.items()})
    fresh_after = now - settings.suspect_after_s
    verdicts = {}
    for node_id, live in table.items():
        before = previous.get(node_id)
        if before is not None and live.last_seen > fresh_after and before.state is State.ALIVE and (
                (live.connected and live.grace_until <= now and before.reason == HEARTBEATING)
                or (live.grace_until > now and before.reason == IN_GRACE)):  # a reconnect storm's 2,000 nodes
            verdicts[node_id] = before
        else:
            verdicts[node_id] = judge_one(now, live, settings)
    return Judgement(verdicts)


@dataclass(frozen=True)
class MassSilence:
    """When dying nodes are a mass (see the module's note): more than ``max(min_nodes, fraction x
    the nodes judged)`` dead at once or within ``dead_after_s``; ``hold_s`` 0 turns the hold off."""

    fraction: float = 0.1
    min_nodes: int = 8
    hold_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError("mass silence fraction must be in (0, 1]")
        if self.min_nodes < 1 or self.hold_s < 0:
            raise ValueError("mass silence min_nodes must be >= 1 and hold_s >= 0")


@dataclass(frozen=True)
class Hold:
    """A mass silence's hold: deaths are not declared from ``since`` until ``until``, but for nodes
    silent at least ``declare_over`` (a renewed hold: those silent through the one before)."""

    since: float
    until: float
    reason: str
    declare_over: float = math.inf


def mass_hold(now: float, dying: int, recent: int, nodes: int, last: Hold | None, settings: MassSilence,
              returned: int = 0) -> Hold | None:
    """The hold in force now, if any. ``dying``: nodes this judgement finds dead and not yet declared;
    ``recent``: nodes declared dead within the last ``dead_after_s``; ``nodes``: those judged;
    ``returned``: those of ``dying`` heard since ``last`` began. A hold lasts ``hold_s``; another may
    start only ``hold_s`` after it ended, so a real mass failure is declared at most ``hold_s`` late,
    and a leader overloaded for longer cannot hold forever. Except: when the nodes heard during the
    hold and silent again are a mass, the leader is still overloaded (measured: a new leader's reconnect
    storm at 2,000 nodes; those declared at the end of a hold had been heard 3 s before, and declaring
    hundreds at once pushed epochs to every stream and starved it further, until it lost its lease).
    They are held again; those silent through the whole hold are declared (``declare_over``). A node
    dying during a hold is declared at the end of the next at the latest."""
    if settings.hold_s <= 0:
        return None
    if last is not None and now < last.until:
        return last
    limit = max(settings.min_nodes, settings.fraction * nodes)
    if last is not None and now < last.until + settings.hold_s:
        if returned == 0 or returned + recent <= limit:
            return None
        reason = (f"{returned} node(s) heard during the last mass silence's hold are silent again ({recent} more "
                  f"declared dead in the last seconds; a mass is > {limit:g} of {nodes}): this leader is still "
                  f"overloaded or cut off; held {settings.hold_s:g}s more (those silent through the hold are "
                  f"declared)")
        return Hold(now, now + settings.hold_s, reason, now - last.since)
    if dying == 0 or dying + recent <= limit:
        return None
    reason = (f"{dying} node(s) silent at once ({recent} more declared dead in the last seconds; a mass is "
              f"> {limit:g} of {nodes}): more likely this leader overloaded or cut off than that many deaths; "
              f"deaths held for {settings.hold_s:g}s")
    return Hold(now, now + settings.hold_s, reason)


RECONNECT_MAX = 3.0  # a reconnect storm's grace ends at most this many failover graces after the election


def reconnect_grace_until(since: float, last_arrival: float | None, grace_s: float, quiet_s: float,
                          now: float | None = None, many_missing: bool = False) -> float:
    """Until when the nodes a new leader (elected at ``since``) has not heard from yet stay in grace:
    ``grace_s`` after the election, and while nodes keep arriving (the last at ``last_arrival``) until
    ``quiet_s`` after the last one, at most ``RECONNECT_MAX x grace_s`` after the election. 2,000 agents
    re-opening mTLS streams to a loaded new leader outlast a fixed grace (measured: half of them back
    after 12-17 s), and every node the grace cuts off is a live node fenced; a node that died with the
    old leader is declared at most ``RECONNECT_MAX x grace_s`` after the election. While a mass of the
    nodes has not come back yet (``many_missing``) the storm goes on even through a gap in the arrivals
    (until ``quiet_s`` after ``now``): a stalled leader's gap of 2.5 s had ended a 2,000-node storm's grace
    while half of the nodes were still to come, and fenced 80 live nodes heard 2.6-3.7 s before."""
    base = since + grace_s
    if last_arrival is None:
        return base
    end = last_arrival + quiet_s
    if many_missing and now is not None:
        end = max(end, now + quiet_s)
    return max(base, min(end, since + RECONNECT_MAX * grace_s))


@dataclass
class Reconnects:
    """A leadership term's reconnect storm: when it began, the nodes heard since and the last of them
    to arrive. A node heard keeps its grace too: in a storm a re-opened stream's next heartbeats are
    late for the same reasons its first was (measured: 58 of 2,000 live nodes fenced 3 s after a
    takeover, each heard once, then its beacons and probe answers queued behind the reconnects)."""

    since: float
    grace_s: float  # failover_grace_s
    last: float | None = None
    until: float = 0.0  # the grace granted so far
    logged: bool = False
    heard: set[str] = field(default_factory=set)

    def arrived(self, node_id: str, now: float, live: Liveness) -> None:
        """A heartbeat of ``node_id``: its first on this leader while in grace extends the storm."""
        if live.grace_until > now and node_id not in self.heard:
            self.heard.add(node_id)
            self.last = now

    def missing(self, now: float, liveness: Mapping[str, Liveness], nodes: Mapping[str, Any],
                rule: MassSilence) -> bool:
        """Whether a mass of the nodes (as :func:`mass_hold` counts one) has yet to re-open its stream
        in this storm: those still in grace, unheard, registered in ``nodes`` and not fenced."""
        if self.last is None or now >= self.since + RECONNECT_MAX * self.grace_s:
            return False
        unheard = sum(1 for n, live in liveness.items() if live.grace_until > now and n not in self.heard
                      and (node := nodes.get(n)) is not None and not node.fenced)
        return unheard > max(rule.min_nodes, rule.fraction * len(liveness))

    def extend(self, now: float, liveness: Mapping[str, Liveness], quiet_s: float, many_missing: bool = False) -> int:
        """Extends the grace of the nodes still in it (heard or not) to :func:`reconnect_grace_until`; how
        many."""
        until = reconnect_grace_until(self.since, self.last, self.grace_s, quiet_s, now, many_missing)
        if until <= self.until or until <= now or until <= self.since + self.grace_s:
            return 0
        self.until, extended = until, 0
        for live in liveness.values():
            if live.grace_until > now:
                live.grace_until, extended = max(live.grace_until, until), extended + 1
        return extended
