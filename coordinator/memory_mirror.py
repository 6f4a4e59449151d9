"""Hot standbys follow the leader's memory ledger, so a failover does not wait for a reconnect storm.

Memory snapshots are soft state in the leader (memory_ledger.py): a new leader used to know none until
every agent of the job's world had re-opened its stream to it and re-announced its memory tier. At
2,000 nodes on a small box that storm took 5-20 s after the takeover, and a restore target waited for
it. Now every standby follows the leader (``Coordinator.FollowMemory``, replicas' certificates only):

* the leader (:class:`MirrorFeed`) sends a follower every report it holds (``full``), then every
  :data:`MIRROR_INTERVAL_S` the reports it took since (the newest per node; an empty message otherwise,
  which says it lives). A report is forwarded as the leader took it: snapshots it refused are left out,
  so the follower's cheap checks take exactly what the leader took.
* the follower (:class:`MirrorFollower`) keeps them in its own ledger. Elected, it keeps them if it
  heard from the last leader within the lease's TTL of the election (:func:`mirror_usable`), and
  answers restore targets at once; each node's own report replaces its mirrored one as its stream
  re-opens.

The mirror can lack the reports of its last interval before the leader died. The restore floor
(restore_floors.py, in etcd, written before a leader first answers a newer step) makes that safe: an
answer from the mirror that is older than a step answered before waits for the agents' own reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from ftd import rpc
from ftd.identity import IdentityFiles, TlsMaterial, server_name
from ftd.throttle import LogThrottle
from ftd.v1 import coordinator_pb2, coordinator_pb2_grpc

from .memory_ledger import MemoryLedger

log = logging.getLogger("ftd.coordinator.memory_mirror")
MIRROR_INTERVAL_S = 0.25  # a follower hears from the leader at least this often
MESSAGE_BYTES = 4 << 20  # a batch is split into messages of about this much (gRPC's limit here: 16 MiB)


def mirror_usable(now: float, synced: bool, heard_at: float, window_s: float) -> bool:
    """Whether a replica elected at ``now`` keeps the reports it followed: it had a full copy from the
    last leader (``synced``) and heard from it within ``window_s`` (the lease's TTL plus a mirror
    interval: the last leader's lease ran out that long after its last message at most)."""
    return synced and 0 <= now - heard_at <= window_s


@dataclass
class _Follower:
    replica_id: str
    dirty: set[str] = field(default_factory=set)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class MirrorFeed:
    """The leader's side: the newest report per node as it took it, and what each follower still lacks."""

    def __init__(self, replica_id: str, holds: Callable[[str], bool], interval_s: float = MIRROR_INTERVAL_S,
                 wall: Callable[[], float] = time.time) -> None:
        self.replica_id, self.holds, self.interval_s, self.wall = replica_id, holds, interval_s, wall
        self.latest: dict[str, tuple[str, coordinator_pb2.MemoryReport]] = {}  # node -> (incarnation, report)
        self.followers: list[_Follower] = []

    def add(self, node: str, incarnation: str, report: coordinator_pb2.MemoryReport) -> None:
        """A report the leader took (or, on a follower, one it followed: its next term's feed)."""
        self.latest[node] = (incarnation, report)
        for f in self.followers:
            f.dirty.add(node)

    def forget(self, node: str) -> None:
        """The leader forgot a node (no longer in the cluster): its report is not kept for followers."""
        self.latest.pop(node, None)

    def reset(self, keep: bool) -> None:
        """A new term: the feed starts from the reports kept (``keep``), or from none."""
        if not keep:
            self.latest.clear()
        self.close()

    def close(self) -> None:
        """This replica no longer leads: its followers' streams end (they follow the next leader)."""
        for f in self.followers:
            f.closed.set()
            f.wake.set()
        self.followers.clear()

    def _messages(self, nodes: list[str], full: bool) -> list[coordinator_pb2.MemoryMirror]:
        """The reports of ``nodes`` in messages of about :data:`MESSAGE_BYTES` (a full copy of 2,000
        nodes x 32 snapshots is ~10 MB); all but the last say ``continues``."""
        batches: list[list[coordinator_pb2.MirroredReport]] = [[]]
        size = 0
        for node in nodes:
            got = self.latest.get(node)
            if got is None or not self.holds(node):
                continue
            one = coordinator_pb2.MirroredReport(node_id=node, incarnation=got[0], report=got[1])
            size += one.ByteSize()
            if size > MESSAGE_BYTES and batches[-1]:
                batches.append([])
                size = one.ByteSize()
            batches[-1].append(one)
        as_of = self.wall()
        return [coordinator_pb2.MemoryMirror(leader_replica_id=self.replica_id, full=full and i == 0, reports=batch,
                                             interval_s=self.interval_s, as_of_unix_s=as_of,
                                             continues=i < len(batches) - 1)
                for i, batch in enumerate(batches)]

    async def follow(self, replica_id: str) -> AsyncIterator[coordinator_pb2.MemoryMirror]:
        """One follower's stream: everything, then what changed every interval, until :meth:`close`."""
        me = _Follower(replica_id)
        self.followers.append(me)
        log.info("replica %s follows the memory ledger (%d nodes' reports)", replica_id, len(self.latest))
        try:
            for msg in self._messages(list(self.latest), True):
                yield msg
            while not me.closed.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(me.wake.wait(), self.interval_s)
                if me.closed.is_set():
                    return
                nodes, me.dirty = sorted(me.dirty), set()
                for msg in self._messages(nodes, False):
                    yield msg
        finally:
            with contextlib.suppress(ValueError):
                self.followers.remove(me)


class MirrorFollower:
    """A standby's side: follows the current leader's feed into this replica's own ledger (and feed)."""

    def __init__(self, replica_id: str, ledger: MemoryLedger, feed: MirrorFeed,
                 tls: IdentityFiles | TlsMaterial | None, clock: Callable[[], float],
                 on_message: Callable[[coordinator_pb2.MemoryMirror], None] = lambda msg: None) -> None:
        self.replica_id, self.ledger, self.feed, self.tls, self.clock = replica_id, ledger, feed, tls, clock
        self.on_message = on_message  # each message applied (metrics)
        self.source = ""  # the leader whose full copy this replica holds ("" none)
        self._filling = ""  # the leader whose full copy is arriving
        self.heard_at = -math.inf
        self._log = LogThrottle(log)

    @property
    def synced(self) -> bool:
        return bool(self.source)

    def usable(self, now: float, window_s: float) -> bool:
        return mirror_usable(now, self.synced, self.heard_at, window_s)

    def forget(self) -> None:
        """This replica leads, or follows another leader: what it followed is no longer a copy of anyone's."""
        self.source, self._filling, self.heard_at = "", "", -math.inf

    def apply(self, msg: coordinator_pb2.MemoryMirror) -> None:
        """One message of the leader's feed. The copy counts (:attr:`synced`) once a full one arrived
        whole; a delta from a leader whose full copy this replica does not hold is not applied."""
        leader = msg.leader_replica_id
        if msg.full:
            self.ledger.clear_reports()
            self.feed.latest.clear()
            self.source, self._filling = "", leader
        elif leader not in (self.source, self._filling):
            return  # a delta without its full copy: not a copy of anything (a new stream starts with one)
        for r in msg.reports:
            self.ledger.take(r.node_id, r.incarnation, r.report)
            self.feed.add(r.node_id, r.incarnation, r.report)
        if self._filling == leader and not msg.continues:
            self.source, self._filling = leader, ""
        self.heard_at = self.clock()
        self.on_message(msg)

    async def follow(self, leader_id: str, address: str) -> None:
        """Follows ``leader_id`` at ``address`` until the stream ends or fails (the caller retries)."""
        name = server_name("coordinator", leader_id) if self.tls is not None else None
        channel = rpc.aio_channel(address, tls=self.tls, server_name=name)
        try:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            call = stub.FollowMemory(coordinator_pb2.FollowMemoryRequest(replica_id=self.replica_id))
            async for msg in call:
                self.apply(msg)
        except grpc.RpcError as exc:
            self._log.log(logging.INFO, f"follow:{leader_id}", "following the memory ledger of leader %s at %s: %s",
                          leader_id, address, rpc.describe(exc))
        finally:  # what it followed stays: a leader's death ends the stream, and then the copy is needed
            await channel.close(None)


__all__ = ["MIRROR_INTERVAL_S", "MirrorFeed", "MirrorFollower", "mirror_usable"]
