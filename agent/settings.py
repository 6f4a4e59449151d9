"""The agent's one validated settings object (file + ``FTD_AGENT_*`` env + flags)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from ftd.identity import IdentityFiles
from ftd.node_ids import valid_node_id
from ftd.rpc import parse_endpoints
from ftd.settings import require, setting
from ftd.storage_backends.memory import DEFAULT_ROOT, default_capacity
from ftd.storage_backends.tiers import LocalSpec, S3Spec, TierSpec

from .health_rules import HealthThresholds
from .preemption_sources import PreemptionConfig
from .step_anomalies import AnomalyConfig

ENV_PREFIX = "FTD_AGENT_"


def _hostport_ok(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)


@dataclass(frozen=True)
class AgentSettings:
    node_id: str = setting("", "unique id of this node (default: the host name)")
    host: str = setting("", "host name or address this node is reached at (default: the host name)")
    role: str = setting("active", "role asked for at registration: active or spare")
    labels: dict[str, str] = setting(
        {}, "node labels KEY=VALUE[,KEY=VALUE...], e.g. rack=r1 (the failure domain: the coordinator's domain_label)")
    coordinators: str = setting("127.0.0.1:7400",
                                "coordinator replicas HOST:PORT[,HOST:PORT...]; the leader is followed")
    listen: str = setting("127.0.0.1:7410", "agent gRPC address HOST:PORT for operators and drills (port 0: any)")
    workdir: Path = setting(Path("/var/lib/ftd"), "node directory: socket, state, default tier directories")
    socket_path: Path | None = setting(None, "Unix socket for the training process (default: WORKDIR/agent.sock)")
    ssd_dir: Path | None = setting(None, "hot checkpoint tier directory (default: WORKDIR/ssd)")
    hdd_dir: Path | None = setting(None, "warm checkpoint tier directory (default: WORKDIR/hdd)")
    hdd_shared: bool = setting(False, "the HDD tier directory is a filesystem shared by all nodes (NFS, Lustre...)")
    s3_endpoint: str = setting("", "S3-compatible endpoint URL of the cold tier (empty: no cold tier)")
    s3_bucket: str = setting("ftd-checkpoints", "bucket of the cold tier")
    s3_prefix: str = setting("", "key prefix inside the bucket")
    s3_region: str = setting("us-east-1", "region of the cold tier")
    s3_timeout_s: float = setting(10.0, "read timeout of one S3 request", "s")
    s3_max_attempts: int = setting(5, "attempts of an idempotent S3 request before the tier counts as unreachable",
                                   "attempts")
    keep_per_tier: int = setting(3, "valid checkpoints kept on each tier", "checkpoints")
    tier_bandwidth_mb_s: float = setting(200.0, "bandwidth cap of background migrations (0: none)", "MB/s")
    tiering_interval_s: float = setting(2.0, "period of the tiering pass (migrations, retention)", "s")
    mem_tier: bool = setting(True, "hold memory snapshots (the memory tier) and replicate them to a buddy node")
    mem_dir: Path | None = setting(None, "memory tier directory, on tmpfs: memory snapshots of this node's ranks and "
                                         "its buddies' replicas (default /dev/shm/ftd/NODE_ID)")
    mem_capacity_bytes: int = setting(0, "budget of the memory tier; a snapshot that would exceed it is refused, never "
                                         "an OOM (0: a quarter of the node's memory)", "bytes")
    replication_bandwidth_mb_s: float = setting(0.0, "bandwidth cap of memory snapshot replication to the buddy "
                                                     "(0: none)", "MB/s")
    peer_copy_port: int = setting(0, "TCP port of the fast peer copy path (shard copies for other nodes' restores, "
                                     "AES-GCM under a one-time key sent over mTLS); 0: any free port, -1: off "
                                     "(gRPC streams only)", "port")
    peer_max_streams: int = setting(8, "shard streams one peer identity may hold open on this node at once (ReadShard, "
                                       "WriteShard, OpenShard offers and their bulk sends, PullReplica); more are "
                                       "RESOURCE_EXHAUSTED", "streams")
    peer_max_inflight_mb: int = setting(32768, "bytes of shards one peer identity may have in flight to or from this "
                                               "node at once; more are RESOURCE_EXHAUSTED", "MiB")
    peer_idle_timeout_s: float = setting(30.0, "a peer's shard stream that moves no chunk for this long is cancelled",
                                         "s")
    peer_view_grace_s: float = setting(2.0, "a peer call the data-plane rules refuse waits this long for a newer "
                                            "assignment (a buddy or a rank that changed just now) before it is denied",
                                       "s")
    landing_reserve_mb: int = setting(-1, "room prepared in the memory tier for the copies a restore pulls from peers "
                                          "(ftd.agent.landing); -1: auto (on a spare, a node's share of the newest "
                                          "step held in memory), 0: none, N: one slot of N MiB on any node", "MiB")
    train_cmd: str = setting("", "training script and its arguments in torchrun's form (SCRIPT ARGS or -m MODULE "
                                 "ARGS), nproc_per_node ranks of it while the node holds a rank: by the launcher's "
                                 "standby workers, which run the job's prepare() ahead (docs/training.md), or under "
                                 "torchrun (empty: the agent launches no training)")
    launcher: str = setting("warm", "how training processes start: warm (standby workers with torch imported, "
                                    "started by the agent: a membership change costs no new interpreter) or "
                                    "torchrun (torchrun --rdzv-backend=ftd)")
    train_job: str = setting("train", "job id of the training (torchrun --rdzv-id)")
    nproc_per_node: int = setting(1, "training processes per node (torchrun --nproc-per-node)", "processes")
    min_nodes: int = setting(1, "the job runs only with at least this many nodes (torchrun --nnodes MIN)", "nodes")
    max_nodes: int = setting(1024, "torchrun --nnodes MAX", "nodes")
    max_restarts: int = setting(10, "restart budget of the whole job, counted by the coordinator", "restarts")
    on_no_spare: str = setting("shrink", "a node lost and no spare to take its rank: shrink (the job goes on with "
                                         "the smaller world, restoring the newest step resharded) or wait (it waits "
                                         "for a spare or a returning node; ftctl status says why)")
    hang_timeout_s: float = setting(120.0, "no training step for this long: a hang (0: off)", "s")
    hang_startup_grace_s: float = setting(600.0, "allowance for the first step after a (re)start", "s")
    heartbeat_interval_s: float = setting(0.5, "period of heartbeats to the coordinator", "s")
    coordinator_timeout_s: float = setting(3.0, "no answer from the leader for this long: reconnect (with "
                                                 "confirmed beacons: beacon_keepalive_s longer)", "s")
    beacons: bool = setting(True, "send liveness beacons (UDP, every heartbeat_interval_s) when the leader offers "
                                  "them; the stream then carries changes only (docs/architecture.md)")
    beacon_port: int = setting(0, "UDP port the beacons go to on the leader's host (0: the port the leader names; "
                                  "set it where that port is mapped to another, e.g. by a Service)", "port")
    beacon_keepalive_s: float = setting(
        4.0, "with beacons, a stream message at least this often: its answer tells this agent the leader lives", "s")
    progress_interval_s: float = setting(
        1.0, "with beacons, a new training step or memory report goes on the stream at most this often", "s")
    reconnect_max_backoff_s: float = setting(1.0, "upper bound of the reconnect backoff", "s")
    health_interval_s: float = setting(2.5, "period of disk/GPU health sampling (on its own thread; heartbeats "
                                            "carry the latest verdict)", "s")
    health_deadline_s: float = setting(5.0, "a disk or NVML query running longer than this is reported hung in "
                                            "the verdict (the node unhealthy, its heartbeats unaffected)", "s")
    health_min_free: dict[str, str] = setting(
        {}, "health check: minimum free space per tier TIER=SIZE[,...], e.g. ssd=10GiB (unlisted: not checked)")
    health_expected_gpus: int = setting(0, "health check: GPUs the node must have (0: not checked)", "GPUs")
    health_max_gpu_temp_c: float = setting(85.0, "health check: hottest GPU allowed (0: not checked)", "°C")
    preempt_sources: tuple[str, ...] = setting(
        ("file", "signal"), "preemption notice sources: auto (detect the cloud), aws, gce, azure, file, signal; "
                            "none: off. On a cloud VM use auto")
    preempt_file: Path | None = setting(None, "the 'file' source's trigger file (default: WORKDIR/preemption-notice)")
    preempt_poll_interval_s: float = setting(2.0, "period of polling the notice sources (AWS advises 5 s)", "s")
    peak_flops_per_gpu: float = setting(0.0, "peak FLOP/s of one GPU in the training's precision, for MFU "
                                             "(0: MFU not computed)", "FLOP/s")
    anomaly_loss_spike_factor: float = setting(
        10.0, "a step's loss above this many times the rank's trailing median is an anomaly", "ratio")
    anomaly_grad_norm_jump: float = setting(
        0.30, "a gradient norm this fraction above the rank's trailing median is an anomaly (the seed's 30 %)",
        "ratio")
    anomaly_window_steps: int = setting(50, "the trailing steps per rank an anomaly is judged against", "steps")
    anomaly_min_history: int = setting(10, "steps a rank needs before its steps are judged", "steps")
    mfu_floor: float = setting(0.0, "MFU below which FtdMfuLow fires (0: no alert)", "ratio")
    pki_dir: Path | None = setting(
        None, "mutual TLS and authorization: the PKI directory holding ca.crt, nodes/<node_id>.crt|.key (the agent) "
              "and rendezvous/<node_id>.crt|.key (its torchrun rendezvous handler) (docs/security.md); empty: "
              "plaintext, no authorization (tests only)")
    drill_token_file: Path | None = setting(
        None, "optional second factor of Kill (drills): a file (mode 0600) holding a secret that ftctl drill must "
              "send as well; with pki_dir an operator certificate alone authorises drills, without it drills need it")
    drill_token: str = setting("", "the drill token itself, from the environment (FTD_AGENT_DRILL_TOKEN) only; prefer "
                                   "drill_token_file")
    metrics_listen: str = setting("127.0.0.1:9402", "Prometheus /metrics address HOST:PORT (empty: disabled)")
    ready_file: Path | None = setting(None, "write {pid, node_id, address, socket, metrics} JSON here once serving")
    log_level: str = setting("INFO", "log level: DEBUG, INFO, WARNING, ERROR")

    def __post_init__(self) -> None:
        require(not self.node_id or valid_node_id(self.node_id), "node_id",
                f"{self.node_id!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
        require(not (self.drill_token and self.drill_token_file), "drill_token",
                "set drill_token or drill_token_file, not both")
        require(self.role in ("active", "spare"), "role", f"must be active or spare, got {self.role!r}")
        try:
            parse_endpoints(self.coordinators, "coordinator endpoint")
        except ValueError as exc:
            require(False, "coordinators", str(exc))
        require(_hostport_ok(self.listen), "listen", f"expected HOST:PORT, got {self.listen!r}")
        require(not self.metrics_listen or _hostport_ok(self.metrics_listen), "metrics_listen",
                f"expected HOST:PORT, got {self.metrics_listen!r}")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", f"must be > 0 (got {self.heartbeat_interval_s})")
        require(self.coordinator_timeout_s > self.heartbeat_interval_s, "coordinator_timeout_s",
                f"must be > heartbeat_interval_s ({self.heartbeat_interval_s}), got {self.coordinator_timeout_s}")
        require(0 <= self.beacon_port <= 65535, "beacon_port", f"must be in [0, 65535] (got {self.beacon_port})")
        require(self.heartbeat_interval_s < self.beacon_keepalive_s <= 60, "beacon_keepalive_s",
                f"must be in (heartbeat_interval_s, 60], got {self.beacon_keepalive_s}")
        require(self.progress_interval_s >= 0, "progress_interval_s",
                f"must be >= 0 (got {self.progress_interval_s})")
        require(self.reconnect_max_backoff_s > 0, "reconnect_max_backoff_s",
                f"must be > 0 (got {self.reconnect_max_backoff_s})")
        require(self.launcher in ("warm", "torchrun"), "launcher", f"must be warm or torchrun, got {self.launcher!r}")
        require(self.nproc_per_node >= 1, "nproc_per_node", f"must be >= 1 (got {self.nproc_per_node})")
        require(1 <= self.min_nodes <= self.max_nodes, "min_nodes",
                f"must be in [1, max_nodes={self.max_nodes}], got {self.min_nodes}")
        require(self.max_restarts >= 0, "max_restarts", f"must be >= 0 (got {self.max_restarts})")
        require(self.on_no_spare in ("shrink", "wait"), "on_no_spare",
                f"must be shrink or wait, got {self.on_no_spare!r}")
        require(self.hang_timeout_s >= 0, "hang_timeout_s", f"must be >= 0 (got {self.hang_timeout_s})")
        require(bool(self.train_job) and "/" not in self.train_job and ".." not in self.train_job, "train_job",
                f"{self.train_job!r} is not a job id")
        require(self.keep_per_tier >= 1, "keep_per_tier", f"must be >= 1 (got {self.keep_per_tier})")
        require(self.tier_bandwidth_mb_s >= 0, "tier_bandwidth_mb_s", f"must be >= 0 (got {self.tier_bandwidth_mb_s})")
        require(self.tiering_interval_s > 0, "tiering_interval_s", f"must be > 0 (got {self.tiering_interval_s})")
        require(self.mem_capacity_bytes >= 0, "mem_capacity_bytes", f"must be >= 0 (got {self.mem_capacity_bytes})")
        require(-1 <= self.peer_copy_port <= 65535, "peer_copy_port",
                f"must be in [-1, 65535] (got {self.peer_copy_port})")
        require(self.peer_max_streams >= 1, "peer_max_streams", f"must be >= 1 (got {self.peer_max_streams})")
        require(self.peer_max_inflight_mb >= 1, "peer_max_inflight_mb",
                f"must be >= 1 (got {self.peer_max_inflight_mb})")
        require(self.peer_idle_timeout_s > 0, "peer_idle_timeout_s", f"must be > 0 (got {self.peer_idle_timeout_s})")
        require(self.peer_view_grace_s >= 0, "peer_view_grace_s", f"must be >= 0 (got {self.peer_view_grace_s})")
        require(self.landing_reserve_mb >= -1, "landing_reserve_mb",
                f"must be -1 (auto), 0 (none) or a size in MiB (got {self.landing_reserve_mb})")
        require(self.replication_bandwidth_mb_s >= 0, "replication_bandwidth_mb_s",
                f"must be >= 0 (got {self.replication_bandwidth_mb_s})")
        require(not self.s3_endpoint or self.s3_endpoint.startswith(("http://", "https://")), "s3_endpoint",
                f"must be an http(s):// URL, got {self.s3_endpoint!r}")
        require(bool(self.s3_bucket), "s3_bucket", "must not be empty")
        require(self.s3_timeout_s > 0, "s3_timeout_s", f"must be > 0 (got {self.s3_timeout_s})")
        require(self.s3_max_attempts >= 1, "s3_max_attempts", f"must be >= 1 (got {self.s3_max_attempts})")
        require(self.health_interval_s > 0, "health_interval_s", f"must be > 0 (got {self.health_interval_s})")
        require(self.health_deadline_s > 0, "health_deadline_s", f"must be > 0 (got {self.health_deadline_s})")
        require(self.preempt_poll_interval_s > 0, "preempt_poll_interval_s",
                f"must be > 0 (got {self.preempt_poll_interval_s})")
        require(self.peak_flops_per_gpu >= 0, "peak_flops_per_gpu", f"must be >= 0 (got {self.peak_flops_per_gpu})")
        try:
            self.anomalies  # noqa: B018 (validated by constructing it)
        except ValueError as exc:
            require(False, "anomaly_*", str(exc))
        require(0 <= self.mfu_floor < 1, "mfu_floor", f"must be in [0, 1) (got {self.mfu_floor})")
        try:
            _ = self.preemption
        except ValueError as exc:
            require(False, "preempt_sources", str(exc))
        try:
            _ = self.health_thresholds
        except ValueError as exc:
            require(False, "health_min_free", str(exc))
        require(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
                f"unknown level {self.log_level!r}")

    @property
    def anomalies(self) -> AnomalyConfig:
        return AnomalyConfig(self.anomaly_loss_spike_factor, self.anomaly_grad_norm_jump, self.anomaly_window_steps,
                             self.anomaly_min_history)

    @property
    def effective_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    @property
    def effective_host(self) -> str:
        return self.host or socket.gethostname()

    @property
    def identity(self) -> IdentityFiles | None:
        """This agent's certificate files (``None``: plaintext gRPC)."""
        return IdentityFiles(self.pki_dir, "node", self.effective_node_id) if self.pki_dir is not None else None

    @property
    def effective_socket(self) -> Path:
        return self.socket_path or self.workdir / "agent.sock"

    @property
    def tiers(self) -> dict[str, Path]:
        return {"ssd": self.ssd_dir or self.workdir / "ssd", "hdd": self.hdd_dir or self.workdir / "hdd"}

    @property
    def mem_path(self) -> Path:
        """The memory tier's directory (``mem_tier`` on)."""
        return self.mem_dir or DEFAULT_ROOT / self.effective_node_id

    @property
    def preemption(self) -> PreemptionConfig:
        sources = tuple(s for s in self.preempt_sources if s != "none")
        return PreemptionConfig(sources=sources, poll_interval_s=self.preempt_poll_interval_s,
                                file_path=self.preempt_file or self.workdir / "preemption-notice")

    @property
    def health_thresholds(self) -> HealthThresholds:
        return HealthThresholds(min_free_bytes=dict(self.health_min_free),  # type: ignore[arg-type]  # parsed there
                                expected_gpus=self.health_expected_gpus, max_gpu_temp_c=self.health_max_gpu_temp_c)

    @property
    def tier_specs(self) -> list[TierSpec]:
        """This node's tiers, fastest first, with every setting: the agent opens them and sends the
        same specs to the training process (``GetTiers``). Local copies of S3 objects (a restore from
        the cold tier) are spooled on the SSD tier, the disk sized for checkpoints. The memory tier,
        when on, comes first (node-local, with its byte budget)."""
        node = self.effective_node_id
        specs = [TierSpec("mem", node, LocalSpec(self.mem_path, self.mem_capacity_bytes or default_capacity()))
                 ] if self.mem_tier else []
        specs += [TierSpec("ssd", node, LocalSpec(self.tiers["ssd"])),
                  TierSpec("hdd", "shared" if self.hdd_shared else node, LocalSpec(self.tiers["hdd"]))]
        if self.s3_endpoint:
            specs.append(TierSpec("s3", "s3", S3Spec(
                endpoint=self.s3_endpoint, bucket=self.s3_bucket, prefix=self.s3_prefix, region=self.s3_region,
                read_timeout_s=self.s3_timeout_s, max_attempts=self.s3_max_attempts,
                state_dir=self.workdir / "s3-uploads", spool_dir=self.tiers["ssd"])))
        return specs
