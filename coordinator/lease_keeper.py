"""The leader's lease, renewed from a thread of its own while the event loop makes progress.

The lease loop renews the lease every ``leader_ttl_s / 3`` from the event loop, on the lease calls'
own thread (store_calls.py). But the loop schedules that call: a new leader in a 2,000-node reconnect
storm had thousands of ready callbacks per turn and ran no timer for 2.6-3.3 s, past the 2.5 s it may
lead unconfirmed; it suspended itself, the lease expired, and the election and the storm began again
(bench/coordinator_scale.py --replicas 2 --kill-leader, 3 runs of 8). This thread renews it in step,
so a busy loop does not cost the leadership. It renews only while the loop has run a tick within
``max_lag_s``: a loop that is wedged, not busy, lets the lease lapse and a standby takes over
(:func:`renew_due`). A confirmation here is the same etcd keep-alive as the loop's own.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from .store import Lease, StoreUnavailable

log = logging.getLogger("ftd.coordinator.lease_keeper")


def renew_due(now: float, last_tick_at: float, max_lag_s: float) -> bool:
    """Whether the thread renews now: only while the loop ran a tick within ``max_lag_s`` (a tick may
    land between the thread reading the clock and the tick's time: that counts as now)."""
    return now - last_tick_at <= max_lag_s


class LeaseKeeper:
    def __init__(self, keep_alive: Callable[[Lease], bool], ttl_s: float, clock: Callable[[], float],
                 last_tick_at: Callable[[], float], max_lag_s: float) -> None:
        self.keep_alive, self.ttl_s, self.clock = keep_alive, ttl_s, clock
        self.last_tick_at, self.max_lag_s = last_tick_at, max_lag_s
        self.confirmed = -math.inf  # when the last keep-alive this thread sent was confirmed (sent at)
        self.lost = False  # etcd said the lease is gone
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, lease: Lease) -> None:
        self.stop()
        self.confirmed, self.lost = -math.inf, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(lease, self._stop), name="ftd-lease-keeper",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread = None

    def _run(self, lease: Lease, stop: threading.Event) -> None:
        while not stop.wait(self.ttl_s / 3):
            sent = self.clock()
            if not renew_due(sent, self.last_tick_at(), self.max_lag_s):
                continue
            try:
                still = self.keep_alive(lease)
            except StoreUnavailable:
                continue  # the lease loop judges an unreachable etcd
            if stop.is_set():
                return
            if not still:
                self.lost = True
                return
            self.confirmed = max(self.confirmed, sent)


__all__ = ["LeaseKeeper", "renew_due"]
