"""Scenarios where the network fails: a node cut off both ways, and healed."""

from __future__ import annotations

from .invariants import Check
from .scenario import Context, Outcome, Scenario
from .scenarios_process import RECOVER_S, promoted


def node_partition(ctx: Context) -> Outcome:
    """One active node cut off from everyone, both ways (nftables on its link): it is declared dead
    and replaced; healed, it does not get its rank back (its epoch is over)."""
    b = ctx.baseline()
    victim = b.world[-1]
    host = ctx.host(victim)
    ctx.lab.partition(host)
    try:
        checks = [promoted(ctx, {victim}, b.spares)]
        ctx.wait_progress(10, RECOVER_S)
    finally:
        ctx.lab.heal(host)
    ctx.wait_progress(10, RECOVER_S)
    world = ctx.world()
    checks.append(Check("healed_node_not_in_world", victim not in world, f"world after heal {world}"))
    return Outcome(b, frozenset({victim}), f"{victim} ({host.address}) cut off both ways, then healed", checks)


SCENARIOS = [
    Scenario("node-partition", "one node cut off both ways: declared dead, replaced; healed, not back in the world",
             node_partition),
]
