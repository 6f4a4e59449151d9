"""A promoted node pulls its new ranks' shards before its workers ask for them.

A spare that takes a dead node's ranks finds their newest memory snapshot on the dead node's buddy,
not in its own memory tier: each of its workers, once its process group is up and its model wrapped,
asks the agent to pull its shard (``FetchShard``) and waits for it. Measured with the FSDP2 example
(38 M parameters, 2 nodes x 2 ranks + a spare, 2 cores): the promoted ranks' reads took 1.0-1.3 s,
the other ranks waited for them in the restore's agreement, while between the new epoch and the
workers' restore there were about 2 s in which nothing pulled. So on the assignment that gives this
node other ranks than before, the agent asks the catalog for the restore target and pulls what its
workers will read from another node, the copy they will choose (:func:`plan`); the worker's own
``FetchShard`` then finds it pulled or in flight (:class:`~.peer_copy.PeerFetcher` fetches one copy
once) instead of starting over.

Only a copy in another node's memory tier is pulled ahead: a rank that holds its shard in its own
memory has nothing to wait for, a durable copy is read by the worker from its own tier, and a target
saved by another world size is resharded by the workers from several old shards (nothing to guess).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ftd.checkpoints.catalog import MEMORY, CheckpointRecord
from ftd.v1 import agent_pb2, checkpoint_pb2, cluster_pb2

log = logging.getLogger("ftd.agent.restore_prefetch")


@dataclass(frozen=True)
class Ranks:
    """Which global ranks a node holds in an epoch (``rank`` is the node's, ``-1``: none)."""

    epoch: int
    rank: int
    world_size: int  # nodes
    nproc: int

    def globals(self) -> list[int]:
        return [] if self.rank < 0 else [self.rank * self.nproc + i for i in range(self.nproc)]


def ranks_of(a: cluster_pb2.Assignment, nproc: int) -> Ranks:
    active = a.role == cluster_pb2.ROLE_ACTIVE and not a.fenced and a.rank >= 0
    return Ranks(a.epoch, a.rank if active else -1, a.world_size, nproc)


def should_prefetch(before: Ranks | None, now: Ranks, job: str) -> tuple[bool, str]:
    """Whether the assignment ``now`` gives this node ranks whose shards may be elsewhere, and why."""
    if not job:
        return False, "no training job"
    if now.rank < 0:
        return False, "not in the world"
    if before is not None and (before.rank, before.world_size) == (now.rank, now.world_size):
        return False, f"the same ranks as in epoch {before.epoch}: their shards are in this node's memory"
    was = "a spare" if before is None or before.rank < 0 else f"node rank {before.rank} of {before.world_size}"
    return True, f"node rank {now.rank} of {now.world_size} in epoch {now.epoch} (was {was})"


def plan(record: CheckpointRecord, ranks: Iterable[int], node_id: str) -> list[list[agent_pb2.FetchShardRequest]]:
    """The pulls that let ``ranks`` restore ``record`` from this node: for each rank with no good copy
    in this node's memory tier, its good copies in other nodes' memory, in the order the worker tries
    them (by location, as :func:`ftd.training.restore.order_copies` sorts them); the first that can be
    pulled is (one on a dead node fails at once: the agent knows no address for it)."""
    out = []
    for rank in ranks:
        shard = record.shards.get(rank)
        if shard is None:
            continue
        memory = [c for c in shard.good_copies() if c.tier == MEMORY]
        if not memory or any(c.location == node_id for c in memory):
            continue
        expected = [checkpoint_pb2.ShardFile(name=f.name, size=f.size, crc32c=f.crc32c) for f in shard.files]
        out.append([agent_pb2.FetchShardRequest(job=record.job, step=record.step, rank=rank, tier=c.tier,
                                                location=c.location, expected=expected)
                    for c in sorted(memory, key=lambda c: c.location)])
    return out


class Prefetcher:
    """Calls :func:`plan` on an assignment that changed this node's ranks and pulls on a thread."""

    def __init__(self, node_id: str, job: str, nproc: int, target: Callable[[str, int], CheckpointRecord | None],
                 fetch: Callable[[agent_pb2.FetchShardRequest], object]) -> None:
        self.node_id, self.job, self.nproc = node_id, job, nproc
        self.target = target  # (job, world size in ranks) -> the catalog's restore target for it (None: none)
        self.fetch = fetch
        self._ranks: Ranks | None = None
        self._thread: threading.Thread | None = None
        self.pulled: list[tuple[int, int, str]] = []  # (step, rank, from node), for logs and tests

    def on_assignment(self, a: cluster_pb2.Assignment) -> bool:
        now = ranks_of(a, self.nproc)
        before, self._ranks = self._ranks, now
        go, why = should_prefetch(before, now, self.job)
        if not go:
            return False
        self._thread = threading.Thread(target=self._run, args=(now, why), name="ftd-restore-prefetch", daemon=True)
        self._thread.start()
        return True

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, ranks: Ranks, why: str) -> None:
        try:
            record = self.target(self.job, ranks.world_size * ranks.nproc)
        except Exception as exc:  # the workers ask again themselves: nothing is lost
            log.warning("restore prefetch (%s): no restore target: %s", why, exc)
            return
        if record is None or record.world_size != ranks.world_size * ranks.nproc:
            return
        for candidates in plan(record, ranks.globals(), self.node_id):
            failures = []
            for request in candidates:
                try:
                    self.fetch(request)
                except Exception as exc:  # the next copy; the worker's own FetchShard says why if none works
                    failures.append(f"{request.location}: {exc}")
                    continue
                self.pulled.append((request.step, request.rank, request.location))
                log.info("restore prefetch (%s): pulled job %s step %d rank %d from %s", why, request.job,
                         request.step, request.rank, request.location)
                break
            else:
                log.warning("restore prefetch of job %s step %d rank %d: no copy could be pulled (%s)", self.job,
                            record.step, candidates[0].rank, "; ".join(failures)[:1000])


__all__ = ["Prefetcher", "Ranks", "plan", "ranks_of", "should_prefetch"]
