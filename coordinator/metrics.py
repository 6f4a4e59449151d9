"""The coordinator's Prometheus metrics (``ftd_coordinator_*``), on a registry per instance so that
several coordinators can live in one test process."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# (job, goodput ratio by window, lost seconds by cause) of every job the leader accounts
GoodputSamples = Iterable[tuple[str, dict[str, float], dict[str, float]]]


class JobGoodput(Collector):
    """``ftd_job_goodput_ratio{job,window}`` and ``ftd_job_lost_seconds_total{job,cause}``, read from
    the leader's goodput ledgers at scrape time (``source``: the controller's; empty on a standby)."""

    def __init__(self) -> None:
        self.source: Callable[[], GoodputSamples] = lambda: ()

    def collect(self) -> Iterator[Any]:
        ratio = GaugeMetricFamily("ftd_job_goodput_ratio", "Share of wall time spent on training steps that were "
                                  "kept (steps kept x failure-free step time / wall time), by window: 1h, or all "
                                  "(since the job's first step)", labels=["job", "window"])
        lost = CounterMetricFamily("ftd_job_lost_seconds", "Wall time the job lost to incidents, by cause: detection "
                                   "(failure to the leader's decision), restart (decision to the first new step), "
                                   "redone_steps (steps run again x the step time)", labels=["job", "cause"])
        for job, ratios, causes in self.source():
            for window, value in ratios.items():
                ratio.add_metric([job, window], value)
            for cause, seconds in causes.items():
                lost.add_metric([job, cause], seconds)
        yield ratio
        yield lost


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.nodes = Gauge("ftd_coordinator_nodes", "Registered nodes by state", ["state"], registry=r)
        self.heartbeats = Counter("ftd_coordinator_heartbeats_received_total",
                                  "Heartbeats received from agents", registry=r)
        self.heartbeat_answers = Counter("ftd_coordinator_heartbeat_answers_total",
                                         "Answers written on heartbeat streams (each costs about a message)",
                                         registry=r)
        self.mirror_reports = Counter("ftd_coordinator_memory_mirror_reports_total",
                                      "Memory reports a standby followed from the leader's ledger (memory_mirror.py)",
                                      registry=r)
        self.mirror_as_of = Gauge("ftd_coordinator_memory_mirror_as_of_unix_seconds",
                                  "A standby's followed memory ledger holds every report the leader took before "
                                  "this time (the leader's clock): now minus it is the mirror's lag", registry=r)
        self.heartbeat_streams = Gauge("ftd_coordinator_heartbeat_streams",
                                       "Open heartbeat streams", registry=r)
        self.beacons_accepted = Counter("ftd_coordinator_beacons_accepted_total",
                                        "Liveness beacons (UDP) accepted: each refreshed a node's liveness", registry=r)
        self.beacons_dropped = Counter("ftd_coordinator_beacons_dropped_total",
                                       "Datagrams on the beacon port dropped, by reason (malformed, unknown_key, "
                                       "wrong_node, bad_mac, replay, not_leader)", ["reason"], registry=r)
        self.beacon_echoes = Counter("ftd_coordinator_beacon_echoes_total",
                                     "Echoes sent to agents' beacons (UDP): the leader's liveness for a quiet stream",
                                     registry=r)
        self.probes = Counter("ftd_coordinator_probes_total",
                              "Probes pushed on the stream of a beaconing node whose beacons stopped", registry=r)
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
        self.nodes_declared_dead = Counter("ftd_coordinator_nodes_declared_dead_total",
                                           "Nodes declared dead (and fenced)", registry=r)
        self.recovery = Histogram("ftd_coordinator_recovery_seconds",
                                  "From a node's last heartbeat to the job's first step in the new world",
                                  buckets=(2, 4, 6, 8, 10, 15, 20, 30, 45, 60, 120, 300, 600), registry=r)
        self.recovery_phase = Histogram("ftd_coordinator_recovery_phase_seconds",
                                        "Recovery split into detect, commit, rendezvous and resume", ["phase"],
                                        buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 3, 5, 10, 20, 60, 300), registry=r)
        self.job_round = Gauge("ftd_coordinator_job_round", "Rendezvous round of the training job", ["job"],
                               registry=r)
        self.job_restarts = Gauge("ftd_coordinator_job_restarts", "Restarts the job's budget has counted", ["job"],
                                  registry=r)
        self.last_valid_step = Gauge("ftd_coordinator_checkpoint_last_valid_step", "Newest valid checkpoint step",
                                     ["job"], registry=r)
        self.last_valid_time = Gauge("ftd_coordinator_checkpoint_last_valid_timestamp_seconds",
                                     "When the newest valid checkpoint became valid (unix time)", ["job"], registry=r)
        self.checkpoint_interval = Gauge("ftd_coordinator_checkpoint_interval_seconds",
                                         "Seconds between the two newest valid checkpoints", ["job"], registry=r)
        self.recovery_open = Gauge("ftd_coordinator_recovery_open_seconds",
                                   "Age of the open recovery, from the dead node's last heartbeat (0: none)",
                                   registry=r)
        self.handovers = Counter("ftd_coordinator_handovers_total",
                                 "Planned hand-overs committed (preemption notices, drains)", registry=r)
        self.rpc_denied = Counter("ftd_coordinator_rpc_denied_total",
                                  "Calls refused by the authorization table (docs/security.md), by method and rule",
                                  ["method", "rule"], registry=r)
        self.straggler_score = Gauge("ftd_coordinator_straggler_score",
                                     "A node's median compute time per step over the other nodes' median "
                                     "(coordinator/stragglers.py; 0: not judged)", ["node"], registry=r)
        self.stragglers = Gauge("ftd_coordinator_stragglers", "Nodes of the world judged stragglers", registry=r)
        self.straggler_replacements = Counter("ftd_coordinator_straggler_replacements_total",
                                              "Stragglers handed over to a spare (straggler_action=replace)",
                                              registry=r)
        self.step_anomalies = Counter("ftd_coordinator_step_anomalies_total",
                                      "Step anomalies the agents reported (NaN/Inf, loss spike, gradient-norm jump), "
                                      "by kind", ["kind"], registry=r)
        self.fingerprint_checks = Counter("ftd_coordinator_fingerprint_checks_total",
                                          "Replica fingerprint comparisons that found a disagreement (mismatch) and "
                                          "confirmed corruptions acted on (fenced: the suspects' nodes; rolled_back: "
                                          "no majority to blame)", ["outcome"], registry=r)
        self.rollbacks = Counter("ftd_coordinator_rollbacks_total",
                                 "Jobs rolled back past a step anomaly (anomaly_action=rollback), by outcome: "
                                 "rolled_back, or closed (the rollback budget was spent)", ["outcome"], registry=r)
        self.job_goodput = JobGoodput()
        r.register(self.job_goodput)
        self.mass_silence_holds = Counter(
            "ftd_coordinator_mass_silence_holds_total",
            "Mass silences: more nodes falling silent together than mass_silence_fraction, whose deaths the "
            "leader held for mass_silence_hold_s (its own overload or isolation is the likelier cause)", registry=r)
        self.stalls = Counter("ftd_coordinator_detector_stalls_total",
                              "Detector runs skipped because the coordinator itself was stalled", registry=r)

    def mirrored(self, msg: Any) -> None:
        """A standby applied a message of the leader's memory ledger (a ``MemoryMirror``)."""
        self.mirror_reports.inc(len(msg.reports))
        if not msg.continues:  # the batch is whole: every report taken before its time is here
            self.mirror_as_of.set(msg.as_of_unix_s)
