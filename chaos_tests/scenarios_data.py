"""Scenarios where checkpoint data is damaged: a shard corrupted on disk, a save crashed half-way.
Both run the job with durable checkpoints only (no memory tier), so the restore reads the disks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ftd.checkpoints.layout import MANIFEST, shard_prefix
from ftd.waiting import Timeout, wait_for

from .faults import signal_all
from .invariants import Check
from .scenario import JOB, Context, Outcome, Scenario, Shape
from .scenarios_process import RECOVER_S

FAILPOINT = "ckpt.before_publish"  # the shard's files written, its manifest not yet published
DISK_ONLY = Shape(memory_every=0, persist_every=5, agent_args=("--no-mem-tier", "--tiering-interval-s", "0.5"))


def verify_steps(ctx: Context, steps: list[int]) -> Check:
    """``ftctl checkpoints verify`` (every copy of every rank, re-read and checksummed) on ``steps``."""
    bad = []
    for step in steps:
        res = subprocess.run([sys.executable, "-m", "ftd.ftctl.cli", "--workdir", ctx.cluster.workdir, "checkpoints",
                              "verify", str(step), "--job", JOB, "--json"], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            bad.append(f"step {step}: exit {res.returncode}: {_failed_copies(res.stdout)} {res.stderr[-300:]}")
    return Check("valid_steps_verify", bool(steps) and not bad,
                 f"ftctl checkpoints verify passed on steps {steps}" if not bad else "; ".join(bad))


def _failed_copies(stdout: str) -> str:
    """The copies ``ftctl checkpoints verify --json`` found bad, with why (else the output's tail)."""
    import json

    try:
        found = json.loads(stdout)
    except ValueError:
        return stdout[-300:]
    copies = found.get("copies", []) if isinstance(found, dict) else []
    bad = [f"rank {c.get('rank')} {c.get('tier')}@{c.get('location')}: {c.get('error')}" for c in copies
           if isinstance(c, dict) and not c.get("ok")]
    return "; ".join(bad)[:1000] if bad else stdout[-300:]


def arm_failpoint(workdir: Path) -> None:
    """Every agent and worker of the cluster gets the failpoint, unarmed (:func:`failpoint`)."""
    armed = workdir / "armed"
    armed.mkdir(parents=True, exist_ok=True)
    os.environ["FTD_FAILPOINTS"] = FAILPOINT
    os.environ["FTD_FAILPOINTS_ARMED"] = str(armed)


def crash_mid_save(ctx: Context) -> Outcome:
    """A rank is SIGKILLed in the middle of a durable save (its files written, the manifest not yet
    published): that step never becomes valid from the half-written shard, the agent restarts the
    round, every rank resumes from the newest valid step, and every valid step re-reads clean."""
    b = ctx.baseline()
    trigger = ctx.workdir / "armed" / FAILPOINT
    trigger.write_text("")
    fired = True
    try:
        wait_for(lambda: not trigger.exists(), 30.0, "a save reaching the armed failpoint", interval_s=0.05)
    except Timeout:
        fired = False
    starts = wait_for(lambda: ctx.starts_since(b.at_unix_s), RECOVER_S, "the round restarted after the crash")
    ctx.wait_progress(15, RECOVER_S)
    workers = [p for n in ctx.world() for p in ctx.worker_pids(n)]
    signal_all(workers, signal.SIGSTOP)  # no save and no retention while the valid steps are re-read
    try:
        settled = ctx.settled_checkpoints()  # a commit already in flight lands first
        verified = verify_steps(ctx, sorted(c.step for c in settled if c.valid)[-3:])
    finally:
        signal_all(workers, signal.SIGCONT)
    checks = [Check("save_crashed", fired, "a worker died at the failpoint " + FAILPOINT if fired
                    else "no save reached the failpoint"), verified]
    return Outcome(b, frozenset(), f"a rank killed at {FAILPOINT}; {len(starts)} rank(s) restarted from step "
                                   f"{min(int(r['restored_step']) for r in starts)}", checks)


def corrupt_shard(ctx: Context) -> Outcome:
    """Bits flip in a rank's SSD copy of the newest valid step. With the job frozen at that step (so
    it stays the restore target) and its HDD copy in place, a worker is killed: the rank finds the
    SSD copy's checksum wrong, records it corrupt, restores the same step from its HDD copy. The step
    stays valid; nothing older is used."""
    b0 = ctx.baseline()
    workers = {n: ctx.worker_pids(n) for n in b0.world}
    frozen = [p for pids in workers.values() for p in pids]
    signal_all(frozen, signal.SIGSTOP)  # no new saves: the newest valid step stays the target
    try:
        def on_both() -> tuple[int, list[Any]] | None:  # the newest valid step, on the HDD too, once settled
            got = ctx.settled_checkpoints(quiet_s=2.0)
            info = [c for c in got if c.valid]
            newest = max(info, key=lambda c: c.step) if info else None
            return (newest.step, got) if newest is not None and newest.on_tier.get("hdd") else None

        step, catalog = wait_for(on_both, 45.0, "the newest valid step on SSD and HDD", interval_s=0.2)
        b = ctx.baseline()
        # A newer step some ranks already committed would be completed by the others once they are
        # thawed, and become the target: the victim is a rank that committed none of them (its
        # in-flight write dies with it), so `step` stays the newest valid one.
        ahead = [{s.rank for s in c.shards if s.copies} for c in catalog if c.step > step]
        rank = min(range(len(b.world)), key=lambda r: sum(r in ranks for ranks in ahead))
        victim = b.world[rank]
        target = _corrupt(ctx, victim, step, rank)
        signal_all(workers[victim][:1], signal.SIGKILL)
    finally:
        signal_all(frozen, signal.SIGCONT)
    starts = wait_for(lambda: ctx.starts_since(b.at_unix_s), RECOVER_S, "the round restarted")
    ctx.wait_progress(10, RECOVER_S)
    info = next((c for c in ctx.checkpoints() if c.step == step), None)
    marked = {k: v for s in (info.shards if info else []) for k, v in s.bad.items()}
    sources = sorted({f"{r.get('node')}: {r.get('restored_from')}" for r in starts})
    restored = {int(r["restored_step"]) for r in starts}
    checks = [
        Check("corrupt_copy_recorded", any(k.startswith("ssd@") for k in marked),
              f"step {step}: bad copies {marked}" if marked else f"step {step}: no copy recorded corrupt"),
        Check("step_still_valid", bool(info and info.valid), f"step {step} valid: {bool(info and info.valid)}"),
        Check("restored_the_same_step", restored == {step},
              f"ranks restored {sorted(restored)} from {sources}"),
    ]
    return Outcome(b, frozenset(), f"{target} corrupted (rank {rank}, step {step}); worker of {victim} killed",
                   checks)


def _corrupt(ctx: Context, node: str, step: int, rank: int) -> str:
    """Flips bytes in the middle of ``node``'s SSD copy of (step, rank); returns the file's path."""
    folder = Path(ctx.cluster.workdir) / "nodes" / node / "ssd" / shard_prefix(JOB, step, rank)
    manifest = json.loads((folder / MANIFEST).read_text())
    target = max((folder / f["name"] for f in manifest["files"]), key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 16] = bytes(x ^ 0xFF for x in raw[mid:mid + 16])
    target.write_bytes(bytes(raw))
    return str(target)


SCENARIOS = [
    Scenario("corrupt-shard", "a rank's SSD copy corrupted: detected by checksum, recorded, restored from HDD",
             corrupt_shard, DISK_ONLY),
    Scenario("crash-mid-save", "a rank killed half-way through a durable save: the round restarts from the "
             "newest valid step", crash_mid_save, DISK_ONLY, prepare=arm_failpoint),
]
