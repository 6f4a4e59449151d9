"""Registrations committed in groups: every node that registers while one etcd transaction is in flight
goes in the next one (group commit, as databases do with their log).

A registration is a guarded etcd write. One at a time, 10,000 nodes starting together (a cluster's first
start, a whole-job restart on fresh machines) registered at ~80 a second on the development box, and the
detection tick, which takes the same membership lock, waited behind the whole queue: ticks of 22 s at
10,000 simulated nodes (``bench/coordinator_scale.py --agents 10000``), so no death could be declared
meanwhile. In groups of up to :func:`group_size` (a node record and an event each, within etcd's
``--max-txn-ops``) a tick waits behind one transaction at most.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R")
T = TypeVar("T")
TXN_RESERVED_OPS = 8  # the guard's compare, the world read, an event prune: what a commit adds


def group_size(max_txn_ops: int) -> int:
    """Registrations per transaction: each writes its node record and its event."""
    return max(1, (max_txn_ops - TXN_RESERVED_OPS) // 2)


class GroupCommit(Generic[R, T]):
    """Runs ``run`` on the requests waiting, up to ``max_group`` at a time, one group after another;
    each caller of :meth:`submit` gets its own answer (an exception is raised to its caller only). Two
    requests with the same ``key`` never share a group: the later one sees what the first committed."""

    def __init__(self, run: Callable[[list[R]], Awaitable[Sequence[T | BaseException]]], max_group: int,
                 key: Callable[[R], Hashable]) -> None:
        self._run = run
        self.max_group = max_group
        self._key = key
        self._queue: deque[tuple[R, asyncio.Future[T]]] = deque()
        self._task: asyncio.Task[None] | None = None
        self.groups = 0  # groups run so far (tests, the bench)

    async def submit(self, request: R) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await future  # a caller cancelled before its group runs is left out of it

    def _take(self) -> list[tuple[R, asyncio.Future[T]]]:
        group: list[tuple[R, asyncio.Future[T]]] = []
        keys: set[Hashable] = set()
        later: list[tuple[R, asyncio.Future[T]]] = []
        while self._queue and len(group) < self.max_group:
            request, future = self._queue.popleft()
            if future.done():
                continue
            key = self._key(request)
            if key in keys:
                later.append((request, future))
            else:
                keys.add(key)
                group.append((request, future))
        self._queue.extendleft(reversed(later))
        return group

    async def _drain(self) -> None:
        while self._queue:
            group = self._take()
            if not group:
                continue
            self.groups += 1
            answers: Sequence[T | BaseException] | None = None
            try:
                answers = await self._run([request for request, _ in group])
                if len(answers) != len(group):
                    raise RuntimeError(f"{len(answers)} answers to a group of {len(group)} requests")
            except Exception as exc:  # the whole group failed alike (NotLeader, etcd unreachable, a bug)
                answers = [exc] * len(group)
            finally:
                if answers is None:  # cancelled (shutdown): nobody waits forever
                    for _, future in group:
                        future.cancel()
            for (_, future), answer in zip(group, answers, strict=True):
                if future.done():
                    continue
                if isinstance(answer, BaseException):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
