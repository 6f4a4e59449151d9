"""The coordinator's one validated settings object (file + ``FTD_COORDINATOR_*`` env + flags)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from ftd.etcd_client import EtcdTls, parse_endpoints
from ftd.identity import IdentityFiles, PkiError
from ftd.rpc import parse_hostport
from ftd.settings import require, setting

from .detector import DetectorSettings, MassSilence
from .handover_rules import HandoverPolicy
from .rollback_rules import RollbackConfig
from .stragglers import StragglerConfig

ENV_PREFIX = "FTD_COORDINATOR_"


@dataclass(frozen=True)
class CoordinatorSettings:
    listen: str = setting("127.0.0.1:7400", "gRPC listen address HOST:PORT (port 0 picks a free one)")
    advertise: str = setting("", "address other processes reach this replica at (default: the bound listen address)")
    replica_id: str = setting("", "unique name of this replica (default: HOSTNAME-PID)")
    etcd_endpoints: str = setting("127.0.0.1:2379", "etcd v3 client endpoints, HOST:PORT[,HOST:PORT...]")
    cluster: str = setting("default", "cluster name; all keys live under /ftd/<cluster>/ in etcd; with pki_dir also "
                                      "the cluster of the PKI (certificates of another cluster are refused)")
    pki_dir: Path | None = setting(
        None, "mutual TLS and authorization on the gRPC listener: the PKI directory holding ca.crt and "
              "coordinators/<replica_id>.crt|.key (docs/security.md); empty: plaintext, no authorization "
              "(tests only: anyone who reaches the port may do anything)")
    etcd_ca_file: Path | None = setting(None, "TLS to etcd: the CA certificate of etcd's members (empty: plaintext)")
    etcd_cert_file: Path | None = setting(
        None, "TLS to etcd: the client certificate for etcd's --client-cert-auth (its CN, ftd-coordinator, is the "
              "etcd user); with etcd_key_file")
    etcd_key_file: Path | None = setting(None, "TLS to etcd: the key of etcd_cert_file")
    etcd_timeout_s: float = setting(2.0, "deadline of one etcd call", "s")
    leader_ttl_s: int = setting(3, "TTL of the leader lease; a dead leader is replaced after about this long", "s")
    suspect_after_s: float = setting(1.2, "heartbeat silence after which a node is shown as suspect", "s")
    dead_after_s: float = setting(2.5, "heartbeat silence after which a node is declared dead", "s")
    disconnect_dead_after_s: float = setting(
        1.5, "a node whose heartbeat stream closed and did not reopen within this is declared dead", "s")
    stall_after_s: float = setting(
        1.0, "if the detector itself was not run for this long, nobody is judged until grace passes", "s")
    mass_silence_fraction: float = setting(
        0.1, "more than this fraction of the nodes dying within dead_after_s is a mass silence: more likely the "
             "leader overloaded or cut off, so their deaths are held for mass_silence_hold_s", "ratio")
    mass_silence_min_nodes: int = setting(8, "fewer nodes dying together than this is never a mass silence", "nodes")
    mass_silence_hold_s: float = setting(
        10.0, "how long a mass silence's deaths are held (those still silent are declared then; 0: no hold)", "s")
    failover_grace_s: float = setting(
        8.0, "after becoming leader, a node that has not heartbeated to it yet is not judged before this", "s")
    tick_s: float = setting(0.1, "period of the detection / reconciliation loop", "s")
    memory_report_deadline_s: float = setting(
        4.0, "after becoming leader, restore targets wait at most this long for every alive node's memory report "
             "(memory snapshots are soft state, re-announced by the agents); then durable + reported, and it says so",
        "s")
    memory_snapshots_in_etcd: bool = setting(
        False, "record CommitShard/RecordCopy with tier mem in etcd as before issue 19 (one transaction per rank "
               "and step): only to measure the old path (bench/coordinator_scale.py); agents announce on the stream")
    heartbeat_ack_interval_s: float = setting(
        1.0, "answer an agent's heartbeats at most this often (epoch changes are pushed at once)", "s")
    quiet_answer_interval_s: float = setting(
        30.0, "answer a quiet stream (its beacons confirmed and echoed: the echoes say the leader lives, news is "
              "pushed at once) at most this often; its agent gives the stream up after this long more without an "
              "answer (0: answer a quiet stream like any other)", "s")
    beacon_listen: str = setting(
        "", "UDP HOST:PORT of the leader's liveness beacons (docs/architecture.md#failure-detection-timeline); empty: "
            "the listen host, a free port; off: no beacons (agents heartbeat on their streams)")
    beacon_interval_s: float = setting(0.5, "the beacon period agents are told (BeaconTarget.interval_s)", "s")
    domain_label: str = setting(
        "rack", "node label naming the failure domain: spares in the same domain are preferred, buddies (which hold "
                "a node's memory replicas) are chosen in another")
    max_events: int = setting(1000, "event log entries kept in etcd", "events")
    etcd_max_txn_ops: int = setting(128, "etcd's --max-txn-ops; bounds how many nodes one epoch change fences",
                                    "operations")
    spare_health_max_age_s: float = setting(
        60.0, "a spare's health verdict older than this does not count as healthy when promoting", "s")
    require_spare_health: bool = setting(
        False, "promote only spares that reported a healthy verdict (else a spare without one is trusted)")
    handover_margin_s: float = setting(
        5.0, "a planned hand-over is committed at least this long before the notice's deadline", "s")
    handover_max_wait_s: float = setting(
        60.0, "without a deadline, how long a hand-over waits for the job's final checkpoint", "s")
    straggler_action: str = setting(
        "alert", "what a straggler (a node computing much slower than the others) gets: alert (a gauge, an event, "
                 "the FtdStraggler alert) or replace (a planned hand-over of its ranks to a healthy spare)")
    straggler_threshold: float = setting(
        1.5, "a node is slow in a judgement when its median compute time is this many times the other nodes'",
        "ratio")
    straggler_k: int = setting(3, "a straggler: slow in k of its last n judgements (one every 2 s)", "judgements")
    straggler_n: int = setting(5, "the n of straggler_k", "judgements")
    straggler_window_s: float = setting(60.0, "the per-node step timings a judgement looks at", "s")
    straggler_min_samples: int = setting(5, "steps a node needs in the window to be judged", "steps")
    straggler_min_evidence_s: float = setting(10.0, "and the time those steps must span", "s")
    straggler_warmup_s: float = setting(20.0, "steps this soon after a round started are not evidence", "s")
    straggler_min_replace_interval_s: float = setting(
        600.0, "straggler_action=replace: at most one replacement per this long", "s")
    straggler_strong_score: float = setting(
        2.0, "a score below this is marginal: the last healthy spare is never spent on it", "ratio")
    straggler_min_excess_s: float = setting(
        0.01, "and slow only when its median compute is this much longer than the others' (jitter is no straggler)",
        "s")
    anomaly_action: str = setting(
        "alert", "what a step anomaly (NaN/Inf, loss spike, gradient-norm jump) gets: alert (an event, the "
                 "FtdStepAnomaly alert) or rollback (every rank restarts from the newest checkpoint saved before it; "
                 "the later ones are marked suspect)")
    anomaly_max_rollbacks: int = setting(3, "rollbacks per job; the next anomaly closes the job", "rollbacks")
    anomaly_gather_s: float = setting(
        2.0, "after a round's first anomaly, wait this long for the other nodes' reports (a NaN spreads through "
             "the next all-reduce)", "s")
    anomaly_skip_batches: bool = setting(
        False, "a rolled-back job skips the data of the steps up to the anomaly (the Checkpointer moves the data "
               "loader on)")
    fingerprint_confirmations: int = setting(
        2, "replica fingerprint comparisons in a row where the same ranks disagree before a silent data corruption "
           "is acted on (anomaly_action=rollback: their nodes fenced, the job rolled back)", "comparisons")
    job_min_nodes: int = setting(
        1, "a job's round forms only with at least this many nodes (what torchrun --nnodes MIN says; the "
           "coordinator's, not the first joiner's)", "nodes")
    job_max_restarts: int = setting(10, "restart budget of each job: failures (incidents) before it is closed",
                                    "restarts")
    job_on_no_spare: str = setting(
        "shrink", "a node lost and no spare to take its rank: shrink (the job goes on with a smaller world, resharded) "
                  "or wait (until the world is whole again)")
    unmanaged_jobs: bool = setting(
        False, "nodes may commit checkpoints of jobs that did not rendezvous through ftd (no round says who holds "
               "which rank): any registered node commits any rank of them, bound only by the world's epoch. For a "
               "trusted fleet; off, only a round's members commit, each its own ranks (docs/security.md)")
    admitted_nodes: tuple[str, ...] = setting(
        (), "nodes admitted as active by the operator's configuration (ftctl up names its initial nodes); any other "
            "node asking for active registers as a spare until 'ftctl admit NODE'. '*': every node (a trusted "
            "fleet). Without pki_dir there are no identities and every node is admitted (docs/security.md)")
    commit_step_slack: int = setting(
        1000, "a node's shard may be at most this many steps newer than the job's newest reported step or checkpoint "
              "(heartbeats lag the saves); a step beyond is refused (docs/security.md)", "steps")
    etcd_quota_bytes: int = setting(
        2 * 1024**3, "etcd's --quota-backend-bytes (the members' setting): the leader defragments past half of it "
                     "and disarms NOSPACE below 80 % (docs/operations.md#etcd-is-full-nospace)", "bytes")
    rendezvous_budget_bytes: int = setting(
        64 * 1024**2, "live bytes one torchrun etcd-v3 rendezvous run may hold under /torch/elastic/; a run over it "
                      "is deleted by the leader (docs/security.md)", "bytes")
    etcd_compact_every_s: float = setting(30.0, "the leader compacts etcd's history this often (0: only when full)",
                                          "s")
    fenced_node_retention_s: float = setting(
        86400.0, "a fenced node's record is deleted this long after its fence (0: kept for ever)", "s")
    write_rate_per_node_s: float = setting(
        10.0, "writes per second one node may make (Register, CommitShard, RecordCopy, ReportHang, JoinRound); "
              "0: unlimited", "1/s")
    write_burst_per_node: float = setting(60.0, "burst of writes one node may make at once", "writes")
    metrics_listen: str = setting("127.0.0.1:9401", "Prometheus /metrics address HOST:PORT (empty: disabled)")
    ready_file: Path | None = setting(None, "write {pid, address, metrics} JSON here once serving")
    log_level: str = setting("INFO", "log level: DEBUG, INFO, WARNING, ERROR")

    def __post_init__(self) -> None:
        for name in ("listen", "advertise", "metrics_listen"):
            value = getattr(self, name)
            if value:
                try:
                    parse_hostport(value)
                except ValueError as exc:
                    require(False, name, str(exc))
        try:
            parse_endpoints(self.etcd_endpoints)
        except ValueError as exc:
            require(False, "etcd_endpoints", str(exc))
        require(bool(self.cluster) and "/" not in self.cluster, "cluster", "must be non-empty without '/'")
        require(self.pki_dir is None or bool(self.replica_id), "replica_id",
                "must be set with pki_dir: it names this replica's certificate, coordinators/<replica_id>.crt")
        if self.pki_dir is not None and self.replica_id:
            try:
                _ = self.identity
            except PkiError as exc:
                require(False, "replica_id", str(exc))
        require((self.etcd_cert_file is None) == (self.etcd_key_file is None), "etcd_cert_file",
                "give etcd_cert_file and etcd_key_file together, or neither")
        require(self.etcd_cert_file is None or self.etcd_ca_file is not None, "etcd_ca_file",
                "is required with etcd_cert_file (TLS to etcd)")
        require(self.etcd_timeout_s > 0, "etcd_timeout_s", f"must be > 0 (got {self.etcd_timeout_s})")
        require(self.etcd_quota_bytes > 0, "etcd_quota_bytes", f"must be > 0 (got {self.etcd_quota_bytes})")
        require(self.rendezvous_budget_bytes > 0, "rendezvous_budget_bytes",
                f"must be > 0 (got {self.rendezvous_budget_bytes})")
        require(self.etcd_compact_every_s >= 0, "etcd_compact_every_s",
                f"must be >= 0 (got {self.etcd_compact_every_s})")
        require(self.leader_ttl_s >= 2, "leader_ttl_s",
                f"must be >= 2 (etcd's minimum lease TTL), got {self.leader_ttl_s}")
        require(self.suspect_after_s > 0, "suspect_after_s", f"must be > 0 (got {self.suspect_after_s})")
        require(self.dead_after_s > self.suspect_after_s, "dead_after_s",
                f"must be > suspect_after_s ({self.suspect_after_s}), got {self.dead_after_s}")
        require(0 < self.disconnect_dead_after_s <= self.dead_after_s, "disconnect_dead_after_s",
                f"must be in (0, dead_after_s], got {self.disconnect_dead_after_s}")
        require(self.stall_after_s > 0, "stall_after_s", f"must be > 0 (got {self.stall_after_s})")
        require(self.failover_grace_s >= 0, "failover_grace_s", f"must be >= 0 (got {self.failover_grace_s})")
        require(0 <= self.memory_report_deadline_s <= 300, "memory_report_deadline_s",
                f"must be in [0, 300], got {self.memory_report_deadline_s}")
        require(0 < self.tick_s <= self.suspect_after_s / 2, "tick_s",
                f"must be in (0, suspect_after_s/2], got {self.tick_s}")
        require(0 < self.heartbeat_ack_interval_s <= self.dead_after_s, "heartbeat_ack_interval_s",
                f"must be in (0, dead_after_s], got {self.heartbeat_ack_interval_s}")
        quiet_s = self.quiet_answer_interval_s
        require(quiet_s == 0 or self.heartbeat_ack_interval_s <= quiet_s <= 60, "quiet_answer_interval_s",
                f"must be 0 or in [heartbeat_ack_interval_s, 60], got {quiet_s}")
        if self.beacon_listen and self.beacon_listen != "off":
            try:
                parse_hostport(self.beacon_listen)
            except ValueError as exc:
                require(False, "beacon_listen", f"{exc} (or empty, or off)")
        require(0 < self.beacon_interval_s <= self.suspect_after_s / 2, "beacon_interval_s",
                f"must be in (0, suspect_after_s/2], got {self.beacon_interval_s}")
        require(self.max_events >= 10, "max_events", f"must be >= 10 (got {self.max_events})")
        require(self.etcd_max_txn_ops >= 32, "etcd_max_txn_ops", f"must be >= 32 (got {self.etcd_max_txn_ops})")
        require(self.spare_health_max_age_s > 0, "spare_health_max_age_s",
                f"must be > 0 (got {self.spare_health_max_age_s})")
        require(self.job_min_nodes >= 1, "job_min_nodes", f"must be >= 1 (got {self.job_min_nodes})")
        require(self.job_max_restarts >= 0, "job_max_restarts", f"must be >= 0 (got {self.job_max_restarts})")
        require(self.job_on_no_spare in ("shrink", "wait"), "job_on_no_spare",
                f"must be shrink or wait (got {self.job_on_no_spare!r})")
        require(self.commit_step_slack >= 0, "commit_step_slack", f"must be >= 0 (got {self.commit_step_slack})")
        require(self.fenced_node_retention_s >= 0, "fenced_node_retention_s",
                f"must be >= 0 (got {self.fenced_node_retention_s})")
        require(self.write_rate_per_node_s >= 0, "write_rate_per_node_s",
                f"must be >= 0 (got {self.write_rate_per_node_s})")
        require(self.write_burst_per_node >= 1, "write_burst_per_node",
                f"must be >= 1 (got {self.write_burst_per_node})")
        require(self.handover_margin_s >= 0, "handover_margin_s", f"must be >= 0 (got {self.handover_margin_s})")
        require(self.handover_max_wait_s > 0, "handover_max_wait_s",
                f"must be > 0 (got {self.handover_max_wait_s})")
        try:
            self.straggler  # noqa: B018 (validated by constructing it)
        except ValueError as exc:
            require(False, "straggler_*", str(exc))
        try:
            self.mass_silence  # noqa: B018 (validated by constructing it)
        except ValueError as exc:
            require(False, "mass_silence_*", str(exc))
        try:
            self.rollback  # noqa: B018 (validated by constructing it)
        except ValueError as exc:
            require(False, "anomaly_*", str(exc))
        require(self.fingerprint_confirmations >= 1, "fingerprint_confirmations",
                f"must be >= 1 (got {self.fingerprint_confirmations})")
        require(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
                f"unknown level {self.log_level!r}")

    @property
    def max_fences_per_epoch(self) -> int:
        """Each fenced node costs a node put and up to two events; keep headroom for the rest."""
        return (self.etcd_max_txn_ops - 8) // 3

    @property
    def detector(self) -> DetectorSettings:
        return DetectorSettings(self.suspect_after_s, self.dead_after_s, self.disconnect_dead_after_s,
                                self.stall_after_s)

    @property
    def mass_silence(self) -> MassSilence:
        return MassSilence(self.mass_silence_fraction, self.mass_silence_min_nodes, self.mass_silence_hold_s)

    @property
    def straggler(self) -> StragglerConfig:
        return StragglerConfig(self.straggler_threshold, self.straggler_k, self.straggler_n, self.straggler_window_s,
                               self.straggler_min_samples, self.straggler_min_evidence_s, self.straggler_warmup_s,
                               self.straggler_action, self.straggler_min_replace_interval_s,
                               self.straggler_strong_score, self.straggler_min_excess_s)

    @property
    def rollback(self) -> RollbackConfig:
        return RollbackConfig(self.anomaly_action, self.anomaly_max_rollbacks, self.anomaly_gather_s,
                              self.anomaly_skip_batches)

    @property
    def handover(self) -> HandoverPolicy:
        return HandoverPolicy(self.handover_margin_s, self.handover_max_wait_s)

    @property
    def identity(self) -> IdentityFiles | None:
        """This replica's certificate files (``None``: plaintext gRPC)."""
        if self.pki_dir is None:
            return None
        return IdentityFiles(self.pki_dir, "coordinator", self.replica_id)

    @property
    def etcd_tls(self) -> EtcdTls | None:
        """TLS towards etcd (``None``: plaintext)."""
        if self.etcd_ca_file is None:
            return None
        return EtcdTls(self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file)

    @property
    def effective_replica_id(self) -> str:
        import os

        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"
