"""The agent's Prometheus metrics (``ftd_agent_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.heartbeats = Counter("ftd_agent_heartbeats_sent_total", "Heartbeats sent to the coordinator",
                                  registry=r)
        self.connected = Gauge("ftd_agent_connected", "1 while a heartbeat stream to the leader is up", registry=r)
        self.reconnects = Counter("ftd_agent_reconnects_total", "Heartbeat sessions re-established", registry=r)
        self.epoch = Gauge("ftd_agent_epoch", "Epoch of the node's current assignment", registry=r)
        self.rank = Gauge("ftd_agent_rank", "Rank of the node in the current world (-1: spare)", registry=r)
        self.disk_free = Gauge("ftd_agent_disk_free_bytes", "Free bytes on a tier directory", ["tier"], registry=r)
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
        self.training_steps = Counter("ftd_agent_training_steps_total", "Training steps completed", registry=r)
        self.training_loss = Gauge("ftd_agent_training_loss", "Latest loss reported by the workers", registry=r)
        self.grad_norm = Gauge("ftd_agent_training_grad_norm", "Latest gradient norm reported by the workers",
                               registry=r)
        self.training_step = Gauge("ftd_agent_training_step", "Latest training step reported by the workers",
                                   registry=r)
