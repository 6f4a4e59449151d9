"""The coordinator's durable state: node records, the world of an epoch, events, the leader record.

These are plain immutable values with a JSON form; the state store persists them and the pure
decision functions (:mod:`.detector`, :mod:`.placement`) compute new ones. A record that does not
parse is a :class:`CorruptRecord` naming its key, never a crash deep inside a handler.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ftd.node_ids import valid_node_id


class Role(str, enum.Enum):
    ACTIVE = "active"
    SPARE = "spare"


class CorruptRecord(ValueError):
    """A stored record does not parse; ``key`` names it."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"record {key!r} is corrupt: {why}")
        self.key = key


@dataclass(frozen=True)
class Fence:
    """Why and when a node was removed from the world. It may come back only as a spare."""

    epoch: int  # the epoch that was committed without it
    reason: str
    at_unix_s: float


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    host: str
    requested_role: Role  # what the node asked for; whether it holds a rank is the world's business
    labels: Mapping[str, str] = field(default_factory=dict)
    agent_address: str = ""
    pid: int = 0
    incarnation: str = ""
    registered_unix_s: float = 0.0
    fence: Fence | None = None

    @property
    def fenced(self) -> bool:
        return self.fence is not None

    def with_fence(self, fence: Fence | None) -> NodeRecord:
        return replace(self, fence=fence)


@dataclass(frozen=True)
class World:
    """Which node holds which rank in an epoch. Epochs only grow; a node fenced out of an epoch can
    never act in it again."""

    epoch: int = 0
    ranks: tuple[str, ...] = ()
    target_size: int = 0  # the size the world should have; below it the world is degraded
    reason: str = "initial"
    changed_unix_s: float = 0.0
    handed_over: tuple[str, ...] = ()  # nodes that left this epoch by a planned hand-over, not a failure

    def rank_of(self, node_id: str) -> int:
        try:
            return self.ranks.index(node_id)
        except ValueError:
            return -1

    @property
    def degraded(self) -> bool:
        return len(self.ranks) < self.target_size


@dataclass(frozen=True)
class Event:
    seq: int
    at_unix_s: float
    kind: str
    message: str
    node_id: str = ""
    epoch: int = 0


MAX_EVENT_MESSAGE = 2048  # characters of one event's message (an etcd value each)


def clip_event(event: Event) -> Event:
    """``event`` with its message cut to :data:`MAX_EVENT_MESSAGE` characters."""
    if len(event.message) <= MAX_EVENT_MESSAGE:
        return event
    return replace(event, message=event.message[:MAX_EVENT_MESSAGE - 3] + "...")


@dataclass(frozen=True)
class LeaderInfo:
    """The value of the leader key. ``token`` is unique per term so a guard can compare it."""

    replica_id: str
    address: str
    since_unix_s: float
    token: str


def world_after_corruption(nodes: Mapping[str, NodeRecord], last_event_epoch: int) -> World:
    """What a leader works from when the stored world does not decode: no ranks (the nodes that are
    alive join again) at an epoch no lower than any epoch the records name, so epochs still only grow
    and a fenced node can never act in its old epoch."""
    floor = max([last_event_epoch, *(n.fence.epoch for n in nodes.values() if n.fence is not None)])
    return World(epoch=floor, reason="the stored world record is corrupt: rebuilt from the live nodes")


# ---- JSON codec -------------------------------------------------------------------------------


def encode(value: NodeRecord | World | Event | LeaderInfo) -> bytes:
    data: dict[str, Any] = asdict(value)
    if isinstance(value, NodeRecord):
        data["requested_role"] = value.requested_role.value
        data["labels"] = dict(value.labels)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _load(key: str, raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRecord(key, f"not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CorruptRecord(key, f"expected an object, got {type(data).__name__}")
    return data


def _check_types(key: str, data: dict[str, Any], types: Mapping[str, type]) -> None:
    """Every field of ``data`` is known and of its type (a float field takes an int), so that a record
    that decodes can be used without a type error deep inside a handler."""
    for name, value in data.items():
        want = types.get(name)
        if want is None:
            raise CorruptRecord(key, f"unknown field {name!r}")
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise CorruptRecord(key, f"field {name!r} is {type(value).__name__}, not {want.__name__}")


_NODE = {"node_id": str, "host": str, "requested_role": str, "labels": dict, "agent_address": str, "pid": int,
         "incarnation": str, "registered_unix_s": float, "fence": dict}
_FENCE = {"epoch": int, "reason": str, "at_unix_s": float}
_WORLD = {"epoch": int, "ranks": list, "target_size": int, "reason": str, "changed_unix_s": float,
          "handed_over": list}
_EVENT = {"seq": int, "at_unix_s": float, "kind": str, "message": str, "node_id": str, "epoch": int}
_LEADER = {"replica_id": str, "address": str, "since_unix_s": float, "token": str}


def _strings(key: str, name: str, values: Any) -> None:
    if not all(isinstance(v, str) for v in values):
        raise CorruptRecord(key, f"{name} holds something other than strings")


def decode_node(key: str, raw: bytes) -> NodeRecord:
    data = _load(key, raw)
    fence = data.pop("fence", None)
    _check_types(key, data, _NODE)
    labels = data.get("labels", {})
    _strings(key, "labels", [*labels, *labels.values()])
    if fence is not None:
        if not isinstance(fence, dict):
            raise CorruptRecord(key, "fence is not an object")
        _check_types(key, fence, _FENCE)
    try:
        role = Role(data.pop("requested_role"))
        node = NodeRecord(requested_role=role, **data)
        if not valid_node_id(node.node_id):
            raise ValueError(f"node id {node.node_id[:80]!r} is not valid")
        return node.with_fence(Fence(**fence) if fence else None)
    except (TypeError, ValueError, KeyError) as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_world(key: str, raw: bytes) -> World:
    data = _load(key, raw)
    _check_types(key, data, _WORLD)
    _strings(key, "ranks", data.get("ranks", ()))
    _strings(key, "handed_over", data.get("handed_over", ()))
    try:
        data["ranks"] = tuple(data["ranks"])
        data["handed_over"] = tuple(data.get("handed_over", ()))
        return World(**data)
    except (TypeError, KeyError) as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_event(key: str, raw: bytes) -> Event:
    data = _load(key, raw)
    _check_types(key, data, _EVENT)
    try:
        return Event(**data)
    except TypeError as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_leader(key: str, raw: bytes) -> LeaderInfo:
    data = _load(key, raw)
    _check_types(key, data, _LEADER)
    try:
        return LeaderInfo(**data)
    except TypeError as exc:
        raise CorruptRecord(key, str(exc)) from exc
