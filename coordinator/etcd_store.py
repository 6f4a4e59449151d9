"""The state store on etcd's v3 API (client: ``etcd-sdk-python``, module ``pyetcd``).

Key layout under ``/ftd/<cluster>/`` (who writes: the leader, inside guarded transactions):

=====================  ==========================================================================
``leader``             :class:`LeaderInfo` JSON, bound to the leader's lease (deleted on expiry)
``nodes/<node_id>``    :class:`NodeRecord` JSON: written on registration, fencing, re-admission
``world``              :class:`World` JSON: epoch, node ids by rank, target size, reason
``events/<seq:016d>``  :class:`Event` JSON: the event log, pruned to the newest N
=====================  ==========================================================================

Heartbeats never touch etcd. Every gRPC or client error is translated here, once, into
:class:`StoreUnavailable` with the cause chained.
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

from .model import (
    CorruptRecord,
    Event,
    LeaderInfo,
    NodeRecord,
    World,
    decode_event,
    decode_leader,
    decode_node,
    decode_world,
    encode,
)
from .store import (
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
T = TypeVar("T")

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
            for kv in resp.kvs:
                key = kv.key.decode()
                if key == self.keys.world:
                    world, world_rev = decode_world(key, kv.value), kv.mod_revision
                elif key == self.keys.leader:
                    leader = decode_leader(key, kv.value)
                elif key.startswith(self.keys.nodes):
                    node = decode_node(key, kv.value)
                    nodes[node.node_id] = node
            last = self._data.get_prefix_response(
                self.keys.events, sort_order="descend", sort_target="key", limit=1, revision=revision
            )
            last_seq = int(last.kvs[0].key.decode().rsplit("/", 1)[1]) if last.kvs else 0
            extra = self._data.get_prefix_response(self.keys.kv, revision=revision)
            kv = {item.key.decode()[len(self.keys.kv):]: item.value for item in extra.kvs}
            return Snapshot(nodes, world, world_rev, last_seq, leader, kv)

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
    ) -> CommitResult:
        kv_puts = kv_puts or {}
        for key in [*kv_puts, *kv_deletes]:
            check_kv_key(key)
        compare = [tx.Value(self.keys.leader) == encode(guard.leader)]
        ops: list[Any] = [tx.Put(self.keys.node(n.node_id), encode(n)) for n in nodes]
        if world is not None:
            if guard.world_revision is None:
                raise ValueError("a commit that writes the world needs guard.world_revision")
            compare.append(tx.Mod(self.keys.world) == guard.world_revision)
            ops.append(tx.Put(self.keys.world, encode(world)))
        ops += [tx.Put(self.keys.event(e.seq), encode(e)) for e in events]
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

    def list_events(self, limit: int) -> list[Event]:
        def read() -> list[Event]:
            resp = self._data.get_prefix_response(
                self.keys.events, sort_order="descend", sort_target="key", limit=limit
            )
            return [decode_event(kv.key.decode(), kv.value) for kv in resp.kvs]

        return self._call("list_events", read)

    # ---- leadership ------------------------------------------------------------------------

    def current_leader(self) -> LeaderInfo | None:
        value, _ = self._call("current_leader", lambda: self._lease.get(self.keys.leader))
        return decode_leader(self.keys.leader, value) if value is not None else None

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
