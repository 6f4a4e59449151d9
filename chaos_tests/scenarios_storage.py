"""Scenarios where storage fails under the cluster: an etcd member killed, all of etcd down for 20 s,
the S3 cold tier unreachable, a node's SSD tier full. None of them may cost a node its rank: no one
is declared dead, no epoch changes, training goes on, and the storage's return is noticed (the
member rejoins, commits and migrations resume, durable saves succeed again)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from ftd.v1 import checkpoint_pb2, coordinator_pb2
from ftd.waiting import Timeout, wait_for

from . import storage_lab
from .faults import alive
from .invariants import Check
from .observe import watch
from .scenario import Context, Outcome, Scenario, Shape
from .storage_lab import LabEtcdMembers

RECOVER_S = 60.0
OUTAGE_S = 20.0  # etcd-outage: every member down this long (the figure)
S3_OUTAGE_S = 15.0
DISK_NODE = "node-0"  # disk-full: the active node whose SSD tier is a small tmpfs
TMPFS_SIZE = "2m"


def _epoch_changes(ctx: Context, after_seq: int) -> list[int]:
    return [int(e["epoch"]) for e in ctx.events() if int(e["seq"]) > after_seq and e["kind"] == "epoch_changed"]


def _steps_per_s(ctx: Context, t0: float, t1: float) -> float:
    """Training steps per second between the Unix times ``t0`` and ``t1`` (from the job's log)."""
    steps = {int(r["step"]) for r in ctx.records() if r.get("event") == "step" and t0 <= float(r["t"]) <= t1}
    return len(steps) / max(t1 - t0, 1e-3)


def _status_probe(ctx: Context) -> str:
    """What ``ftctl status`` would get right now, in a few words (for the detail, not a check)."""
    try:
        st = ctx.client.status(deadline_s=1.5)
    except ConnectionError as exc:
        return f"no answer ({str(exc)[:160]})"
    return f"answered: leader {st.leader_id or 'none'}, epoch {st.epoch}, etcd_reachable {st.etcd_reachable}"


def _reconnects(ctx: Context) -> float:
    """Heartbeat sessions re-established, summed over every agent (``ftd_agent_reconnects_total``)."""
    return sum(storage_lab.metric(ctx, a.name, "ftd_agent_reconnects_total") for a in ctx.cluster.agents)


def _no_epoch_change(ctx: Context, after_seq: int, epoch: int) -> Check:
    changes = _epoch_changes(ctx, after_seq)
    now = ctx.status().epoch
    return Check("no_epoch_change", not changes and now == epoch,
                 f"epoch {epoch} before, {now} after; epoch changes since the fault: {changes or 'none'}")


def _newest(ctx: Context, pred: Callable[[checkpoint_pb2.CheckpointInfo], bool]) -> int:
    return max((int(c.step) for c in ctx.checkpoints() if pred(c)), default=-1)


def _wait_checkpoint(ctx: Context, pred: Callable[[checkpoint_pb2.CheckpointInfo], bool], timeout_s: float,
                     what: str) -> int | None:
    """The newest step of a checkpoint that satisfies ``pred``, waited for; None on the deadline."""
    def found() -> int | None:
        with contextlib.suppress(ConnectionError):
            step = _newest(ctx, pred)
            return step if step >= 0 else None
        return None

    try:
        return int(wait_for(found, timeout_s, what, interval_s=0.3))
    except Timeout:
        return None


def _on(tier: str) -> Callable[[checkpoint_pb2.CheckpointInfo], bool]:
    return lambda c: bool(c.on_tier.get(tier, False))


def _after(step: int, tier: str | None = None) -> Callable[[checkpoint_pb2.CheckpointInfo], bool]:
    """A valid checkpoint newer than ``step`` (with every rank's good copy on ``tier``)."""
    return lambda c: c.step > step and c.valid and (tier is None or bool(c.on_tier.get(tier, False)))


# -- etcd ---------------------------------------------------------------------------------------


def etcd_member_kill(ctx: Context) -> Outcome:
    """The raft leader of a 3-member etcd SIGKILLed: the two left elect a leader and keep quorum, the
    coordinator serves throughout, nobody is declared dead, no epoch changes, checkpoint commits go on
    (memory snapshots and durable ones); the member started again on its data dir rejoins."""
    etcd = LabEtcdMembers(ctx)
    b = ctx.baseline()
    epoch = int(ctx.status().epoch)
    victim = etcd.leader()
    others = [i for i in range(len(etcd)) if i != victim]
    step_at_kill = ctx.step()
    sessions = _reconnects(ctx)
    pid = etcd.kill(victim)
    checks: list[Check] = []
    try:
        new_leader = etcd.leader(among=others)
        checks.append(Check("etcd_quorum_kept", new_leader in others,
                            f"etcd{victim} (the leader, pid {pid}) killed; etcd{new_leader} leads the other two"))
        seen = watch(ctx.cluster, seconds=5.0)
        # Not a failure by itself: when electing etcd's new leader outlasts 5/6 of the coordinator's
        # lease TTL (confirmed up to a third of a TTL before the kill), the coordinator suspends its
        # leadership for a moment, refuses a status call (UNAVAILABLE, retried for the call's 1 s
        # deadline) and every agent reconnects. What an operator must see is an answer at least every
        # 2 s: the gap bounds the suspension, the failures are reported.
        renewed = _reconnects(ctx) - sessions
        served = seen.status_ok > 0 and seen.longest_gap_s < 2.0
        checks.append(Check("coordinator_served", served,
                            f"{seen.status_ok} status answers, {seen.status_failed} failed, longest gap "
                            f"{seen.longest_gap_s:.2f}s while etcd{victim} was down"))
        checks.append(Check("nothing_disrupted", not seen.dead_seen and seen.epochs_seen == {epoch}
                            and not seen.fenced_agents,
                            f"dead {sorted(seen.dead_seen)}, epochs {sorted(seen.epochs_seen)}, fenced "
                            f"{sorted(seen.fenced_agents)}; heartbeat sessions re-established: {renewed:g}"))
        restorable = _wait_checkpoint(ctx, _after(step_at_kill), RECOVER_S, "a valid checkpoint newer than the kill")
        durable = _wait_checkpoint(ctx, _after(step_at_kill, "ssd"), RECOVER_S,
                                   "a durable checkpoint newer than the kill")
        target = ctx.restorable_step()
        still_down = not alive(pid) and not etcd.healthy(victim)
        checks.append(Check("commits_during_fault", restorable is not None and durable is not None
                            and target > step_at_kill and still_down,
                            f"killed at step {step_at_kill}; while etcd{victim} was down: newest valid step "
                            f"{restorable}, newest on every SSD {durable}, restore target {target}"))
        ctx.wait_progress(10, RECOVER_S)
    finally:
        started_at = time.monotonic()
        new_pid = etcd.restart(victim)
    rejoined = False
    why = ""
    try:
        etcd.wait_healthy([victim], 30.0)
        leader = etcd.leader()
        st, leader_st = etcd.status(victim), etcd.status(leader)
        rejoined = st is not None and leader_st is not None and st.leader_id == leader_st.member_id
        why = (f"healthy after {time.monotonic() - started_at:.1f}s, follows etcd{leader} (the leader), raft index "
               f"{st.raft_index if st else '?'} (leader's {leader_st.raft_index if leader_st else '?'})")
    except Timeout as exc:
        why = str(exc)
    checks.append(Check("member_rejoined", rejoined, f"etcd{victim} restarted (pid {new_pid}) on its data dir: {why}"))
    ctx.wait_progress(10, RECOVER_S)
    checks.append(_no_epoch_change(ctx, b.last_seq, epoch))
    return Outcome(b, frozenset(), f"etcd raft leader etcd{victim} SIGKILLed at step {step_at_kill}, "
                                   f"restarted after {time.time() - b.at_unix_s:.0f}s", checks)


def etcd_outage(ctx: Context) -> Outcome:
    """Every etcd member SIGKILLed (a power cut of the etcd hosts) and started again on its data dir
    after 20 s. The coordinator changes nothing while it cannot commit: nobody declared dead, no
    agent fenced, no epoch change; training goes on from memory; afterwards the coordinator serves
    again and checkpoint commits resume."""
    etcd = LabEtcdMembers(ctx)
    b = ctx.baseline()
    epoch = int(ctx.status().epoch)
    members = list(range(len(etcd)))
    step_before = ctx.step()
    killed_at = time.monotonic()
    checks: list[Check] = []
    try:
        pids = [etcd.kill(i) for i in members]
        seen = watch(ctx.cluster, seconds=max(0.0, OUTAGE_S - 2.0 - (time.monotonic() - killed_at)),
                     query_coordinator=False)
        probe = _status_probe(ctx)  # at most 1.5 s
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))  # the outage's fixed length
        step_end = ctx.step()
        checks.append(Check("held_during_outage", not seen.fenced_agents and seen.epochs_seen == {epoch},
                            f"agents' epochs {sorted(seen.epochs_seen)}, fenced {sorted(seen.fenced_agents)} "
                            f"while etcd was down; ftctl status then: {probe}"))
        rate_before = _steps_per_s(ctx, b.at_unix_s - 2.0, b.at_unix_s)
        rate_during = _steps_per_s(ctx, b.at_unix_s, time.time())
        # Training goes on, slowed: each memory snapshot's commit fails only at its deadline.
        checks.append(Check("trained_during_outage", step_end >= step_before + 10,
                            f"step {step_before} -> {step_end} during the {OUTAGE_S:g}s outage ({rate_during:.1f} "
                            f"steps/s, {rate_before:.1f} in the 2s before)"))
    finally:
        down_s = time.monotonic() - killed_at
        for i in members:
            if i in etcd.argv:
                etcd.restart(i)
    etcd.wait_healthy(members, 30.0)
    back_at = time.monotonic()

    def serving() -> coordinator_pb2.ClusterStatus | None:
        with contextlib.suppress(ConnectionError):
            st: coordinator_pb2.ClusterStatus = ctx.client.status(deadline_s=1.0)
            if st.etcd_reachable and st.leader_id:
                return st
        return None

    status = wait_for(serving, 30.0, "the coordinator serving with etcd reachable", interval_s=0.3)
    checks.append(Check("coordinator_resumed", int(status.epoch) == epoch and not status.dead,
                        f"serving {time.monotonic() - back_at:.1f}s after etcd was healthy: leader "
                        f"{status.leader_id}, epoch {status.epoch}, dead {list(status.dead)}"))
    restorable = _wait_checkpoint(ctx, _after(step_end), RECOVER_S, "a valid checkpoint newer than the outage")
    durable = _wait_checkpoint(ctx, _after(step_end, "ssd"), RECOVER_S, "a durable checkpoint newer than the outage")
    target = ctx.restorable_step()
    checks.append(Check("commits_resumed", restorable is not None and durable is not None and target > step_end,
                        f"step {step_end} at the end of the outage; then newest valid {restorable}, durable "
                        f"{durable}, restore target {target}"))
    after = watch(ctx.cluster, seconds=3.0)
    checks.append(Check("nothing_disrupted_after", not after.dead_seen and after.epochs_seen == {epoch}
                        and not after.fenced_agents,
                        f"after: dead {sorted(after.dead_seen)}, epochs {sorted(after.epochs_seen)}, fenced "
                        f"{sorted(after.fenced_agents)}"))
    checks.append(_no_epoch_change(ctx, b.last_seq, epoch))
    return Outcome(b, frozenset(), f"all {len(members)} etcd members (pids {pids}) SIGKILLed for {down_s:.1f}s at "
                                   f"step {step_before}", checks)


# -- S3 -----------------------------------------------------------------------------------------


def s3_outage(ctx: Context) -> Outcome:
    """The S3 server's host cut off the lab for 15 s: training goes on (memory and SSD tiers), nobody
    is declared dead; the migration to S3 lags, and once S3 is back a checkpoint newer than the
    outage gets its S3 copy."""
    checks: list[Check] = []
    before = _wait_checkpoint(ctx, _on("s3"), RECOVER_S, "a checkpoint copied to S3 before the fault")
    checks.append(Check("s3_in_use", before is not None, f"newest step on S3 before the fault: {before}"))
    b = ctx.baseline()
    epoch = int(ctx.status().epoch)
    host = ctx.host("s3")
    step_at_cut = ctx.step()
    ctx.lab.partition(host)
    try:
        seen = watch(ctx.cluster, seconds=S3_OUTAGE_S)
        step_end = ctx.step()
        margin = 2 * ctx.shape.persist_every
        leaked = _newest(ctx, lambda c: c.step > step_at_cut + margin and bool(c.on_tier.get("s3", False)))
        target = ctx.restorable_step()
        durable = _newest(ctx, _after(step_at_cut, "ssd"))  # read last: the newest durable step at the heal
        errors = {n: storage_lab.metric(ctx, n, "ftd_agent_tier_errors_total", {"tier": "s3"}) for n in b.world}
        lag = {n: storage_lab.metric(ctx, n, "ftd_agent_tier_lag_steps", {"tier": "s3"}) for n in b.world}
    finally:
        ctx.lab.heal(host)
    checks.append(Check("s3_really_unreachable", leaked < 0,
                        f"no step after {step_at_cut + margin} reached S3 during the cut (newest: {leaked}); "
                        f"s3 tier errors {errors}, lag {lag}"))
    checks.append(Check("trained_without_s3", step_end >= step_at_cut + 20 and durable > step_at_cut
                        and target > step_at_cut,
                        f"step {step_at_cut} -> {step_end} during the cut; newest on every SSD {durable}, "
                        f"restore target {target}"))
    checks.append(Check("nothing_disrupted", not seen.dead_seen and seen.epochs_seen == {epoch}
                        and not seen.fenced_agents and seen.status_failed == 0,
                        f"dead {sorted(seen.dead_seen)}, epochs {sorted(seen.epochs_seen)}, fenced "
                        f"{sorted(seen.fenced_agents)}, status failures {seen.status_failed}"))
    # The newest durable checkpoint when S3 came back (made during the outage, so never copied yet)
    # must reach S3, every rank of it: the migration resumed and copies the newest first.
    healed = time.monotonic()
    copied = _wait_checkpoint(ctx, _after(durable - 1, "s3"), 45.0, f"step {durable} or newer on S3")
    checks.append(Check("migration_resumed", copied is not None and durable > step_at_cut + margin,
                        f"step {copied} (>= {durable}, the newest durable step at the heal) on S3 "
                        f"{time.monotonic() - healed:.1f}s after the heal" if copied is not None else
                        f"no step >= {durable} (the newest durable step at the heal) reached S3 within 45s"))
    checks.append(_no_epoch_change(ctx, b.last_seq, epoch))
    return Outcome(b, frozenset(), f"s3 ({host.address}) cut off for {S3_OUTAGE_S:g}s at step {step_at_cut}; "
                                   f"newest on S3 after the heal: {copied}", checks)


# -- a node's disk ------------------------------------------------------------------------------


def _ssd_dir(workdir: Path) -> Path:
    """The SSD tier of :data:`DISK_NODE`: the agent's default ``WORKDIR/ssd`` under its node dir."""
    return workdir / "cluster" / "nodes" / DISK_NODE / "ssd"


def _small_ssd(workdir: Path) -> None:
    storage_lab.mount_tmpfs(_ssd_dir(workdir), TMPFS_SIZE)


def _ssd_copy_of(node: str, step: int) -> Callable[[checkpoint_pb2.CheckpointInfo], bool]:
    """A checkpoint newer than ``step`` with a copy on ``node``'s own SSD."""
    return lambda c: c.step > step and any(cp.tier == "ssd" and cp.location == node
                                           for sh in c.shards for cp in sh.copies)


def _ssd_steps(ctx: Context, node: str) -> list[int]:
    """The steps with a copy on ``node``'s own SSD, per the catalog."""
    return [int(c.step) for c in ctx.checkpoints()
            if any(cp.tier == "ssd" and cp.location == node for sh in c.shards for cp in sh.copies)]


def disk_full(ctx: Context) -> Outcome:
    """One node's SSD tier (a 2 MiB tmpfs) filled to its last byte: its durable saves fail with
    disk_full (reported: save-failure metric, agent log), training goes on from memory snapshots,
    nobody is declared dead, no valid checkpoint is lost; with room again (a remount to 64 MiB) the
    node's durable saves succeed again."""
    ssd = _ssd_dir(ctx.workdir)
    node = DISK_NODE
    checks: list[Check] = []
    before = _wait_checkpoint(ctx, _ssd_copy_of(node, -1), RECOVER_S, f"a durable checkpoint on {node}'s SSD")
    checks.append(Check("saved_before", before is not None, f"newest step on {node}'s SSD before the fault: {before}"))
    b = ctx.baseline()
    epoch = int(ctx.status().epoch)
    reason = {"reason": "disk_full"}
    failures_before = storage_lab.metric(ctx, node, "ftd_agent_checkpoint_save_failures_total", reason)
    step_at_fill = ctx.step()
    ballast = storage_lab.fill(ssd)

    def failed() -> float | None:
        n = storage_lab.metric(ctx, node, "ftd_agent_checkpoint_save_failures_total", reason)
        return n if n > failures_before else None

    try:
        failures = wait_for(failed, 30.0, f"a disk_full save failure on {node}", interval_s=0.3)
    except Timeout:
        failures = 0.0
    lines = storage_lab.log_lines(ctx, node, "(disk_full)")
    error = lines[-1].split("failed on", 1)[-1].strip()[:240] if lines else "(none in the agent log)"
    checks.append(Check("disk_full_reported", failures > failures_before and bool(lines),
                        f"{node}: ssd filled ({ballast} bytes of ballast, {storage_lab.free_bytes(ssd)} free); "
                        f"ftd_agent_checkpoint_save_failures_total{{reason=disk_full}} {failures_before:g} -> "
                        f"{failures:g}; agent log: {error}"))
    step_full = ctx.step()
    ctx.wait_progress(30, RECOVER_S)
    target = ctx.restorable_step()
    world = ctx.world()
    step_freed = ctx.step()
    failures = storage_lab.metric(ctx, node, "ftd_agent_checkpoint_save_failures_total", reason)
    disk_free = storage_lab.metric(ctx, node, "ftd_agent_disk_free_bytes", {"tier": "ssd"})
    missing = [s for s in range(step_at_fill + 1, step_freed) if s % ctx.shape.persist_every == 0
               and s not in set(_ssd_steps(ctx, node))]
    checks.append(Check("trained_while_full", target > step_full and set(world) == set(b.world),
                        f"step {step_full} -> {step_freed} with the SSD full, restore target {target} (memory "
                        f"snapshots), world {world}; {failures - failures_before:g} disk_full failure(s), durable "
                        f"step(s) {missing} not on {node}'s SSD, ftd_agent_disk_free_bytes{{tier=ssd}} {disk_free:g}"))
    storage_lab.remount(ssd, "64m")
    freed = time.monotonic()
    again = _wait_checkpoint(ctx, _ssd_copy_of(node, step_freed), 30.0,
                             f"a durable checkpoint on {node}'s SSD after the remount")
    checks.append(Check("durable_saves_resumed", again is not None,
                        f"remounted at step {step_freed} ({storage_lab.free_bytes(ssd)} bytes free): step {again} "
                        f"on {node}'s SSD after {time.monotonic() - freed:.1f}s" if again is not None else
                        f"no durable step after {step_freed} on {node}'s SSD within 30s of the remount"))
    ctx.wait_progress(10, RECOVER_S)
    checks.append(_no_epoch_change(ctx, b.last_seq, epoch))
    return Outcome(b, frozenset(), f"{node}'s SSD tier ({TMPFS_SIZE} tmpfs) filled at step {step_at_fill}, "
                                   f"{failures - failures_before:g} disk_full save failure(s), given room at step "
                                   f"{step_freed}", checks)


SCENARIOS = [
    Scenario("etcd-member-kill", "the etcd raft leader SIGKILLed (1 of 3): nothing disrupted, commits go on, it "
             "rejoins", etcd_member_kill, Shape(etcd=3)),
    Scenario("etcd-outage", "every etcd member down for 20 s: no death, no epoch change, service and commits "
             "resume", etcd_outage, Shape(etcd=3)),
    Scenario("s3-outage", "the S3 server cut off for 15 s: training goes on, migration to S3 resumes after",
             s3_outage, Shape(s3=True)),
    Scenario("disk-full", "one node's SSD tier full: disk_full reported, training goes on, saves resume with "
             "room", disk_full, prepare=_small_ssd),
]
