"""The state store on etcd's v3 API (client: ``etcd-sdk-python``, module ``pyetcd``).

Key layout under ``/ftd/<cluster>/`` (who writes: the leader, inside guarded transactions):

=====================  ==========================================================================
``leader``             :class:`LeaderInfo` JSON, bound to the leader's lease (deleted on expiry)
``nodes/<node_id>``    :class:`NodeRecord` JSON: written on registration, fencing, re-admission
``world``              :class:`World` JSON: epoch, node ids by rank, target size, reason
``events/<seq:016d>``  :class:`Event` JSON: the event log, pruned to the newest N
=====================  ==========================================================================

Heartbeats never touch etcd. Every gRPC or client error is translated here, once, into
:class:`StoreUnavailable` with the cause chained, or :class:`StoreRejected` when etcd refused the
request itself (a full database says so, and how to free it).

A record that does not decode is skipped and named in ``Snapshot.problems`` (a corrupt event is
left out of ``list_events``): it never fails a load, so it cannot keep a leader from leading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import pyetcd.exceptions
from pyetcd import transactions as tx

from ftd.etcd_client import make_client, next_member
from ftd.rpc import rpc_code, rpc_details
from ftd.throttle import LogThrottle

from .model import (
    CorruptRecord,
    Event,
    LeaderInfo,
    NodeRecord,
    World,
    clip_event,
    decode_event,
    decode_leader,
    decode_node,
    decode_world,
    encode,
    world_after_corruption,
)
from .store import (
    NOSPACE,
    NOSPACE_HINT,
    CommitResult,
    Guard,
    Lease,
    Snapshot,
    StaleStateError,
    StoreRejected,
    StoreUnavailable,
    check_kv_key,
    new_leader_info,
)

log = logging.getLogger(__name__)
_throttle = LogThrottle(log)
T = TypeVar("T")

_ALARM_NAMES = {1: NOSPACE, 2: "corrupt"}  # etcdserverpb.AlarmType
_CONNECTIVITY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


class Keys:
    def __init__(self, cluster: str) -> None:
        self.prefix = f"/ftd/{cluster}/"
        self.leader = self.prefix + "leader"
        self.world = self.prefix + "world"
        self.nodes = self.prefix + "nodes/"
        self.events = self.prefix + "events/"
        self.kv = self.prefix + "kv/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def event(self, seq: int) -> str:
        return f"{self.events}{seq:016d}"


class EtcdStore:
    """:class:`~.store.StateStore` on etcd v3. Two clients: leases never queue behind data calls."""

    def __init__(self, endpoints: str, cluster: str = "default", timeout_s: float = 2.0) -> None:
        self.endpoints = endpoints
        self.keys = Keys(cluster)
        self._data = make_client(endpoints, timeout_s)
        # Lease calls get a short deadline: a call stuck on a member that just lost its leader must
        # fail fast so the next attempt (another member) confirms the lease well within its TTL.
        self._lease = make_client(endpoints, min(timeout_s, 1.0))

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            # pyetcd turns connectivity codes into its own exceptions; what is left is a refusal.
            code = rpc_code(exc)
            if code is None or code in _CONNECTIVITY:
                self._move_on()
                raise StoreUnavailable(f"{op} on etcd {self.endpoints}", exc) from exc
            if "space exceeded" in rpc_details(exc):
                raise StoreRejected(f"{op} on etcd {self.endpoints}", f"{NOSPACE_HINT} ({rpc_details(exc)})") from exc
            raise StoreRejected(f"{op} on etcd {self.endpoints}", f"{code.name}: {rpc_details(exc)}") from exc
        except (pyetcd.exceptions.Etcd3Exception, ValueError) as exc:
            # ValueError: pyetcd's "Trying to use a failed node" when every endpoint just failed.
            self._move_on()
            raise StoreUnavailable(f"{op} on etcd {self.endpoints}", exc) from exc

    def _move_on(self) -> None:
        for client in (self._data, self._lease):
            next_member(client)

    # ---- data ----------------------------------------------------------------------------

    def load(self) -> Snapshot:
        def read() -> Snapshot:
            # leader < nodes/ < world in key order: one range reads all three consistently.
            resp = self._data.get_range_response(self.keys.leader, self.keys.world + "\0")
            revision = resp.header.revision
            nodes: dict[str, NodeRecord] = {}
            world, world_rev, leader = World(), 0, None
            problems: list[str] = []
            world_corrupt = False
            for kv in resp.kvs:
                key = kv.key.decode("utf-8", "replace")
                try:
                    if key == self.keys.world:
                        world, world_rev = decode_world(key, kv.value), kv.mod_revision
                    elif key == self.keys.leader:
                        leader = decode_leader(key, kv.value)
                    elif key.startswith(self.keys.nodes):
                        node = decode_node(key, kv.value)
                        if node.node_id != key[len(self.keys.nodes):]:
                            raise CorruptRecord(key, f"names node {node.node_id!r}")
                        nodes[node.node_id] = node
                except CorruptRecord as exc:
                    # The world key is the one record a leader cannot do without: it keeps its
                    # revision, so a commit replaces the bad value rather than racing another writer.
                    if key == self.keys.world:
                        world_rev, world_corrupt = kv.mod_revision, True
                    problems.append(str(exc))
            # The newest events: the last sequence number, and (should the world not decode) the
            # newest epoch any of them names.
            last = self._data.get_prefix_response(
                self.keys.events, sort_order="descend", sort_target="key", limit=20, revision=revision
            )
            last_seq, last_epoch = 0, 0
            for i, item in enumerate(last.kvs):
                try:
                    seq = int(item.key.decode().rsplit("/", 1)[1])
                    last_seq = max(last_seq, seq)
                    last_epoch = max(last_epoch, decode_event(self.keys.event(seq), item.value).epoch)
                except (UnicodeDecodeError, ValueError, IndexError):  # CorruptRecord is a ValueError
                    if i == 0:
                        problems.append(f"event key {item.key!r} is not a decodable events/<seq> record")
            if world_corrupt:
                world = world_after_corruption(nodes, last_epoch)
            extra = self._data.get_prefix_response(self.keys.kv, revision=revision)
            kv = {item.key.decode("utf-8", "replace")[len(self.keys.kv):]: item.value for item in extra.kvs}
            return Snapshot(nodes, world, world_rev, last_seq, leader, kv, tuple(problems))

        return self._call("load", read)

    def commit(
        self,
        guard: Guard,
        nodes: Sequence[NodeRecord] = (),
        world: World | None = None,
        events: Sequence[Event] = (),
        prune_events_below: int = 0,
        kv_puts: Mapping[str, bytes] | None = None,
        kv_deletes: Sequence[str] = (),
        node_deletes: Sequence[str] = (),
    ) -> CommitResult:
        kv_puts = kv_puts or {}
        for key in [*kv_puts, *kv_deletes]:
            check_kv_key(key)
        for node_id in node_deletes:
            check_kv_key(node_id)
        compare = [tx.Value(self.keys.leader) == encode(guard.leader)]
        ops: list[Any] = [tx.Put(self.keys.node(n.node_id), encode(n)) for n in nodes]
        ops += [tx.Delete(self.keys.node(n)) for n in node_deletes]
        if world is not None:
            if guard.world_revision is None:
                raise ValueError("a commit that writes the world needs guard.world_revision")
            compare.append(tx.Mod(self.keys.world) == guard.world_revision)
            ops.append(tx.Put(self.keys.world, encode(world)))
        ops += [tx.Put(self.keys.event(e.seq), encode(clip_event(e))) for e in events]
        ops += [tx.Put(self.keys.kv + k, v) for k, v in kv_puts.items()]
        ops += [tx.Delete(self.keys.kv + k) for k in kv_deletes]
        if prune_events_below > 1:
            ops.append(tx.Delete(self.keys.event(0), range_end=self.keys.event(prune_events_below)))
        ops.append(tx.Get(self.keys.world))

        succeeded, responses = self._call(
            "commit", lambda: self._data.transaction(compare=compare, success=ops, failure=[])
        )
        if not succeeded:
            raise StaleStateError(
                f"commit by {guard.leader.replica_id} refused: leadership lost or the world changed "
                f"since revision {guard.world_revision}"
            )
        world_kvs = responses[-1]
        return CommitResult(world_kvs[0][1].mod_revision if world_kvs else 0)

    def list_events(self, limit: int, before_seq: int = 0, after_seq: int | None = None) -> list[Event]:
        def read() -> list[Event]:
            if after_seq is not None:  # a range that ends past any 16-digit sequence number
                resp = self._data.get_range_response(self.keys.event(after_seq + 1), self.keys.events + "~",
                                                     sort_order="ascend", sort_target="key", limit=limit)
            elif before_seq > 0:
                resp = self._data.get_range_response(self.keys.event(0), self.keys.event(before_seq),
                                                     sort_order="descend", sort_target="key", limit=limit)
            else:
                resp = self._data.get_prefix_response(
                    self.keys.events, sort_order="descend", sort_target="key", limit=limit
                )
            out = []
            for kv in resp.kvs:
                key = kv.key.decode("utf-8", "replace")
                try:
                    out.append(decode_event(key, kv.value))
                except CorruptRecord as exc:  # every ListEvents would log it again: throttled
                    _throttle.log(logging.WARNING, "corrupt_event", "%s (left out of the event list)", exc)
            return out

        return self._call("list_events", read)

    def alarms(self) -> list[str]:
        def read() -> list[str]:
            raised = {_ALARM_NAMES.get(a.alarm_type, f"alarm-{a.alarm_type}") for a in self._data.list_alarms()}
            return sorted(raised)

        return self._call("alarms", read)

    # ---- leadership ------------------------------------------------------------------------

    def current_leader(self) -> LeaderInfo | None:
        value, _ = self._call("current_leader", lambda: self._lease.get(self.keys.leader))
        if value is None:
            return None
        try:
            return decode_leader(self.keys.leader, value)
        except CorruptRecord as exc:
            # Somebody holds the key (nobody may campaign), but it names nobody to follow.
            _throttle.log(logging.ERROR, "corrupt_leader", "%s; waiting for its lease to expire", exc)
            return LeaderInfo("unknown (corrupt leader record)", "", 0.0, "corrupt")

    def campaign(self, replica_id: str, address: str, ttl_s: int, now_unix: float) -> Lease | None:
        info = new_leader_info(replica_id, address, now_unix)
        grant = self._call("campaign", lambda: self._lease.lease(ttl_s))
        won, _ = self._call(
            "campaign",
            lambda: self._lease.transaction(
                compare=[tx.Create(self.keys.leader) == 0],
                success=[tx.Put(self.keys.leader, encode(info), lease=grant.id)],
                failure=[],
            ),
        )
        if not won:
            self._call("campaign", lambda: self._lease.revoke_lease(grant.id))
            return None
        return Lease(grant.id, ttl_s, info)

    def keep_alive(self, lease: Lease) -> bool:
        replies = self._call("keep_alive", lambda: list(self._lease.refresh_lease(lease.id)))
        if not replies or replies[-1].TTL <= 0:
            return False
        value, _ = self._call("keep_alive", lambda: self._lease.get(self.keys.leader))
        return value is not None and value == encode(lease.leader)

    def resign(self, lease: Lease) -> None:
        self._call(
            "resign",
            lambda: self._lease.transaction(
                compare=[tx.Value(self.keys.leader) == encode(lease.leader)],
                success=[tx.Delete(self.keys.leader)],
                failure=[],
            ),
        )
        self._call("resign", lambda: self._lease.revoke_lease(lease.id))

    def close(self) -> None:
        for client in (self._data, self._lease):
            try:
                client.close()
            except Exception:  # closing a channel to a dead server must not mask the real error
                log.debug("closing etcd client failed", exc_info=True)


__all__ = ["CorruptRecord", "EtcdStore", "Keys"]
