"""The frame of a chaos-matrix scenario: the cluster it needs (:class:`Shape`), what it can do to it
(:class:`Context`: the isolated cluster, its network lab, the training job's own log), and what it
reports (:class:`Outcome`). The invariants every scenario is judged by are checked here, once, from
the coordinator's event log (kept in etcd), the checkpoint catalog and the job's log
(:mod:`chaos_tests.invariants`).

A scenario runs inside the lab's ``ctl`` namespace (:mod:`chaos_tests.matrix` re-executes itself
there), so gRPC reaches every process at its lab address, while faults go through the lab:
``ip netns exec`` into a host for nftables and tc, signals by pid for processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ftd import netlab
from ftd.client import CoordinatorClient
from ftd.ftctl import isolated, localcluster
from ftd.v1 import checkpoint_pb2
from ftd.waiting import Timeout, wait_for

from . import invariants
from .invariants import Check

JOB = "chaos"
# Every scenario runs with the rollback policy on: a false step anomaly would act, not only alert
# (the no_false_rollback invariant).
ROLLBACK_POLICY = ("--anomaly-action", "rollback")


@dataclass(frozen=True)
class Shape:
    """The cluster and the training job of a scenario. Defaults: 2 active nodes and a spare in two
    racks (each node's buddy is in the other rack), one etcd member, one coordinator, node-local SSD
    and HDD only (no shared filesystem, no S3), a memory snapshot every step and a durable one every
    ``persist_every`` steps; ``memory_every=0``: durable checkpoints only, every ``persist_every``."""

    nodes: int = 2
    spares: int = 1
    coordinators: int = 1
    etcd: int = 1
    racks: int = 2
    s3: bool = False
    shared_hdd: bool = False
    memory_every: int = 1
    persist_every: int = 10
    step_time_s: float = 0.05
    warmup_steps: int = 20
    agent_args: tuple[str, ...] = ()
    coordinator_args: tuple[str, ...] = ()
    train_args: str = ""  # more arguments of the demo job (e.g. "--work 60": GPU-like compute per step)
    # Replica fingerprints in every scenario: a false disagreement would fence a node (no_false_death)
    # and roll the job back (no_false_rollback).
    fingerprint_every: int = 5
    env: tuple[tuple[str, str], ...] = ()  # for every agent and its workers (failpoints)

    def hosts(self) -> list[str]:
        return isolated.host_names(self.nodes, self.spares, self.coordinators, self.etcd, s3=self.s3)


@dataclass(frozen=True)
class Baseline:
    """The cluster as it was just before the fault: what the invariants compare against."""

    at_unix_s: float
    last_seq: int
    restorable_step: int
    valid_steps: frozenset[int]
    step: int
    world: tuple[str, ...]
    spares: tuple[str, ...]


@dataclass
class Outcome:
    """What a scenario reports: the nodes its fault may cost their rank, what it saw, and the checks
    of its own beyond the common invariants."""

    baseline: Baseline
    faulted: frozenset[str] = frozenset()
    detail: str = ""
    checks: list[Check] = field(default_factory=list)
    rollback_expected: bool = False  # the scenario injects a bad step: a rollback is its point


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    run: Callable[[Context], Outcome]
    shape: Shape = Shape()
    timeout_s: float = 240.0
    # Runs in the scenario's ctl-namespace process before the cluster starts, with the scenario's
    # workdir (its cluster lives in ``workdir / "cluster"``): e.g. a small tmpfs mounted where a node's
    # SSD tier will be. Mounts made here live in that process's mount namespace (``ip netns exec``
    # gives it one), which the cluster's processes inherit and which vanishes with them.
    prepare: Callable[[Path], None] | None = None


T = TypeVar("T")


def within(condition: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.2) -> T | None:
    """:func:`ftd.waiting.wait_for`, but ``None`` on a timeout (the caller turns it into a failed check)."""
    try:
        return wait_for(condition, timeout_s, what, interval_s=interval_s)
    except Timeout:
        return None


class Context:
    """A running isolated cluster with a training job, and the means to hurt it."""

    def __init__(self, workdir: Path, shape: Shape, cluster: localcluster.ClusterFile) -> None:
        self.workdir, self.shape, self.cluster = workdir, shape, cluster
        self.client: CoordinatorClient = cluster.client(timeout_s=3.0)
        self.out = workdir / "training"
        self.finish_file = workdir / "finish-step"
        self.lab = netlab.Lab(Path(cluster.isolation["lab_dir"])).attach()

    @classmethod
    @contextlib.contextmanager
    def started(cls, workdir: Path, shape: Shape, timeout_s: float = 90.0,
                prepare: Callable[[Path], None] | None = None) -> Iterator[Context]:
        """The isolated cluster of ``workdir`` (its lab made by the root half) with the job training
        past its warm-up with a restorable checkpoint; stopped afterwards."""
        if prepare is not None:
            prepare(workdir)
        for key, value in shape.env:
            os.environ[key] = value
        out, finish = workdir / "training", workdir / "finish-step"
        cadence = (f"--memory-every {shape.memory_every} --persist-every {shape.persist_every}" if shape.memory_every
                   else f"--ckpt-every {shape.persist_every}")
        train = localcluster.TrainOptions(
            cmd=f"-m ftd.training.demo_job --steps 1000000 {cadence} --step-time {shape.step_time_s} --out {out} "
                f"--finish-file {finish} --fingerprint-every {shape.fingerprint_every} {shape.train_args}".rstrip(),
            job=JOB, min_nodes=shape.nodes)
        cluster = localcluster.up(workdir / "cluster", shape.nodes, shape.spares, coordinators=shape.coordinators,
                                  racks=shape.racks, timeout_s=timeout_s, train=train, shared_hdd=shape.shared_hdd,
                                  isolate=True, etcd_members=shape.etcd, s3=shape.s3,
                                  extra_agent_args=list(shape.agent_args),
                                  extra_coordinator_args=[*ROLLBACK_POLICY, *shape.coordinator_args])
        ctx = cls(workdir, shape, cluster)
        try:
            ctx.wait_step(shape.warmup_steps, timeout_s, restorable=True)
            yield ctx
        finally:
            ctx.close()
            localcluster.stop(cluster)

    def close(self) -> None:
        self.client.close()
        self.lab.close()

    # -- what the cluster says ------------------------------------------------------------------

    def host(self, name: str) -> netlab.Host:
        return self.lab.hosts[name]

    def status(self) -> Any:
        return self.client.status(deadline_s=3.0)

    def world(self) -> list[str]:
        return list(self.status().world)

    def spares(self) -> list[str]:
        return list(self.status().spares)

    def events(self, max_pages: int = 50) -> list[dict[str, Any]]:
        """The coordinator's whole event log (from etcd), oldest first."""
        from ftd.v1 import coordinator_pb2

        events: list[dict[str, Any]] = []
        token = ""
        for _ in range(max_pages):
            page = self.client.call("ListEvents", coordinator_pb2.ListEventsRequest(limit=1000, page_token=token),
                                    idempotent=True)
            events += [{"seq": e.seq, "at_unix_s": e.at_unix_s, "kind": e.kind, "node_id": e.node_id,
                        "epoch": e.epoch, "message": e.message} for e in page.events]
            token = page.next_page_token
            if not token:
                break
        return sorted(events, key=lambda e: int(e["seq"]))

    def restorable_step(self) -> int:
        target = self.client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=JOB),
                                  idempotent=True)
        return int(target.checkpoint.step) if target.found else -1

    def checkpoints(self) -> list[checkpoint_pb2.CheckpointInfo]:
        return self.client.checkpoints(JOB)

    def valid_steps(self) -> set[int]:
        return {c.step for c in self.checkpoints() if c.valid}

    def records(self) -> list[dict[str, Any]]:
        """Every line of the job's own log (every rank, every incarnation), in time order."""
        lines: list[dict[str, Any]] = []
        for path in sorted(self.out.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by a SIGKILL
                    lines.append(json.loads(line))
        return sorted(lines, key=lambda r: float(r["t"]))

    def starts_since(self, t: float) -> list[dict[str, Any]]:
        """The job log's ``start`` lines (a rank (re)starting, with the step it restored) after ``t``."""
        return [r for r in self.records() if r.get("event") == "start" and float(r["t"]) > t]

    def step(self) -> int:
        return max((int(r["step"]) for r in self.records() if r.get("event") == "step"), default=-1)

    def worker_pids(self, node: str) -> list[int]:
        """The pids of ``node``'s current training processes (their newest ``start`` lines), alive."""
        newest: dict[int, tuple[float, int]] = {}
        for r in self.records():
            if r.get("node") == node and r.get("event") == "start":
                newest[int(r["rank"])] = (float(r["t"]), int(r["pid"]))
        return [pid for _, pid in newest.values() if Path(f"/proc/{pid}").exists()]

    def agent(self, node: str) -> localcluster.Proc:
        return next(a for a in self.cluster.agents if a.name == node)

    # -- waiting --------------------------------------------------------------------------------

    def wait_step(self, step: int, timeout_s: float, restorable: bool = False) -> int:
        """Waits until training passed ``step`` (and, with ``restorable``, a checkpoint at most
        ``persist_every`` steps older is the restore target); returns the step seen."""
        margin = self.shape.memory_every or self.shape.persist_every

        def ready() -> int | None:
            now = self.step()
            if now < step:
                return None
            if restorable and self.restorable_step() < step - 2 * margin:
                return None
            return now

        return int(wait_for(ready, timeout_s, f"training past step {step}" + (" with a restorable checkpoint"
                                                                             if restorable else ""), interval_s=0.2))

    def wait_progress(self, steps: int, timeout_s: float) -> int:
        """Training advanced ``steps`` beyond where it is now."""
        return self.wait_step(self.step() + steps, timeout_s)

    def baseline(self) -> Baseline:
        """Recorded right before a fault."""
        status = self.status()
        seq = max((int(e["seq"]) for e in self.events()), default=0)
        return Baseline(time.time(), seq, self.restorable_step(), frozenset(self.valid_steps()), self.step(),
                        tuple(status.world), tuple(status.spares))

    def settled_checkpoints(self, timeout_s: float = 20.0, quiet_s: float = 1.0) -> list[Any]:
        """The catalog once it stopped changing for ``quiet_s`` (with the job's workers frozen, a
        commit or a migration already in flight still lands: wait for it); bounded by ``timeout_s``."""
        def shape() -> tuple[Any, ...]:
            return tuple((c.step, c.valid, tuple(sorted(c.on_tier.items()))) for c in self.checkpoints())

        last, since = shape(), time.monotonic()
        end = since + timeout_s
        while time.monotonic() < end:
            time.sleep(0.2)
            now = shape()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return self.checkpoints()

    def wait_world_without(self, nodes: set[str], timeout_s: float) -> list[str]:
        """A committed world of the same size that holds none of ``nodes``."""
        size = self.shape.nodes

        def ok() -> list[str] | None:
            with contextlib.suppress(ConnectionError):
                world = self.world()
                if len(world) == size and not nodes & set(world):
                    return world
            return None

        return list(wait_for(ok, timeout_s, f"a world of {size} without {sorted(nodes)}", interval_s=0.2))

    def finish(self, extra_steps: int = 20, timeout_s: float = 120.0) -> int:
        """Ends the job: a finish line ``extra_steps`` past the newest step seen, written once; waits
        for every rank of the current world to log ``done``. Returns the finish line."""
        line = self.step() + extra_steps
        tmp = self.finish_file.with_suffix(".tmp")
        tmp.write_text(str(line))
        os.replace(tmp, self.finish_file)
        ranks = self.shape.nodes

        def done() -> bool:
            return len({r["rank"] for r in self.records() if r.get("event") == "done" and r["step"] == line}) >= ranks

        with contextlib.suppress(Timeout):
            wait_for(done, timeout_s, f"every rank done at step {line}", interval_s=0.3)
        return line


def judge(ctx: Context, outcome: Outcome, finish_line: int) -> list[Check]:
    """The common invariants, then the scenario's own checks."""
    b = outcome.baseline
    events, records = ctx.events(), ctx.records()
    return [
        invariants.epochs_increase(events),
        invariants.no_valid_checkpoint_lost(b.valid_steps, ctx.valid_steps()),
        invariants.resumed_at_or_after(records, b.at_unix_s, b.restorable_step),
        invariants.only_faulted_declared_dead(events, b.last_seq, outcome.faulted),
        invariants.no_false_straggler_replacement(events, b.last_seq, outcome.faulted),
        invariants.no_false_rollback(events, b.last_seq, outcome.rollback_expected),
        invariants.job_finished(records, finish_line),
        *outcome.checks,
    ]
