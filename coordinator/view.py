"""The leader's in-memory picture of the cluster: the durable state last committed to etcd plus what
heartbeats say (liveness, health, progress). Only the leader's keepers (membership, job rounds, the
checkpoint catalog) mutate it, and durable parts only after a commit succeeded.

The functions that turn it into protobuf answers live here too, so the service layer stays a thin
translation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftd.checkpoints import catalog as ckpt
from ftd.v1 import cluster_pb2, coordinator_pb2

from . import handover_rules, paging, rendezvous, restore_floors, validation
from .detector import Liveness, State, Verdict
from .model import NodeRecord, Role, World
from .store import Snapshot

INLINE_WORLD_MAX = 256  # above this many ranks an assignment carries world_size only
MAX_PROBLEMS_SHOWN = 50  # problems listed in ClusterStatus; the rest are counted
ALARM_HINTS = {
    "nospace": "etcd's database is full and every write is refused (no fencing, no promotion): compact, "
               "defragment every member, then etcdctl alarm disarm",
    "corrupt": "etcd members' data disagree: restore the member named by etcdctl alarm list from a healthy one",
}
_STATE_NAMES = {cluster_pb2.NODE_STATE_ALIVE: "alive", cluster_pb2.NODE_STATE_SUSPECT: "suspect",
                cluster_pb2.NODE_STATE_DEAD: "dead", cluster_pb2.NODE_STATE_FENCED: "fenced"}

_ROLE = {Role.ACTIVE: cluster_pb2.ROLE_ACTIVE, Role.SPARE: cluster_pb2.ROLE_SPARE}
_STATE = {
    State.ALIVE: cluster_pb2.NODE_STATE_ALIVE,
    State.SUSPECT: cluster_pb2.NODE_STATE_SUSPECT,
    State.DEAD: cluster_pb2.NODE_STATE_DEAD,
}


@dataclass(slots=True)
class Runtime:
    """What the latest heartbeat of a node said; never persisted."""

    incarnation: str = ""
    known_epoch: int = 0
    seq: int = 0
    last_heartbeat: float | None = None  # monotonic
    health: cluster_pb2.Health | None = None
    progress: cluster_pb2.Progress | None = None


class JobTable(dict[str, rendezvous.JobState]):
    """The view's jobs by name; :attr:`version` moves with every change (the current job is cached
    against it: it is asked on every heartbeat answer). Job states are frozen: a change is a new entry."""

    version: int = 0

    def __setitem__(self, key: str, value: rendezvous.JobState) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: str, *default: Any) -> Any:
        self.version += 1
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.version += 1

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.version += 1
        return super().setdefault(key, default)

    def popitem(self) -> tuple[str, rendezvous.JobState]:
        self.version += 1
        return super().popitem()


@dataclass
class ClusterView:
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    world: World = field(default_factory=World)
    world_revision: int = 0
    last_event_seq: int = 0
    liveness: dict[str, Liveness] = field(default_factory=dict)
    runtime: dict[str, Runtime] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    catalog: ckpt.Catalog = field(default_factory=dict)
    rollbacks: dict[str, ckpt.Rollback] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # records that did not load (skipped), by key
    etcd_alarms: list[str] = field(default_factory=list)  # etcd's raised alarms, as last polled
    jobs: dict[str, rendezvous.JobState] = field(default_factory=JobTable)
    forced_dead: dict[str, str] = field(default_factory=dict)  # node -> why (a hung node reported itself)
    stalls: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # (job, round) -> nodes stalled
    drains: dict[str, handover_rules.Drain] = field(default_factory=dict)  # pending planned hand-overs
    goodput: dict[str, bytes] = field(default_factory=dict)  # job -> its persisted ledger (coordinator/goodput.py)
    access: dict[str, bytes] = field(default_factory=dict)  # deny list and admissions (coordinator/revocations.py)
    floors: dict[str, restore_floors.Floor] = field(default_factory=dict)  # job -> its restore floor
    _rank: dict[str, int] = field(default_factory=dict)
    # (jobs, their version, the ranks, the job): current_job() as last computed
    _current: tuple[object, int, object, rendezvous.JobState | None] = (None, -1, None, None)

    @classmethod
    def from_snapshot(cls, snap: Snapshot, now: float, grace_s: float) -> ClusterView:
        """A new leader's view: every known node starts silent-but-unjudged for ``grace_s``."""
        view = cls(world_revision=snap.world_revision, last_event_seq=snap.last_event_seq)
        view.nodes = dict(snap.nodes)
        view.set_world(snap.world, snap.world_revision)
        for node_id, node in view.nodes.items():
            view.liveness[node_id] = Liveness(last_seen=now, grace_until=now + grace_s)
            view.runtime[node_id] = Runtime(incarnation=node.incarnation)
        view.catalog, view.rollbacks, catalog_problems = ckpt.decode_all(snap.kv)
        view.floors, floor_problems = restore_floors.load(snap.kv)
        view.problems = [*snap.problems, *catalog_problems, *floor_problems]
        for key, raw in snap.kv.items():
            if key.startswith("jobs/"):
                try:
                    state = rendezvous.decode(raw)
                    view.jobs[state.job] = state
                except (ValueError, TypeError, KeyError) as exc:
                    view.problems.append(f"job record {key!r} is corrupt: {exc}")
            elif key.startswith("goodput/"):
                view.goodput[key.removeprefix("goodput/")] = raw
            elif key.startswith("access/"):
                view.access[key] = raw
            elif key.startswith("drains/"):
                try:
                    drain = handover_rules.decode(raw)
                    view.drains[drain.node_id] = drain
                except (ValueError, TypeError, KeyError) as exc:
                    view.problems.append(f"drain record {key!r} is corrupt: {exc}")
        return view

    def forget(self, node_id: str) -> None:
        """Drops what memory holds about a node whose record was removed (committed already)."""
        self.nodes.pop(node_id, None)
        for table in (self.liveness, self.runtime, self.verdicts, self.forced_dead, self.drains):
            table.pop(node_id, None)

    def newest_restorable(self, job: str) -> int:
        """The newest step of ``job`` that can be restored (-1: none)."""
        return max((r.step for (j, _), r in self.catalog.items() if j == job and r.restorable), default=-1)

    def current_job(self) -> rendezvous.JobState | None:
        """The cluster's training job (one per ftd cluster): among the open ones, the one the most
        members of the world joined in its current round, then the oldest; else the last closed. Not
        the first by name: a job a node made up must not become the one every assignment names."""
        version = getattr(self.jobs, "version", None)  # asked on every heartbeat answer: cached while unchanged
        jobs, rank, cached = self.jobs, self._rank, self._current
        if version is not None and cached[0] is jobs and cached[1] == version and cached[2] is rank:
            return cached[3]
        job = self._current_job()
        if version is not None:
            self._current = (jobs, version, rank, job)
        return job

    def _current_job(self) -> rendezvous.JobState | None:
        open_jobs = [j for j in self.jobs.values() if not j.closed]
        if len(open_jobs) == 1:
            return open_jobs[0]
        rank = self._rank

        def weight(j: rendezvous.JobState) -> tuple[int, float, str]:
            return sum(1 for n in j.joined if n in rank), -j.created_unix_s, j.job

        if open_jobs:
            return max(open_jobs, key=weight)
        return max(self.jobs.values(), key=lambda j: j.round, default=None)

    def set_world(self, world: World, revision: int) -> None:
        self.world = world
        self.world_revision = revision
        self._rank = {node_id: i for i, node_id in enumerate(world.ranks)}

    def rank_of(self, node_id: str) -> int:
        return self._rank.get(node_id, -1)

    def state_of(self, node_id: str) -> tuple[cluster_pb2.NodeState.ValueType, str]:
        node = self.nodes[node_id]
        if node.fence is not None:
            return cluster_pb2.NODE_STATE_FENCED, f"fenced at epoch {node.fence.epoch}: {node.fence.reason}"
        verdict = self.verdicts.get(node_id)
        drain = self.drains.get(node_id)
        if drain is not None and (verdict is None or verdict.state is State.ALIVE):
            return cluster_pb2.NODE_STATE_ALIVE, f"draining: {drain.reason}"
        if verdict is None:
            return cluster_pb2.NODE_STATE_ALIVE, "registered"
        return _STATE[verdict.state], verdict.reason

    def is_live(self, node_id: str) -> bool:
        verdict = self.verdicts.get(node_id)
        if verdict is None:
            return node_id in self.liveness
        return verdict.state is not State.DEAD

    # ---- answers ---------------------------------------------------------------------------

    def assignment(self, node_id: str, with_world: bool) -> cluster_pb2.Assignment:
        node = self.nodes.get(node_id)
        rank = self.rank_of(node_id)
        out = cluster_pb2.Assignment(
            epoch=self.world.epoch,
            role=cluster_pb2.ROLE_ACTIVE if rank >= 0 else cluster_pb2.ROLE_SPARE,
            rank=rank,
            fenced=node is not None and node.fenced,
            reason=self.world.reason,
            world_size=len(self.world.ranks),
        )
        job = self.current_job()
        if job is not None:
            out.job, out.round = job.job, job.round
        if with_world and len(self.world.ranks) <= INLINE_WORLD_MAX:
            out.world.extend(self.world.ranks)
        return out

    def spares(self) -> list[str]:
        return sorted(
            n for n, node in self.nodes.items()
            if self.rank_of(n) < 0 and not node.fenced and self.is_live(n)
        )

    def status(self, leader_id: str, leader_address: str, leader_since: float,
               etcd_ok: bool) -> coordinator_pb2.ClusterStatus:
        dead = sorted(n for n, node in self.nodes.items()
                      if node.fenced or (self.verdicts.get(n) and self.verdicts[n].state is State.DEAD))
        suspect = sorted(n for n, v in self.verdicts.items() if v.state is State.SUSPECT
                         and n in self.nodes and not self.nodes[n].fenced)
        world = self.world
        degraded_reason = ""
        if world.degraded:
            degraded_reason = (f"world has {len(world.ranks)} of {world.target_size} ranks: "
                               "no spare was left to replace a dead node")
        job = self.current_job()
        job_fields: dict[str, object] = {}
        if job is not None:
            message = job.closed_reason if job.closed else job.round_reason
            waiting = rendezvous.wait_reason(job, len(world.ranks), world.target_size)
            if not job.closed and len(world.ranks) < job.min_nodes:
                message = (f"waiting: the world has {len(world.ranks)} node(s) and job {job.job} needs at least "
                           f"{job.min_nodes}")
            elif not job.closed and waiting:
                message = f"waiting: {waiting}"
            job_fields = {"job": job.job, "job_round": job.round, "job_restarts": job.restarts,
                          "job_max_restarts": job.max_restarts, "job_closed": job.closed, "job_message": message,
                          "job_round_unix_s": job.round_unix_s, "job_on_no_spare": job.on_no_spare,
                          "job_rollbacks": job.rollbacks}
        return coordinator_pb2.ClusterStatus(
            **job_fields,  # type: ignore[arg-type]
            leader_id=leader_id, leader_address=leader_address, epoch=world.epoch,
            world=list(world.ranks), target_world_size=world.target_size, spares=self.spares(),
            dead=dead, suspect=suspect, degraded=world.degraded, degraded_reason=degraded_reason,
            last_change_reason=world.reason, last_change_unix_s=world.changed_unix_s,
            leader_since_unix_s=leader_since, etcd_reachable=etcd_ok, draining=sorted(self.drains),
            problems=[validation.clip(p, 500) for p in self.problems[:MAX_PROBLEMS_SHOWN]]
            + ([f"... and {len(self.problems) - MAX_PROBLEMS_SHOWN} more"] if len(self.problems) > MAX_PROBLEMS_SHOWN
               else []),
            etcd_alarms=[f"{a}: {ALARM_HINTS.get(a, 'see etcdctl alarm list')}" for a in self.etcd_alarms],
        )

    def node_page(self, now: float, page_size: int = 0, page_token: str = "") -> coordinator_pb2.ListNodesResponse:
        """One page of :meth:`node_infos` in node id order: at most ``page_size`` nodes (0: the
        default) and :data:`~.paging.MAX_PAGE_BYTES`; ``page_token`` is the last node id of the
        previous page, ``next_page_token`` is "" on the last page."""
        page = paging.page(page_size, page_token)
        ids = sorted(n for n in self.nodes if n > page.token)
        infos, more = paging.take_page((self.node_info(n, now) for n in ids), page.size,
                                       coordinator_pb2.NodeInfo.ByteSize)
        return coordinator_pb2.ListNodesResponse(nodes=infos, next_page_token=infos[-1].node_id if more else "")

    def node_infos(self, now: float) -> list[coordinator_pb2.NodeInfo]:
        return [self.node_info(node_id, now) for node_id in sorted(self.nodes)]

    def node_info(self, node_id: str, now: float) -> coordinator_pb2.NodeInfo:
        node = self.nodes[node_id]
        rt = self.runtime.get(node_id) or Runtime()
        state, reason = self.state_of(node_id)
        info = coordinator_pb2.NodeInfo(
            node_id=node_id, host=node.host, pid=node.pid,
            role=_ROLE[Role.ACTIVE if self.rank_of(node_id) >= 0 else Role.SPARE],
            state=state, rank=self.rank_of(node_id), epoch=rt.known_epoch,
            last_heartbeat_age_s=(now - rt.last_heartbeat) if rt.last_heartbeat is not None else -1.0,
            labels=dict(node.labels), agent_address=node.agent_address, state_reason=reason,
        )
        if rt.health is not None:
            info.health.CopyFrom(rt.health)
        if rt.progress is not None:
            info.progress.CopyFrom(rt.progress)
        return info

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(_STATE_NAMES.values(), 0)
        for node_id in self.nodes:
            state, _ = self.state_of(node_id)
            counts[_STATE_NAMES[state]] += 1
        return counts

