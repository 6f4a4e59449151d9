"""Runs the state store's blocking calls off the event loop and keeps track of whether etcd answers.

Lease calls have a thread of their own, so a slow data call (a large load, a commit) can never hold
a keep-alive back past the lease TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .metrics import CoordinatorMetrics
from .store import StoreUnavailable

log = logging.getLogger("ftd.coordinator")
T = TypeVar("T")


class StoreCalls:
    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics
        self.etcd_ok = True
        self._outage_logged = False
        self._data_pool = ThreadPoolExecutor(4, thread_name_prefix="ftd-etcd")
        self._lease_pool = ThreadPoolExecutor(1, thread_name_prefix="ftd-lease")

    async def data(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """Loads, commits and reads; ``op`` labels the error counter."""
        return await self._run(self._data_pool, op, fn, *args)

    async def lease(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """Campaign, keep-alive, resign and the leader lookup."""
        return await self._run(self._lease_pool, op, fn, *args)

    def lease_now(self, fn: Callable[..., T], *args: Any) -> T:
        """A lease call from another thread (lease_keeper.py), on the lease calls' own thread."""
        return self._lease_pool.submit(fn, *args).result()

    async def _run(self, pool: ThreadPoolExecutor, op: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except StoreUnavailable as exc:
            self.metrics.etcd_errors.labels(op).inc()
            self.etcd_ok = False
            if not self._outage_logged:
                log.warning("etcd unreachable (%s); membership changes are on hold", exc)
                self._outage_logged = True
            raise
        if not self.etcd_ok:
            log.info("etcd reachable again")
        self.etcd_ok, self._outage_logged = True, False
        return result

    def shutdown(self) -> None:
        self._data_pool.shutdown(wait=False, cancel_futures=True)
        self._lease_pool.shutdown(wait=False, cancel_futures=True)
