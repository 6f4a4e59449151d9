"""Membership decisions as pure functions that return a reason.

:func:`choose_spare` picks the spare that takes a dead node's rank; :func:`plan` turns the
detector's verdicts plus the durable state into the next world (or nothing to do). The control loop
commits a plan in one etcd transaction and only then believes it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .detector import State, Verdict
from .model import Fence, NodeRecord, Role, World

# A tick whose placement inputs did not change since a plan found nothing to do plans again at most this
# late: the inputs the key leaves out (a spare's health ageing, a straggler mark) wait this long at most.
REPLAN_EVERY_S = 0.5


@dataclass(frozen=True)
class Choice:
    node_id: str | None
    reason: str


def choose_spare(
    dead: NodeRecord, candidates: Sequence[NodeRecord], domain_label: str = "rack"
) -> Choice:
    """Prefers a spare in the dead node's failure domain (``labels[domain_label]``): its data and
    network locality match the rank it inherits. Ties go to the longest-registered spare (a warm,
    proven node), then to the id for determinism."""
    if not candidates:
        return Choice(None, f"no alive spare to replace {dead.node_id}")
    ordered = sorted(candidates, key=lambda n: (n.registered_unix_s, n.node_id))
    domain = dead.labels.get(domain_label)
    if domain is not None:
        for node in ordered:
            if node.labels.get(domain_label) == domain:
                return Choice(node.node_id, f"{node.node_id} is a spare in the same {domain_label} ({domain})")
        first = ordered[0]
        return Choice(
            first.node_id,
            f"no spare in {domain_label} {domain}; {first.node_id} is the longest-registered spare",
        )
    first = ordered[0]
    return Choice(first.node_id, f"{first.node_id} is the longest-registered spare")


@dataclass(frozen=True)
class Plan:
    """What to commit: the next world (``None`` when only node records change), updated node
    records, and human-readable lines for the event log."""

    world: World | None
    nodes: tuple[NodeRecord, ...] = ()
    events: tuple[tuple[str, str, str], ...] = ()  # (kind, node_id, message)
    reason: str = ""
    dead: tuple[str, ...] = field(default=())


def _names(ids: Sequence[str], shown: int = 8) -> str:
    head = ", ".join(ids[:shown])
    return head if len(ids) <= shown else f"{head} and {len(ids) - shown} more"


def _alive(verdicts: Mapping[str, Verdict], node_id: str) -> bool:
    verdict = verdicts.get(node_id)
    return verdict is not None and verdict.state is State.ALIVE


def plan(
    now_unix: float,
    world: World,
    nodes: Mapping[str, NodeRecord],
    verdicts: Mapping[str, Verdict],
    domain_label: str = "rack",
    max_fences: int = 40,
    unfit: Mapping[str, str] | None = None,
    leaving: Collection[str] = (),
) -> Plan | None:
    """The next membership step, or ``None`` when the world is as it should be.

    1. Every dead node is fenced (active or spare) so it can only come back as a spare.
    2. Each dead rank goes to a spare (:func:`choose_spare`); with none left the world shrinks.
    3. Alive nodes that registered as active and hold no rank join (the target size grows).
    4. While the world is below its target, alive spares fill it.

    Nodes in ``leaving`` (their verdict is DEAD) go by a planned hand-over: fenced and replaced like the
    dead, but their events say so and the new world records them in ``handed_over``, so the job's
    rendezvous does not count a failure. Spares in ``unfit`` (node id → why, e.g. a failing health
    check) are never promoted; the first promotion they are passed over for says so in its event.

    At most ``max_fences`` dead nodes are handled per epoch so that one commit stays within the
    store's transaction size (etcd's ``--max-txn-ops``); the rest follow in the next epochs, a tick
    apart. Joins are summarised in one event.
    """
    dead = sorted(
        n for n, v in verdicts.items() if v.state is State.DEAD and n in nodes and not nodes[n].fenced
    )[:max_fences]
    next_epoch = world.epoch + 1
    updates: dict[str, NodeRecord] = {}
    events: list[tuple[str, str, str]] = []
    reasons: list[str] = []

    for node_id in dead:
        why = verdicts[node_id].reason
        updates[node_id] = nodes[node_id].with_fence(Fence(next_epoch, why, now_unix))
        if node_id in leaving:
            events.append(("node_handed_over", node_id, f"{node_id} handed over: {why}"))
        else:
            events.append(("node_dead", node_id, f"{node_id} declared dead: {why}"))

    in_world = set(world.ranks)
    unfit = unfit or {}
    candidates = [
        n for n in nodes.values()
        if n.node_id not in in_world and not n.fenced and n.node_id not in updates
        and n.requested_role is Role.SPARE and _alive(verdicts, n.node_id)
    ]
    pool = [n for n in candidates if n.node_id not in unfit]
    passed_over = "; ".join(f"{n.node_id} passed over: {unfit[n.node_id]}"
                            for n in sorted(candidates, key=lambda n: n.node_id) if n.node_id in unfit)
    ranks: list[str | None] = list(world.ranks)
    for index, node_id in enumerate(world.ranks):
        if node_id not in updates:
            continue
        gone = "handed over" if node_id in leaving else "dead"
        choice = choose_spare(nodes[node_id], pool, domain_label)
        if passed_over:
            choice = Choice(choice.node_id, f"{choice.reason} ({passed_over})")
            passed_over = ""
        ranks[index] = choice.node_id
        if choice.node_id is not None:
            pool = [n for n in pool if n.node_id != choice.node_id]
            events.append(("spare_promoted", choice.node_id,
                           f"{choice.node_id} takes rank {index} of {node_id}: {choice.reason}"))
            reasons.append(f"{node_id} {gone}, {choice.node_id} promoted to rank {index}")
        else:
            events.append(("world_shrunk", node_id, f"rank {index} of {node_id} dropped: {choice.reason}"))
            reasons.append(f"{node_id} {gone}, no spare: world shrinks")
    new_ranks = [r for r in ranks if r is not None]
    target = world.target_size

    joiners = sorted(
        (n for n in nodes.values()
         if n.requested_role is Role.ACTIVE and not n.fenced and n.node_id not in in_world
         and n.node_id not in updates and _alive(verdicts, n.node_id)),
        key=lambda n: (n.registered_unix_s, n.node_id),
    )
    for node in joiners:
        new_ranks.append(node.node_id)
        target += 1
    if joiners:
        names = _names([n.node_id for n in joiners])
        first = len(new_ranks) - len(joiners)
        events.append(("nodes_joined", joiners[0].node_id if len(joiners) == 1 else "",
                       f"{names} joined as ranks {first}..{len(new_ranks) - 1}"))
        reasons.append(f"{len(joiners)} active node(s) joined: {names}")

    while len(new_ranks) < target and pool and len(events) < 2 * max_fences:
        spare = sorted(pool, key=lambda n: (n.registered_unix_s, n.node_id))[0]
        pool.remove(spare)
        new_ranks.append(spare.node_id)
        events.append(("spare_promoted", spare.node_id,
                       f"{spare.node_id} fills rank {len(new_ranks) - 1}: the world was below its target"))
        reasons.append(f"{spare.node_id} promoted to restore the world size")

    if tuple(new_ranks) == world.ranks and not updates:
        return None
    new_world = None
    if tuple(new_ranks) != world.ranks or target != world.target_size:
        reason = "; ".join(reasons) or "fenced dead nodes"
        if len(new_ranks) < target:
            reason += f" (degraded: {len(new_ranks)} of {target} ranks, no spare left)"
        new_world = replace(world, epoch=next_epoch, ranks=tuple(new_ranks), target_size=target,
                            reason=reason, changed_unix_s=now_unix,
                            handed_over=tuple(n for n in dead if n in leaving))
        events.append(("epoch_changed", "", f"epoch {next_epoch}: {reason}"))
    else:
        # Only spares died: fence them at the current epoch, the world itself is untouched.
        updates = {k: v.with_fence(replace(v.fence, epoch=world.epoch)) if v.fence else v
                   for k, v in updates.items()}
    summary = new_world.reason if new_world else "; ".join(e[2] for e in events)
    return Plan(new_world, tuple(updates.values()), tuple(events), summary, tuple(dead))


def replan_due(now: float, inputs: Hashable, last: tuple[Hashable, float] | None,
               every_s: float = REPLAN_EVERY_S) -> bool:
    """Whether a tick runs :func:`plan` again. At 2,000 nodes a plan and the spares' fitness cost ~4 ms,
    ten times a second, for nothing when no verdict, record or drain changed (``inputs``, the caller's
    key of them) since one found nothing to do (``last``: its key and when; None after a commit)."""
    return last is None or last[0] != inputs or now - last[1] >= every_s


def collectable(now_unix: float, world: World, nodes: Mapping[str, NodeRecord], retention_s: float,
                keep: Collection[str] = (), limit: int = 50) -> list[str]:
    """Node records that may be removed: fenced more than ``retention_s`` ago, holding no rank, and
    not in ``keep`` (a pending drain, a hang report, an open heartbeat stream). Oldest fence first,
    at most ``limit`` (one commit's worth); a fenced node that registered again has no fence."""
    ranked = set(world.ranks)
    old = [(n.fence.at_unix_s, n.node_id) for n in nodes.values()
           if n.fence is not None and n.fence.at_unix_s + retention_s < now_unix
           and n.node_id not in ranked and n.node_id not in keep]
    return [node_id for _, node_id in sorted(old)[:limit]]
