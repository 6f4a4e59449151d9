"""The agent's Prometheus metrics (``ftd_agent_*``), and the little bookkeeping some of them need
(:meth:`AgentMetrics.observe_save_done`, :meth:`AgentMetrics.observe_flops`) so that the daemon only
forwards events."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .mfu import MfuMeter

# How many of the newest saves the save-size gauge looks at (their largest total is published).
SAVE_SIZE_WINDOW = 3


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.heartbeats = Counter("ftd_agent_heartbeats_sent_total", "Heartbeats sent to the coordinator",
                                  registry=r)
        self.beacons = Counter("ftd_agent_beacons_sent_total", "Liveness beacons (UDP) sent to the leader: with "
                               "them the heartbeat stream carries changes only", registry=r)
        self.connected = Gauge("ftd_agent_connected", "1 while a heartbeat stream to the leader is up", registry=r)
        self.reconnects = Counter("ftd_agent_reconnects_total", "Heartbeat sessions re-established", registry=r)
        self.epoch = Gauge("ftd_agent_epoch", "Epoch of the node's current assignment", registry=r)
        self.rank = Gauge("ftd_agent_rank", "Rank of the node in the current world (-1: spare)", registry=r)
        self.disk_free = Gauge("ftd_agent_disk_free_bytes", "Free bytes on a tier directory", ["tier"], registry=r)
        self.landing_ready = Gauge("ftd_agent_landing_reserve_bytes", "Room prepared in the memory tier for copies "
                                   "pulled from peers in a restore (agent.landing)", registry=r)
        self.landing_used = Counter("ftd_agent_landing_slots_used_total", "Pulled files received straight into a "
                                    "prepared slot of the landing reserve", registry=r)
        # One series per GPU (label gpu = the NVML index), so that alerts can judge each GPU: a node
        # average hides one idle GPU among eight.
        self.gpu_utilization = Gauge("ftd_agent_gpu_utilization_ratio", "GPU utilisation (0..1) from NVML",
                                     ["gpu"], registry=r)
        self.bytes_written = Counter("ftd_agent_checkpoint_bytes_written_total",
                                     "Checkpoint bytes written to a tier (saves to the SSD, copies to the others)",
                                     ["tier"], registry=r)
        self.tier_migrations = Counter("ftd_agent_tier_migrations_total", "Shards copied to a slower tier",
                                       ["tier"], registry=r)
        self.tier_errors = Counter("ftd_agent_tier_errors_total", "Failed copies (tier unreachable, full, corrupt)",
                                   ["tier"], registry=r)
        self.tier_deleted = Counter("ftd_agent_tier_retention_deleted_total", "Shards deleted by retention",
                                    ["tier"], registry=r)
        self.tier_lag_steps = Gauge("ftd_agent_tier_lag_steps",
                                    "Steps between the newest shard on the SSD and the newest on this tier", ["tier"],
                                    registry=r)
        self.tier_pending = Gauge("ftd_agent_tier_pending_shards", "Committed shards not yet copied to this tier",
                                  ["tier"], registry=r)
        self.last_valid_step = Gauge("ftd_agent_checkpoint_last_valid_step", "Newest valid checkpoint step",
                                     ["job"], registry=r)
        self.save_failures = Counter("ftd_agent_checkpoint_save_failures_total",
                                     "Checkpoint saves that failed on this node (e.g. disk full)", ["reason"],
                                     registry=r)
        self.save_blocked = Histogram("ftd_agent_checkpoint_save_blocked_seconds",
                                      "How long a save held the training loop (the snapshot)", registry=r,
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self.persist = Histogram("ftd_agent_checkpoint_persist_seconds",
                                 "Background part of a save: write, checksum, publish, commit", registry=r,
                                 buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200))
        self.save_in_progress = Gauge("ftd_agent_checkpoint_save_in_progress_seconds",
                                      "Age of the oldest save in flight on this node (0: none)", registry=r)
        # FtdTierSpaceLow compares each tier's free bytes with twice this (the next two saves).
        self.save_bytes = Gauge("ftd_agent_checkpoint_save_bytes",
                                "Bytes of one complete save of this node (all its ranks' shards of a step; the "
                                f"largest of the newest {SAVE_SIZE_WINDOW} saves; 0: none yet)", registry=r)
        self.training_steps = Counter("ftd_agent_training_steps_total", "Training steps completed", registry=r)
        self.training_loss = Gauge("ftd_agent_training_loss", "Latest loss reported by the workers", registry=r)
        self.step_anomalies = Counter("ftd_agent_step_anomalies_total",
                                      "Training steps judged anomalous (agent/step_anomalies.py), by kind: nan, "
                                      "loss_spike, grad_norm_jump", ["kind"], registry=r)
        self.grad_norm = Gauge("ftd_agent_training_grad_norm", "Latest gradient norm reported by the workers",
                               registry=r)
        self.training_step = Gauge("ftd_agent_training_step", "Latest training step reported by the workers",
                                   registry=r)
        self.training_mfu = Gauge("ftd_agent_training_mfu_ratio",
                                  "Model FLOPs utilisation (0..1) of the latest steps: reported flops per step / "
                                  "(step time x peak FLOP/s of one GPU); 0: unknown", registry=r)
        self.training_mfu_floor = Gauge("ftd_agent_training_mfu_floor_ratio",
                                        "The configured MFU floor (FtdMfuLow fires below it); 0: no floor",
                                        registry=r)
        self.preemption_notices = Counter("ftd_agent_preemption_notices_total",
                                          "Preemption notices seen (a final one starts a planned hand-over)",
                                          ["source", "kind"], registry=r)
        self.handover_pending = Gauge("ftd_agent_handover_pending",
                                      "1 while a planned hand-over of a node of the job is pending", registry=r)
        self.rpc_denied = Counter("ftd_agent_rpc_denied_total",
                                  "Calls refused by the authorization table (docs/security.md) or for a wrong drill "
                                  "token (rule drill_token), by method and rule", ["method", "rule"], registry=r)
        self.standbys_ready = Gauge("ftd_agent_standby_workers_ready",
                                    "Local ranks with a standby worker ready (torch imported): the node, spare "
                                    "or active, takes a rank without a cold start when this is nproc_per_node",
                                    registry=r)
        self.healthy = Gauge("ftd_agent_healthy", "1 when the node passes its health checks, else 0", registry=r)
        self._mfu = MfuMeter()
        self._save_totals: dict[int, int] = {}
        self._save_lock = threading.Lock()

    def configure_mfu(self, peak_flops_per_gpu: float, floor_ratio: float) -> None:
        """The peak FLOP/s of one GPU (0: unknown, no MFU) and the alert's floor (0: none), from settings."""
        self._mfu.peak_flops = peak_flops_per_gpu
        self.training_mfu_floor.set(floor_ratio)

    def observe_flops(self, step: int, at_s: float, flops: float) -> float | None:
        """A progress report carrying ``Progress.flops``; sets the MFU gauge when a value results."""
        value = self._mfu.observe(step, at_s, flops)
        if value is not None:
            self.training_mfu.set(value)
        return value

    def observe_save_done(self, step: int, nbytes: int) -> None:
        """One rank's shard of ``step`` is on the SSD: adds it to the step's total and publishes the
        largest total of the newest saves (a step still completing must not lower it)."""
        with self._save_lock:
            totals = self._save_totals
            totals[step] = totals.get(step, 0) + nbytes
            while len(totals) > SAVE_SIZE_WINDOW:  # the oldest by arrival (steps go back after a rollback)
                del totals[next(iter(totals))]
            self.save_bytes.set(max(totals.values()))
