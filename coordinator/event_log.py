"""Reading the event log kept in etcd, a page at a time, newest first (``ListEvents``), or the events
after a sequence number, oldest first (a watcher following the log). The leader writes events with
its commits; reading them is a plain store call that the caller checks leadership for."""

from __future__ import annotations

from ftd.v1 import cluster_pb2, coordinator_pb2

from . import errors, paging
from .model import Event
from .store import StateStore, StoreUnavailable
from .store_calls import StoreCalls


class EventLog:
    def __init__(self, store: StateStore, calls: StoreCalls) -> None:
        self.store, self.calls = store, calls

    async def events(self, limit: int, before_seq: int = 0, after_seq: int | None = None) -> list[Event]:
        try:
            return await self.calls.data("list_events", self.store.list_events, limit, before_seq, after_seq)
        except StoreUnavailable as exc:
            raise errors.StateUnavailable(f"cannot read the event log: {exc}") from exc

    async def page(self, request: coordinator_pb2.ListEventsRequest,
                   last_seq: int | None = None) -> coordinator_pb2.ListEventsResponse:
        """``limit`` events (0: 100, at most 10000) and about :data:`~.paging.MAX_PAGE_BYTES`; the
        token is the oldest sequence number handed out. With ``after_seq``, the events after it,
        oldest first; ``last_seq`` (the leader's newest) answers "nothing newer" without etcd."""
        limit = request.limit or 100
        if limit > 10000:
            raise errors.InvalidArgument("limit", f"at most 10000, got {limit}")
        if request.HasField("after_seq"):
            return await self._after(request, limit, last_seq)
        page = paging.page(0, request.page_token, r"[0-9]{0,20}")
        before = int(page.token) if page.token else 0
        if page.token and before <= 1:
            return coordinator_pb2.ListEventsResponse()
        events = await self.events(limit, before)
        shown, more = paging.take_page(
            (cluster_pb2.Event(seq=e.seq, at_unix_s=e.at_unix_s, kind=e.kind, node_id=e.node_id, epoch=e.epoch,
                               message=e.message) for e in events), limit, cluster_pb2.Event.ByteSize)
        more = more or (len(events) == limit and bool(shown) and shown[-1].seq > 1)
        return coordinator_pb2.ListEventsResponse(events=shown, next_page_token=str(shown[-1].seq) if more else "")

    async def _after(self, request: coordinator_pb2.ListEventsRequest, limit: int,
                     last_seq: int | None) -> coordinator_pb2.ListEventsResponse:
        if request.page_token:
            raise errors.InvalidArgument("page_token", "not with after_seq (the last event's seq is the cursor)")
        if last_seq is not None and request.after_seq >= last_seq:
            return coordinator_pb2.ListEventsResponse()
        events = await self.events(limit, after_seq=request.after_seq)
        shown, more = paging.take_page(
            (cluster_pb2.Event(seq=e.seq, at_unix_s=e.at_unix_s, kind=e.kind, node_id=e.node_id, epoch=e.epoch,
                               message=e.message) for e in events), limit, cluster_pb2.Event.ByteSize)
        more = more or len(events) == limit
        return coordinator_pb2.ListEventsResponse(events=shown, next_page_token=str(shown[-1].seq) if more and shown
                                                  else "")
