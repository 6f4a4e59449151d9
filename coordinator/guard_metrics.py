"""What the coordinator's guards on its inputs and its state store catch, as metrics on the same
registry as :class:`~.metrics.CoordinatorMetrics`: writes refused by the per-node rate limit
(``ftd_coordinator_rate_limited_total{method}``), stored records the leader could not decode
(``ftd_coordinator_corrupt_records``), etcd's alarms (``ftd_coordinator_etcd_alarm{alarm}``: NOSPACE
refuses every write) and records of long-fenced nodes removed (``ftd_coordinator_nodes_collected_total``).
The first three stay at zero on a healthy cluster: a rise means a misbehaving client or a state
store in trouble; the last is housekeeping.

:func:`guard_metrics` returns the one instance of a registry (made on first use), so every part
of a replica that holds the registry reaches the same metric objects without new wiring. Every label
value comes from a fixed set: :data:`ALARMS`, :data:`~.rate_limits.RATE_LIMITED_METHODS`.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge

from .rate_limits import RATE_LIMITED_METHODS

ALARMS = ("nospace", "corrupt")  # etcd's alarm types, as the label of ftd_coordinator_etcd_alarm


class GuardMetrics:
    """The guard metrics of one registry; obtain them with :func:`guard_metrics`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.corrupt_records = Gauge(
            "ftd_coordinator_corrupt_records",
            "Stored records the leader skipped at its last load because they do not decode (see ftctl status)",
            registry=r)
        self.etcd_alarm = Gauge("ftd_coordinator_etcd_alarm",
                                "1 while etcd raises the alarm (nospace: writes refused until space is freed "
                                "and the alarm disarmed)", ["alarm"], registry=r)
        for alarm in ALARMS:
            self.etcd_alarm.labels(alarm).set(0)
        self.rate_limited = Counter("ftd_coordinator_rate_limited_total",
                                    "Writes refused by the per-node rate limit (RESOURCE_EXHAUSTED)", ["method"],
                                    registry=r)
        for method in RATE_LIMITED_METHODS:
            self.rate_limited.labels(method)
        self.nodes_collected = Counter("ftd_coordinator_nodes_collected_total",
                                       "Records of nodes fenced longer than the retention, removed", registry=r)

    def count_limited(self, method: str) -> None:
        """The limiter's hook; a method outside the fixed set is counted as ``other``."""
        self.rate_limited.labels(method if method in RATE_LIMITED_METHODS else "other").inc()


_instances: weakref.WeakKeyDictionary[CollectorRegistry, GuardMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def guard_metrics(registry: CollectorRegistry) -> GuardMetrics:
    """The :class:`GuardMetrics` of ``registry`` (created and registered on first use)."""
    with _lock:
        found = _instances.get(registry)
        if found is None:
            found = _instances[registry] = GuardMetrics(registry)
        return found
