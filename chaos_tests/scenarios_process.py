"""Scenarios where processes die or hang: an agent, a worker, a whole node (one or two at once), a
node frozen by SIGSTOP, and the restore of a node-local job on a spare."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable

from ftd.coordinator.buddies import Peer, choose_buddy
from ftd.ftctl import isolated
from ftd.waiting import wait_for

from . import promql_check
from .faults import signal_all, still_running
from .invariants import Check
from .scenario import Context, Outcome, Scenario, Shape, within

RECOVER_S = 60.0


def kill_node(ctx: Context, node: str) -> list[int]:
    """A node lost at once: its agent and every training process SIGKILLed (power cut)."""
    pids = [ctx.agent(node).pid, *ctx.worker_pids(node)]
    signal_all(pids, signal.SIGKILL)
    return pids


def death_at(ctx: Context, node: str, after_seq: int) -> float | None:
    """When ``node`` was declared dead after event ``after_seq`` (the first time), from the event log."""
    return min((float(e["at_unix_s"]) for e in ctx.events() if int(e["seq"]) > after_seq
                and e["kind"] == "node_dead" and e["node_id"] == node), default=None)


def promoted(ctx: Context, lost: set[str], before_spares: Iterable[str]) -> Check:
    world = ctx.wait_world_without(lost, RECOVER_S)
    taken = sorted(set(world) & set(before_spares))
    return Check("spare_promoted", len(taken) == len(lost),
                 f"world {world}: spare(s) {taken} took the rank(s) of {sorted(lost)}")


def agent_kill(ctx: Context) -> Outcome:
    """The agent alone is SIGKILLed (OOM killer, a bug): its workers must not go on without
    supervision, the node is declared dead and the spare takes its rank."""
    b = ctx.baseline()
    victim = b.world[-1]
    workers = ctx.worker_pids(victim)
    os.kill(ctx.agent(victim).pid, signal.SIGKILL)
    checks = [promoted(ctx, {victim}, b.spares)]
    orphans_gone = not still_running(workers, 20.0)
    checks.append(Check("orphan_workers_exit", orphans_gone,
                        f"the dead agent's workers {workers} {'exited' if orphans_gone else 'still run'}"))
    ctx.wait_progress(10, RECOVER_S)
    return Outcome(b, frozenset({victim}), f"agent of {victim} killed; workers {workers}", checks)


def worker_kill(ctx: Context) -> Outcome:
    """One training process SIGKILLed: the agent restarts the round on the same nodes, nobody is
    declared dead, training resumes from memory."""
    b = ctx.baseline()
    victim = b.world[0]
    pids = ctx.worker_pids(victim)
    signal_all(pids[:1], signal.SIGKILL)
    restarted = wait_for(lambda: ctx.starts_since(b.at_unix_s),
                         RECOVER_S, "a restarted round")
    ctx.wait_progress(10, RECOVER_S)
    world = ctx.world()
    return Outcome(b, frozenset(), f"worker {pids[:1]} of {victim} killed; {len(restarted)} rank(s) restarted",
                   [Check("same_members", set(world) == set(b.world), f"world {world} (before {list(b.world)})")])


def node_hang(ctx: Context) -> Outcome:
    """A node frozen (SIGSTOP on its agent and workers: sockets stay open, nothing answers): declared
    dead by missed heartbeats and replaced; once thawed it is fenced and does not rejoin the world."""
    b = ctx.baseline()
    victim = b.world[-1]
    pids = [ctx.agent(victim).pid, *ctx.worker_pids(victim)]
    signal_all(pids, signal.SIGSTOP)
    try:
        checks = [promoted(ctx, {victim}, b.spares)]
        ctx.wait_progress(10, RECOVER_S)
    finally:
        signal_all(pids, signal.SIGCONT)
    old_workers = pids[1:]
    exited = not still_running(old_workers, 30.0)
    checks.append(Check("thawed_workers_stopped", exited,
                        f"the frozen node's old workers {old_workers} {'stopped' if exited else 'still run'}"))
    ctx.wait_progress(10, RECOVER_S)
    world = ctx.world()
    checks.append(Check("thawed_node_not_in_world", victim not in world, f"world after thaw {world}"))
    return Outcome(b, frozenset({victim}), f"{victim} frozen (pids {pids}) until replaced", checks)


def _buddies(nodes: list[str], racks: int) -> dict[str, str | None]:
    peers = [Peer(n, f"r{int(n.rsplit('-', 1)[1]) % racks}", True) for n in nodes]
    return {p.node_id: choose_buddy(p.node_id, p.domain, peers).node_id for p in peers}


def double_failure(ctx: Context) -> Outcome:
    """Two active nodes lost at once, neither the other's buddy: both ranks move to the two spares in
    the next epoch and resume from their buddies' memory."""
    b = ctx.baseline()
    every = sorted({*b.world, *b.spares})
    buddy = _buddies(every, ctx.shape.racks)
    pairs = [(x, y) for i, x in enumerate(b.world) for y in b.world[i + 1:] if buddy[x] not in (x, y)
             and buddy[y] not in (x, y)]
    x, y = pairs[0]
    kill_node(ctx, x)
    kill_node(ctx, y)
    checks = [promoted(ctx, {x, y}, b.spares)]
    ctx.wait_progress(10, RECOVER_S)
    return Outcome(b, frozenset({x, y}), f"{x} and {y} killed together (buddies {buddy[x]}, {buddy[y]})", checks)


def spare_restore_node_local(ctx: Context) -> Outcome:
    """No shared HDD, no S3 and no memory tier: every copy of the dead rank's shard is on the node
    that dies. The job is data parallel (replicated state): the spare reads the surviving rank's SSD
    copy through that node's agent, and training resumes from the newest checkpoint, never step 0."""
    b = ctx.baseline()
    victim = b.world[-1]
    kill_node(ctx, victim)
    checks = [promoted(ctx, {victim}, b.spares)]
    ctx.wait_progress(10, RECOVER_S)
    starts = ctx.starts_since(b.at_unix_s)
    low = min((int(r["restored_step"]) for r in starts), default=-1)
    sources = sorted({str(r.get("restored_from", "")) for r in starts})
    checks.append(Check("resumed_from_a_checkpoint", bool(starts) and low >= 0,
                        f"ranks restarted at restored step {low} (not from step 0); sources {sources}"))
    spare = [str(r.get("restored_from", "")) for r in starts if r.get("node") in b.spares]
    checks.append(Check("spare_read_a_peer_copy", bool(spare) and all("pulled through the agent" in s for s in spare),
                        f"the spare restored from {spare}"))
    return Outcome(b, frozenset({victim}), f"{victim} killed; restored from {sources}", checks)


def _mirror_as_of(address: str) -> float:
    """A standby's ``ftd_coordinator_memory_mirror_as_of_unix_seconds`` (0 when it cannot be read)."""
    with contextlib.suppress(OSError):
        return promql_check.gauge(promql_check.scrape(address, timeout_s=2.0),
                                  "ftd_coordinator_memory_mirror_as_of_unix_seconds") or 0.0
    return 0.0


def leader_and_node_kill(ctx: Context) -> Outcome:
    """The leading coordinator and an active node SIGKILLed together (one power cut): the standby,
    which followed the leader's memory ledger, takes over; the node, silent since, is declared dead once
    the failover grace ends (the followed report does not hide it) and the spare takes its rank; the live
    node keeps its rank; the job resumes from memory, never older than the restore target before."""
    b = ctx.baseline()  # asks the restore target: the leader pins it as the floor first
    old = str(ctx.status().leader_id)
    leader = next(c for c in ctx.cluster.coordinators if c.name == old)
    standby = next(c for c in ctx.cluster.coordinators if c.name != old)
    metrics = f"{ctx.host(standby.name).address}:{isolated.COORDINATOR_METRICS_PORT}"
    now = time.time()
    followed = within(lambda: _mirror_as_of(metrics) >= now, 10.0, f"{standby.name} following the memory ledger")
    victim = b.world[-1]
    signal_all([leader.pid, ctx.agent(victim).pid, *ctx.worker_pids(victim)], signal.SIGKILL)
    checks = [Check("standby_followed_the_ledger", bool(followed),
                    f"{standby.name} held every memory report {old} took before the kill" if followed else
                    f"{standby.name}'s followed ledger did not reach the kill's time within 10s")]
    checks.append(promoted(ctx, {victim}, b.spares))
    ctx.wait_progress(10, RECOVER_S)
    status = ctx.status()
    checks.append(Check("standby_leads", status.leader_id == standby.name, f"{status.leader_id} leads"))
    starts = ctx.starts_since(b.at_unix_s)
    sources = sorted({str(r.get("restored_from", "")) for r in starts})
    checks.append(Check("resumed_from_memory", bool(starts) and all("mem" in s for s in sources),
                        f"{len(starts)} rank start(s) restored from {sources}"))
    return Outcome(b, frozenset({victim}), f"leader {old} and {victim} killed together; {standby.name} took over",
                   checks)


DETECT_BOUND_S = 5.0  # the lab's detection bound: dead_after_s (2.5 s) plus ticks, on a loaded box


def standby_and_node_kill(ctx: Context) -> Outcome:
    """A hot standby coordinator and an active node SIGKILLed together. Every agent keeps a warm
    channel to the standby and the standby follows the leader's memory ledger; its death must neither
    hide the dead node (declared within the detection bound, the spare takes its rank) nor make a live
    one look dead, and the leader keeps leading: no election, no other death."""
    b = ctx.baseline()
    leader = str(ctx.status().leader_id)
    standby = next(c for c in ctx.cluster.coordinators if c.name != leader)
    victim = b.world[-1]
    killed_at = time.time()
    signal_all([standby.pid, ctx.agent(victim).pid, *ctx.worker_pids(victim)], signal.SIGKILL)
    checks = [promoted(ctx, {victim}, b.spares)]
    died = death_at(ctx, victim, b.last_seq)
    took = died - killed_at if died is not None else None
    checks.append(Check("death_not_hidden", took is not None and took <= DETECT_BOUND_S,
                        f"{victim} declared dead {took:.2f}s after the kill (bound {DETECT_BOUND_S:g}s)"
                        if took is not None else f"no node_dead event for {victim}"))
    ctx.wait_progress(10, RECOVER_S)
    elected = [e for e in ctx.events() if int(e["seq"]) > b.last_seq and e["kind"] == "leader_elected"]
    status = ctx.status()
    checks.append(Check("leader_kept", status.leader_id == leader and not elected and not still_running(
        [standby.pid], 0.0), f"{status.leader_id} leads ({leader} before); {len(elected)} election(s); standby "
                         f"{standby.name} (pid {standby.pid}) killed"))
    return Outcome(b, frozenset({victim}), f"standby {standby.name} and {victim} killed together; {leader} led on",
                   checks)


SCENARIOS = [
    Scenario("agent-kill", "the agent alone SIGKILLed: node declared dead, spare promoted, orphans stop",
             agent_kill),
    Scenario("worker-kill", "one training process SIGKILLed: the round restarts on the same nodes", worker_kill),
    Scenario("node-hang", "agent and workers SIGSTOPped: declared dead, replaced, fenced when thawed", node_hang),
    Scenario("double-failure", "two active nodes killed at once: two spares take their ranks", double_failure,
             Shape(nodes=3, spares=2)),
    Scenario("spare-restore-node-local", "no shared HDD, no S3, no memory tier: the spare restores the dead "
             "rank from a surviving node's SSD copy, never from step 0", spare_restore_node_local,
             Shape(memory_every=0, persist_every=5, agent_args=("--no-mem-tier",))),
    Scenario("leader-and-node-kill", "the leading coordinator and an active node SIGKILLed together: the standby "
             "that followed the memory ledger takes over, the node is declared dead, the job resumes from memory",
             leader_and_node_kill, Shape(coordinators=2)),
    Scenario("standby-and-node-kill", "a hot standby coordinator and an active node SIGKILLed together: the "
             "node is declared dead within the bound, nobody else, the leader leads on", standby_and_node_kill,
             Shape(coordinators=2)),
]
