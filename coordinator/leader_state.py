"""What the keepers of the leader's records (membership, job rounds, the checkpoint catalog) need of
the leader, as a Protocol: its view and the guarded commit. They depend on this, not on the control
loop or on :class:`~.committer.Committer`, so each can be tested against a fake and none imports
another."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .model import NodeRecord, World
from .store import CommitResult
from .view import ClusterView

EventLine = tuple[str, str, str]  # (kind, node_id, message) of an event to log with a commit


class LeaderState(Protocol):
    @property
    def view(self) -> ClusterView | None:
        """The leader's view, ``None`` on a standby; for reads that must not fail (gauges)."""

    def require_leader(self) -> ClusterView:
        """The view, or :class:`~.errors.NotLeader` naming the leader to follow."""

    async def commit(self, kind: str, *, nodes: Sequence[NodeRecord] = (), world: World | None = None,
                     events: Sequence[EventLine] = (), kv_puts: Mapping[str, bytes] | None = None,
                     kv_deletes: Sequence[str] = (), node_deletes: Sequence[str] = ()) -> CommitResult:
        """Commits in one guarded transaction or raises; node records (written or deleted) and the
        world are applied to the view on success, other records by the caller."""
