"""Memory snapshots as soft state: the leader's in-memory ledger of every node's memory tier.

A memory snapshot comes every step from every rank; writing each to etcd (and the buddy's copy again)
made etcd's write rate follow the memory cadence (16,000 ranks every 4 s: ~8,000 transactions a
second). Instead each agent announces its whole memory tier on its heartbeat stream
(``HeartbeatRequest.memory``, a :class:`~ftd.v1.coordinator_pb2.MemoryReport`: its own ranks' snapshots
and the replicas it keeps for its buddy), sent whole on a stream's first message and when it changes.
The leader keeps the newest report per node here and nothing of it goes to etcd: a new leader learns
it again from the agents' re-announcements.

Per report only cheap checks run (:func:`parse`, a few µs per snapshot: identifiers, sizes, a copy
only at the reporting node, an own rank only if the node held it in that round); the rules that used
to run at commit time run when records are built, on demand (:func:`merge`): abandoned timelines,
a rollback's removed and held steps, a copy whose checksum disagrees with the rank's, snapshots on
nodes no longer alive. :func:`readiness` says whether a new leader has heard enough to answer a restore
target: every alive node of the job's world reported, or ``memory_report_deadline_s`` passed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ftd.checkpoints import catalog as rules
from ftd.checkpoints.layout import MAX_RANK, FileEntry, ShardManifest, check_job, files_checksum
from ftd.throttle import LogThrottle
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2

from . import shard_rules
from .memory_merge import Snap, abandoned_floor, collector_paused, merge
from .rendezvous import JobState
from .view import ClusterView

log = logging.getLogger("ftd.coordinator.memory_ledger")
MAX_SNAPSHOTS = 4096  # per report: a node's ranks and its buddy's, MEM_KEEP each; far above any real node
MAX_FILES = 100_000  # per snapshot
FORMATS = ("torch", "dcp")
GONE = (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)  # a node whose memory copies do not count
STATES_EVERY_S = 0.1  # the nodes' states are looked at most this often (a restore target is asked by every rank)
# A merge of the job's memory snapshots that only memory reports changed since it was built (a node's
# newer steps: hundreds a second at 2,000 nodes) is rebuilt at once when it is cheap, and otherwise at
# most MERGE_SHARE of a core's time (merge_due). A failover's 16,000-rank merge rebuilt per report took
# a quarter of the new leader's loop.
MERGE_FRESH_S = 0.005  # a merge built faster than this is rebuilt on every change (all but the largest jobs)
MERGE_SHARE = 0.1
MERGE_MAX_AGE_S = 1.0  # and it is never older than this: a node keeps MEM_KEEP snapshots per rank


def snap_of(node: str, manifest: ShardManifest, writer: str, replica: bool = False, restored: int | None = None,
            round_: int | None = None, cadence: str = "") -> Snap:
    """A snapshot from an already validated manifest (the CommitShard/RecordCopy compatibility path)."""
    return Snap(node, writer, replica, manifest.job, manifest.step, manifest.epoch, manifest.rank,
                manifest.world_size, manifest.format, manifest.files, manifest.checksum, manifest.created_unix_s,
                restored, -1 if round_ is None else round_, cadence, manifest.total_bytes)


class Manifest(NamedTuple):
    """What a reported manifest says once checked: a function of its bytes alone, so one parse serves
    every node that reports the same manifest (an owner's snapshot and its buddy's replica of it)."""

    job: str
    step: int
    epoch: int
    rank: int
    world_size: int
    format: str
    files: tuple[FileEntry, ...]
    checksum: str
    created: float
    size: int


def check_manifest(man: checkpoint_pb2.ShardManifest) -> Manifest | str:
    """A reported manifest's cheap checks (identifiers, ranges, sizes, checksums' form), or why not."""
    job = man.job
    if job not in _GOOD_JOBS:
        try:
            check_job(job)
        except ValueError as exc:
            return f"manifest.job: {exc}"
        if len(_GOOD_JOBS) < 1024:  # a handful of jobs per cluster: bounded all the same
            _GOOD_JOBS.add(job)
    step, rank, world = man.step, man.rank, man.world_size
    if step < 0 or not 1 <= world <= MAX_RANK + 1 or not 0 <= rank < world:
        return f"{job} step {step} rank {rank} of world size {world}: out of range"
    if man.format not in FORMATS:
        return f"{job} step {step} rank {rank}: format {man.format[:40]!r}"
    listed = man.files
    if not 1 <= len(listed) <= MAX_FILES:
        return f"{job} step {step} rank {rank}: {len(listed)} files"
    created = man.created_unix_s
    if not math.isfinite(created) or created < 0:
        return f"{job} step {step} rank {rank}: created_unix_s {created}"
    files = tuple([FileEntry(f.name, f.size, f.crc32c) for f in listed])
    size = 0
    for f in files:
        if f.size < 0 or len(f.crc32c) != 8:
            return f"{job} step {step} rank {rank}: a file without a size or an 8-hex-digit crc32c"
        size += f.size
    return Manifest(job, step, man.epoch, rank, world, man.format, files, files_checksum(files), created, size)


_GOOD_JOBS: set[str] = set()  # job ids that passed check_job (a regex per manifest otherwise)


def manifest_bytes(snapshot: bytes) -> bytes | None:
    """The wire form of a serialized ``MemorySnapshot``'s manifest, sliced out of it: a deterministic
    serialization writes field 1 (``manifest``, tag 0x0a) first, as the manifest's own deterministic
    serialization behind its length. None when the snapshot does not start with it."""
    if len(snapshot) < 2 or snapshot[0] != 0x0A:
        return None
    if snapshot[1] < 0x80:  # a manifest under 128 bytes: its length in one byte
        return snapshot[2:2 + snapshot[1]] if 2 + snapshot[1] <= len(snapshot) else None
    length, shift, i = 0, 0, 1
    while i < len(snapshot) and i <= 5:
        byte = snapshot[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return snapshot[i:i + length] if i + length <= len(snapshot) else None
        shift += 7
    return None


class ManifestCache:
    """Checked manifests by their wire form, bounded: two generations of at most ``size`` entries each
    (a full one becomes the older). A manifest is needed again only until its other holder reports,
    within a step: 16,384 a generation covers a step of 16,000 ranks, and holds no more objects for
    the garbage collector to walk than that."""

    def __init__(self, size: int = 16_384) -> None:
        self.size = size
        self.new: dict[bytes, Manifest | str] = {}
        self.old: dict[bytes, Manifest | str] = {}

    def check(self, snapshot: coordinator_pb2.MemorySnapshot, raw: bytes | None = None) -> Manifest | str:
        """``snapshot``'s manifest checked. ``raw``: the snapshot's deterministic wire form if the caller
        has it (the manifest's is sliced from it, :func:`manifest_bytes`, and a hit reads no field)."""
        key = manifest_bytes(raw) if raw is not None else None
        if key is None:
            key = snapshot.manifest.SerializeToString(deterministic=True)
        got = self.new.get(key)
        if got is None:
            got = self.old.get(key)
            if got is None:
                got = check_manifest(snapshot.manifest)
            if len(self.new) >= self.size:
                self.old, self.new = self.new, {}
            self.new[key] = got
        return got


def parse(node: str, m: coordinator_pb2.MemorySnapshot, rounds: Mapping[tuple[str, int], tuple[str, ...]],
          manifests: ManifestCache | None = None, raw: bytes | None = None) -> Snap | str:
    """One reported snapshot, or why it is not taken (cheap checks only). ``rounds``: (job, round) ->
    its members by node rank, for the rounds this leader has seen: an own rank is taken only from the
    node holding it in the snapshot's round (:func:`~.shard_rules.holder`); a round it has not seen
    (older than this leader) is not judged here. ``manifests``: checked manifests, shared by nodes;
    ``raw``: the snapshot's deterministic wire form, if the caller has it (the manifest's is sliced from it)."""
    man = check_manifest(m.manifest) if manifests is None else manifests.check(m, raw)
    if isinstance(man, str):
        return man
    job, step, rank, world = man.job, man.step, man.rank, man.world_size
    replica = m.replica
    owner = m.owner if replica else node
    if replica and (not owner or owner == node):
        return f"{job} step {step} rank {rank}: a replica names its owner, another node (got {owner[:100]!r})"
    round_ = m.job_round if m.HasField("job_round") else -1
    if not replica and rounds:
        members = rounds.get((job, round_))
        held = None if members is None else shard_rules.holder(JobState(job, members=members), world, rank)
        if held is not None and held != node:
            return f"{job} step {step} rank {rank}: held by {held} in round {round_}, not by {node}"
    return Snap(node, owner, replica, job, step, man.epoch, rank, world, man.format, man.files, man.checksum,
                man.created, m.restored_step if m.HasField("restored_step") else None, round_, m.cadence[:200],
                man.size)


@dataclass(frozen=True)
class Readiness:
    """Whether a restore target may be answered now: ``waiting`` the alive nodes of the job's world
    not heard from since this leader took over (empty: ready); ``late`` those given up on once the
    deadline passed (their memory copies are not counted, and the answer says so)."""

    waiting: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    left_s: float = 0.0


def merge_due(now: float, built_at: float, took_s: float) -> bool:
    """Whether a merge that only memory reports changed since it was built (at ``built_at``, taking
    ``took_s``) is rebuilt now. A cheap one always is. An expensive one waits ``took_s / MERGE_SHARE``
    (at most ``MERGE_MAX_AGE_S``): its answer is then a moment old, which cannot go backwards (it is
    the newest built) nor name a copy gone (a node keeps ``MEM_KEEP`` steps per rank, and a death or a
    mark changes what :attr:`MemoryLedger.settled` counts, which rebuilds at once)."""
    if took_s < MERGE_FRESH_S:
        return True
    return now - built_at >= min(took_s / MERGE_SHARE, MERGE_MAX_AGE_S)


def readiness(now: float, since: float, deadline_s: float, world: Iterable[str], reported: Iterable[str]) -> Readiness:
    """A new leader knows no memory snapshot until the agents re-announce them: answering before
    would name an older step than the last leader did. It waits for every alive node of the world
    (``world``), at most ``deadline_s`` after ``since`` (when it became leader)."""
    heard = set(reported)
    missing = tuple(sorted(n for n in set(world) if n not in heard))
    if not missing:
        return Readiness()
    left = since + deadline_s - now
    return Readiness(waiting=missing, left_s=left) if left > 0 else Readiness(late=missing)


@dataclass
class _Report:
    incarnation: str
    version: int
    snaps: tuple[Snap, ...]
    parsed: dict[bytes, Snap] = field(default_factory=dict)  # a snapshot's wire form -> what it was taken as


@dataclass
class MemoryLedger:
    """The leader's memory snapshots: per node its newest report (heartbeat stream) and the single
    snapshots recorded through the old ``CommitShard``/``RecordCopy(tier="mem")`` RPCs. Lost with the
    leadership (:meth:`new_term`); never written anywhere."""

    reports: dict[str, _Report] = field(default_factory=dict)
    singles: dict[str, dict[tuple[str, int, int], Snap]] = field(default_factory=dict)  # node -> (job, step, rank)
    rounds: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)  # (job, round) -> members
    invalid: dict[tuple[str, int], str] = field(default_factory=dict)  # memory-only steps marked invalid
    bad: dict[tuple[str, int, int], dict[str, str]] = field(default_factory=dict)  # (job, step, rank) -> marks
    since: float = 0.0  # when this leader's term began (monotonic)
    known: frozenset[str] = frozenset()  # the nodes in etcd at the election: the last leader may have counted them
    generation: int = 0  # bumped on every change: what the per-job index is cached against
    settled: int = 0  # bumped on every change but a report replacing a node's earlier one (see merge_due)
    refused: int = 0  # snapshots not taken (cheap checks), this term
    ready: set[str] = field(default_factory=set)  # jobs every known node of whose world has reported, this term
    mirrored: set[str] = field(default_factory=set)  # nodes whose report came from the last leader (memory_mirror.py)
    _gone: tuple[float, int, frozenset[str]] = (-1e18, 0, frozenset())  # (when, id(view), dead or fenced nodes)
    _index: dict[str, list[Snap]] = field(default_factory=dict)
    _holders: dict[tuple[str, int], set[str]] = field(default_factory=dict)  # (job, rank) -> reporting nodes
    _held: dict[str, frozenset[tuple[str, int]]] = field(default_factory=dict)  # node -> its pairs in _holders
    _index_at: int = -1
    _log: LogThrottle = field(default_factory=lambda: LogThrottle(log))
    manifests: ManifestCache = field(default_factory=ManifestCache)  # kept across terms: a function of bytes
    on_forget: Callable[[str], None] = lambda node: None  # a node's report dropped (the mirror feed drops it too)

    def new_term(self, now: float, nodes: Iterable[str] = (), keep: bool = False) -> None:
        """A new leadership: nothing is known until the agents re-announce. ``nodes``: those registered
        at the election (a node first registered later reported to no earlier leader). ``keep``: the
        reports followed from the last leader (memory_mirror.py) are kept, as :attr:`mirrored` until
        each node reports here itself."""
        if keep:
            self.mirrored = set(self.reports)
        else:
            self.clear_reports()
        self.singles.clear()
        self.rounds.clear()
        self.invalid.clear()
        self.bad.clear()
        self.since, self.refused, self.known = now, 0, frozenset(nodes)
        self.ready.clear()
        self._gone = (-1e18, 0, frozenset())
        self.changed()

    def clear_reports(self) -> None:
        """Forgets every node's report (a new term without a mirror; a mirror's full resend)."""
        self.reports.clear()
        self._holders.clear()
        self._held.clear()
        self.mirrored.clear()
        self.rounds.clear()
        self.changed()

    def see_round(self, job: JobState) -> None:
        """Remembers a round's members (for :func:`parse`'s check of own ranks)."""
        if job.members and self.rounds.get((job.job, job.round)) != job.members:
            self.rounds[(job.job, job.round)] = job.members
            if len(self.rounds) > 4096:  # bounded: the oldest rounds are forgotten (not judged then)
                for key in list(self.rounds)[:1024]:
                    del self.rounds[key]

    def take(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport,
             jobs: Iterable[JobState] = ()) -> int:
        """A node's memory tier as it is now, replacing its previous report (unless an older one of the
        same stream's agent arrives late). ``jobs``: the current rounds (remembered for :func:`parse`).
        Returns how many snapshots were taken."""
        for job in jobs:
            if self.rounds.get((job.job, job.round)) is not job.members:
                self.see_round(job)
        old = self.reports.get(node)
        if old is not None and old.incarnation == incarnation and report.version < old.version:
            return 0
        if len(report.snapshots) > MAX_SNAPSHOTS:
            self._log.log(logging.WARNING, f"too many:{node}", "node %s: a memory report of %d snapshots (at most "
                          "%d) ignored", node, len(report.snapshots), MAX_SNAPSHOTS)
            return 0
        taken: list[Snap] = []
        before = old.parsed if old is not None else {}
        parsed: dict[bytes, Snap] = {}
        for m in report.snapshots:  # a snapshot unchanged since the node's last report is not parsed again
            raw = m.SerializeToString(deterministic=True)
            snap = before.get(raw) or parse(node, m, self.rounds, self.manifests, raw)
            if isinstance(snap, str):
                self.refused += 1
                self._log.log(logging.WARNING, f"refused:{node}", "node %s: memory snapshot not counted: %s", node,
                              snap)
            else:
                taken.append(snap)
                parsed[raw] = snap
        self._rehold(node, taken)
        self.reports[node] = _Report(incarnation, report.version, tuple(taken), parsed)
        self.mirrored.discard(node)
        self.generation += 1
        return len(taken)

    def taken_as(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport
                 ) -> coordinator_pb2.MemoryReport | None:
        """``report`` as :meth:`take` just kept it (the snapshots it refused left out), or None if it
        kept another (an older report arriving late): what the mirror forwards, so that a follower
        parsing it takes exactly what this leader took."""
        kept = self.reports.get(node)
        if kept is None or kept.incarnation != incarnation or kept.version != report.version:
            return None
        if len(kept.snaps) == len(report.snapshots):
            return report
        return coordinator_pb2.MemoryReport(version=report.version, snapshots=[
            m for m in report.snapshots if m.SerializeToString(deterministic=True) in kept.parsed])

    def add(self, snap: Snap) -> None:
        """One snapshot recorded by RPC (compatibility): the node keeps at most MEM_KEEP per rank."""
        held = self.singles.setdefault(snap.node, {})
        held[(snap.job, snap.step, snap.rank)] = snap
        steps = sorted((s for (j, s, r) in held if j == snap.job and r == snap.rank), reverse=True)
        for gone in steps[rules.MEM_KEEP:]:  # the memory tier's keep rule: the newest MEM_KEEP
            held.pop((snap.job, gone, snap.rank), None)
        self.changed()

    def drop(self, node: str, job: str, step: int, rank: int) -> None:
        """A copy deleted (RecordCopy present=False); the node's next report says so too."""
        held = self.singles.get(node, {})
        if held.pop((job, step, rank), None) is not None:
            self.changed()
        report = self.reports.get(node)
        if report is not None:
            kept = tuple(s for s in report.snaps if (s.job, s.step, s.rank) != (job, step, rank))
            if len(kept) != len(report.snaps):
                self._rehold(node, kept)
                report.snaps = kept
                self.changed()

    def mark_bad(self, job: str, step: int, rank: int, node: str, why: str) -> None:
        self.bad.setdefault((job, step, rank), {})[rules.CopyRef(rules.MEMORY, node).key] = why
        self.changed()

    def forget_node(self, node: str) -> None:
        """A node no longer alive: its memory tier is gone with it (or fenced off)."""
        report, single = self.reports.pop(node, None), self.singles.pop(node, None)
        self.mirrored.discard(node)
        if report is not None:
            self._rehold(node, ())
            self.on_forget(node)
        if report is not None or single is not None:
            self.changed()

    def changed(self) -> None:
        """Anything but a report changed: a merge is rebuilt at once (:func:`merge_due`)."""
        self.generation += 1
        self.settled += 1

    def _rehold(self, node: str, new: Iterable[Snap]) -> None:
        """Keeps :meth:`holders` in step with what a node holds now: only the (job, rank) pairs it
        gained or lost are touched (a new step of the same ranks changes none)."""
        before, after = self._held.get(node, frozenset()), frozenset((s.job, s.rank) for s in new)
        if before == after:
            return
        for pair in before - after:
            nodes = self._holders.get(pair)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._holders[pair]
        for pair in after - before:
            self._holders.setdefault(pair, set()).add(node)
        if after:
            self._held[node] = after
        else:
            self._held.pop(node, None)

    def holders(self, job: str, rank: int) -> set[str]:
        """The nodes whose memory holds a snapshot of ``rank`` of ``job`` (its own or a replica): the
        peer addresses a node is told above the inline bound (coordinator/buddies.py) include them."""
        return set(self._holders.get((job, rank), ()))

    def gone(self, view: ClusterView, now: float) -> frozenset[str]:
        """The dead or fenced nodes, looked at every :data:`STATES_EVERY_S` at most. Their reports stay
        as the definition of their ranks' shards, with no copy (:func:`merge`'s ``dead``: a node's
        memory tier dies with it, the shard it committed does not); the reports of nodes the cluster
        no longer knows are dropped."""
        at, seen, before = self._gone
        if seen != id(view) or not 0 <= now - at < STATES_EVERY_S:
            gone = frozenset(n for n in view.nodes if view.state_of(n)[0] in GONE)
            for node in [n for n in (*self.reports, *self.singles) if n not in view.nodes]:
                self.forget_node(node)
            for node in gone - before:  # no longer a holder to list (its report stays, copyless)
                report = self.reports.get(node)
                if report is not None:
                    self._rehold(node, ())
            if gone != before:
                self.changed()
            self._gone = (now, id(view), gone)
            return gone
        return before

    def readiness_of(self, view: ClusterView, job: str, now: float, deadline_s: float) -> Readiness:
        """:func:`readiness` for ``job``'s world (its round's members, else every node) known at the
        election; one that heartbeated here without a report has none (an agent's first message has
        it). Once every one reported the job stays ready this term (asked by every rank: O(1) then)."""
        if job in self.ready:
            return Readiness()
        state = view.jobs.get(job)
        gone = self.gone(view, now)
        world = [n for n in (state.members if state is not None and state.members else view.nodes)
                 if n in self.known and n in view.nodes and n not in gone]
        heard = set(self.reports) | {n for n in world if (rt := view.runtime.get(n)) is not None
                                     and rt.last_heartbeat is not None}
        ready = readiness(now, self.since, deadline_s, world, heard)
        if ready == Readiness():
            self.ready.add(job)
        return ready

    def snapshots(self, job: str) -> list[Snap]:
        """Every known snapshot of ``job`` (cached per :attr:`generation`)."""
        if self._index_at != self.generation:
            index: dict[str, list[Snap]] = {}
            for report in self.reports.values():
                for s in report.snaps:
                    index.setdefault(s.job, []).append(s)
            for held in self.singles.values():
                for s in held.values():
                    index.setdefault(s.job, []).append(s)
            self._index, self._index_at = index, self.generation
        return self._index.get(job, [])

    def jobs(self) -> set[str]:
        self.snapshots("")
        return set(self._index)

    def records(self, job: str, durable: Sequence[rules.CheckpointRecord], rollback: rules.Rollback | None,
                held: Callable[[int, int | None], int | None],
                suspect: tuple[int, float] | None = None) -> list[rules.CheckpointRecord]:
        """:func:`merge` of the job's durable records with its memory snapshots. ``suspect``: (first
        step, unix time) of a rollback past a step anomaly: snapshots of those steps saved before it
        do not count (their durable twins are marked suspect in etcd)."""
        return self.merge_of(job, durable, rollback, held, suspect)()

    def merge_of(self, job: str, durable: Sequence[rules.CheckpointRecord], rollback: rules.Rollback | None,
                 held: Callable[[int, int | None], int | None],
                 suspect: tuple[int, float] | None = None) -> Callable[[], list[rules.CheckpointRecord]]:
        """:meth:`records` with its inputs taken now and its work left to the callable returned, which
        reads nothing the leader changes later: a worker thread may run it while reports keep arriving
        (16,000 ranks: a few ms here, 0.3-1 s there)."""
        snaps = list(self.snapshots(job))
        if suspect is not None:
            snaps = [s for s in snaps if s.step < suspect[0] or s.created >= suspect[1]]
        if not snaps:
            done = sorted(durable, key=lambda r: r.step)
            return lambda: done
        invalid = {s: why for (j, s), why in self.invalid.items() if j == job}
        bad = {(s, r): dict(marks) for (j, s, r), marks in self.bad.items() if j == job}
        stops = {t: held(t[0], t[1] if t[1] >= 0 else None) for t in {(s.epoch, s.round) for s in snaps}}
        durable, dead = list(durable), frozenset(self._gone[2])

        def run() -> list[rules.CheckpointRecord]:
            with collector_paused():
                return merge(durable, snaps, rollback, lambda e, r: stops[(e, -1 if r is None else r)],
                             invalid, bad, dead)
        return run


def late_reason(late: Sequence[str], deadline_s: float) -> str:
    """What a restore target answered after the deadline adds: whose memory copies were not counted."""
    if not late:
        return ""
    more = f" and {len(late) - 10} more" if len(late) > 10 else ""
    return (f"; the memory copies of node(s) {', '.join(late[:10])}{more} are not counted: no memory report within "
            f"{deadline_s:g}s of this leader's election")


__all__ = ["MAX_SNAPSHOTS", "Manifest", "ManifestCache", "MemoryLedger", "Readiness", "Snap", "abandoned_floor",
           "check_manifest", "late_reason", "merge", "merge_due", "parse", "readiness", "snap_of"]
