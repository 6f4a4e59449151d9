"""The coordinator's Prometheus metrics (``ftd_coordinator_*``), on a registry per instance so that
several coordinators can live in one test process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.nodes = Gauge("ftd_coordinator_nodes", "Registered nodes by state", ["state"], registry=r)
        self.heartbeats = Counter("ftd_coordinator_heartbeats_received_total",
                                  "Heartbeats received from agents", registry=r)
        self.heartbeat_streams = Gauge("ftd_coordinator_heartbeat_streams",
                                       "Open heartbeat streams", registry=r)
        self.detection_latency = Histogram(
            "ftd_coordinator_detection_latency_seconds",
            "Time from a node's last heartbeat to it being declared dead",
            buckets=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0), registry=r)
        self.epoch = Gauge("ftd_coordinator_epoch", "Current epoch of the world", registry=r)
        self.world_size = Gauge("ftd_coordinator_world_size", "Ranks in the current world", registry=r)
        self.world_target_size = Gauge("ftd_coordinator_world_target_size", "Ranks the world should have",
                                       registry=r)
        self.spares = Gauge("ftd_coordinator_spares", "Alive spare nodes", registry=r)
        self.epoch_changes = Counter("ftd_coordinator_epoch_changes_total", "Committed epoch changes",
                                     registry=r)
        self.is_leader = Gauge("ftd_coordinator_is_leader", "1 on the leader replica, 0 on standbys", registry=r)
        self.etcd_errors = Counter("ftd_coordinator_etcd_errors_total", "Failed etcd calls", ["op"], registry=r)
        self.etcd_writes = Counter("ftd_coordinator_etcd_writes_total",
                                   "Committed etcd write transactions (never per heartbeat)", ["kind"],
                                   registry=r)
        self.commit_seconds = Histogram("ftd_coordinator_etcd_commit_duration_seconds",
                                        "Duration of guarded etcd commits", registry=r)
        self.tick_seconds = Histogram("ftd_coordinator_tick_duration_seconds",
                                      "Duration of one detection + reconciliation tick", registry=r,
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        self.stalls = Counter("ftd_coordinator_detector_stalls_total",
                              "Detector runs skipped because the coordinator itself was stalled", registry=r)
