"""The coordinator's durable state: node records, the world of an epoch, events, the leader record.

These are plain immutable values with a JSON form; the state store persists them and the pure
decision functions (:mod:`.detector`, :mod:`.placement`) compute new ones. A record that does not
parse is a :class:`CorruptRecord` naming its key, never a crash deep inside a handler.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Role(str, enum.Enum):
    ACTIVE = "active"
    SPARE = "spare"


class CorruptRecord(ValueError):
    """A stored record does not parse; ``key`` names it."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"record {key!r} is corrupt: {why}")
        self.key = key


def valid_node_id(node_id: str) -> bool:
    """Node ids become etcd keys and directory names: no separators, no dot-dot, bounded length."""
    return bool(NODE_ID_RE.match(node_id)) and node_id not in (".", "..")


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


@dataclass(frozen=True)
class LeaderInfo:
    """The value of the leader key. ``token`` is unique per term so a guard can compare it."""

    replica_id: str
    address: str
    since_unix_s: float
    token: str


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


def decode_node(key: str, raw: bytes) -> NodeRecord:
    data = _load(key, raw)
    try:
        fence = data.pop("fence", None)
        role = Role(data.pop("requested_role"))
        node = NodeRecord(requested_role=role, **data)
        return node.with_fence(Fence(**fence) if fence else None)
    except (TypeError, ValueError, KeyError) as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_world(key: str, raw: bytes) -> World:
    data = _load(key, raw)
    try:
        data["ranks"] = tuple(data["ranks"])
        data["handed_over"] = tuple(data.get("handed_over", ()))
        return World(**data)
    except (TypeError, KeyError) as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_event(key: str, raw: bytes) -> Event:
    try:
        return Event(**_load(key, raw))
    except TypeError as exc:
        raise CorruptRecord(key, str(exc)) from exc


def decode_leader(key: str, raw: bytes) -> LeaderInfo:
    try:
        return LeaderInfo(**_load(key, raw))
    except TypeError as exc:
        raise CorruptRecord(key, str(exc)) from exc
