"""Bounds on everything a request may carry, in one place, with one validator per request type.

Every identifier is checked with ``re.fullmatch`` (``^…$`` with ``re.match`` lets ``"node-0\\n"`` pass
as a second ``node-0``), every string, list and map has a cap, and a request over a cap is refused
with ``INVALID_ARGUMENT`` naming the field and the cap, before anything is looked up or written.
Free text (reasons) is normalised to one line of printable characters before it is stored or logged.
List requests' pages are bounded in :mod:`.paging`, per-node write rates in :mod:`.rate_limits`.

The numbers, and why:

================================  =========  ===================================================
``MAX_ID``                        128        node ids and job ids become etcd keys and directory
                                             names (the layout's identifier rule)
``MAX_HOST``                      253        a DNS name; hosts are names or IP literals only: no
                                             control characters, spaces or markup (``[bold]``)
``MAX_LABELS``                    32         a node needs a handful (rack, zone, instance type)
``MAX_LABEL_KEY`` / ``_VALUE``    63 / 253   Kubernetes' key length; a DNS name for a value
``MAX_LABEL_BYTES``               4 KiB      all labels of one node together
``MAX_INCARNATION``               64         agents send 32 hex digits
``MAX_REASON``                    1024       reasons are one line for people; 200 KB is an attack
``MAX_HEALTH_BYTES``              16 KiB     a real verdict with every check is about 2 KiB
``MAX_HEALTH_ITEMS``              64         disks, checks, GPUs of one node
``MAX_MANIFEST_FILES``            4096       one rank's shard (torch: 1 file, dcp: a few)
``MAX_EVENT_MESSAGE``             2048       one event log line (etcd value)
``MAX_REQUEST_BYTES``             1 MiB      server receive limit: the largest legitimate request
                                             (a 4096-file manifest) is about 400 KiB
``MAX_RESPONSE_BYTES``            16 MiB     server send / client receive limit: one
                                             ``CheckpointInfo`` of a very large world
================================  =========  ===================================================
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping

from ftd import rpc
from ftd.checkpoints.layout import MAX_RANK
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2

from . import errors, model

MAX_ID = 128
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_HOST = 253
HOST_RE = re.compile(r"[A-Za-z0-9:][A-Za-z0-9._:%-]{0,252}")
MAX_LABELS = 32
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 253
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")
LABEL_VALUE_RE = re.compile(r"[A-Za-z0-9._:/@+=-]{0,253}")
MAX_LABEL_BYTES = 4096
MAX_INCARNATION = 64
INCARNATION_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_ADDRESS = 300
_V6_ADDRESS = re.compile(r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]:[0-9]{1,5}")
MAX_REASON = 1024
MAX_HEALTH_BYTES = 16 * 1024
MAX_HEALTH_ITEMS = 64
MAX_MANIFEST_FILES = 4096
MAX_REQUEST_BYTES = 1024 * 1024
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
MAX_JOBS = 64  # job records (rendezvous) a cluster keeps; a new job name beyond this is refused
MAX_CATALOG_JOBS = 256  # distinct jobs in the checkpoint catalog
MAX_FINGERPRINTS = 256  # replica fingerprints in one heartbeat (one per local rank)
MAX_RANKS = MAX_RANK + 1  # the world size a fingerprint may name (the checkpoint layout's bound)
SHARED_LOCATIONS = ("shared", "s3")
MAX_EVENT_MESSAGE = model.MAX_EVENT_MESSAGE  # kept with the event record, which clips to it

# gRPC options for the size limits (reported to the owners of coordinator/main.py and ftd/rpc.py).
SERVER_SIZE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
]
CLIENT_SIZE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
]


# ---- field checks -----------------------------------------------------------------------------------


def shown(value: str, limit: int = 80) -> str:
    """A value for an error message: cut, and ``repr`` so control characters are visible."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def valid_id(value: str) -> bool:
    """A node id or job id: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``, not ``.``/``..``, whole string."""
    return ID_RE.fullmatch(value) is not None and value not in (".", "..")


def check_id(field: str, value: str) -> str:
    if not value:
        raise errors.InvalidArgument(field, "is required")
    if not valid_id(value):
        raise errors.InvalidArgument(field, f"{shown(value)} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
    return value


def check_host(field: str, value: str) -> str:
    if not value or len(value) > MAX_HOST or HOST_RE.fullmatch(value) is None:
        raise errors.InvalidArgument(
            field, f"{shown(value)} is not a host name or IP address (letters, digits, '.', '-', ':', "
                   f"at most {MAX_HOST} characters)")
    return value


def check_address(field: str, value: str, required: bool = True) -> str:
    """``HOST:PORT`` with a host as :func:`check_host` allows (brackets around IPv6 allowed)."""
    if not value and not required:
        return value
    if len(value) > MAX_ADDRESS:
        raise errors.InvalidArgument(field, f"longer than {MAX_ADDRESS} characters")
    try:
        host, port = rpc.parse_hostport(value, field)
    except ValueError:
        host, port = "", 0
    bracketed = value.startswith("[")
    brackets_ok = _V6_ADDRESS.fullmatch(value) is not None if bracketed else "[" not in value and "]" not in value
    if port == 0 or not host or HOST_RE.fullmatch(host) is None or not brackets_ok:
        raise errors.InvalidArgument(field, f"{shown(value)} is not HOST:PORT")
    return value


def check_text(field: str, value: str, limit: int = MAX_REASON) -> str:
    """Free text (a reason): refused above ``limit`` characters, else returned as one printable line."""
    if len(value) > limit:
        raise errors.InvalidArgument(field, f"is {len(value)} characters long; at most {limit}")
    return one_line(value)


def one_line(text: str) -> str:
    """Control and format characters (newlines, escapes, bidi overrides) become spaces; runs of
    whitespace collapse to one."""
    cleaned = "".join(" " if unicodedata.category(c)[0] in "CZ" else c for c in text)
    return " ".join(cleaned.split())


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_labels(field: str, labels: Mapping[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise errors.InvalidArgument(field, f"{len(labels)} labels; at most {MAX_LABELS}")
    total = 0
    for key, value in labels.items():
        if LABEL_KEY_RE.fullmatch(key) is None:
            raise errors.InvalidArgument(field, f"label key {shown(key)} is not a valid label name "
                                                f"([A-Za-z0-9][A-Za-z0-9._/-]{{0,{MAX_LABEL_KEY - 1}}})")
        if LABEL_VALUE_RE.fullmatch(value) is None:
            raise errors.InvalidArgument(field, f"label {key!r} value {shown(value)} must match "
                                                f"[A-Za-z0-9._:/@+=-]{{0,{MAX_LABEL_VALUE}}}")
        total += len(key) + len(value)
    if total > MAX_LABEL_BYTES:
        raise errors.InvalidArgument(field, f"labels take {total} bytes; at most {MAX_LABEL_BYTES}")


def check_incarnation(field: str, value: str) -> str:
    if INCARNATION_RE.fullmatch(value) is None:
        raise errors.InvalidArgument(field, f"is required: [A-Za-z0-9._:-]{{1,{MAX_INCARNATION}}}, "
                                            f"got {shown(value)}")
    return value


def check_health(field: str, health: cluster_pb2.Health) -> None:
    size = health.ByteSize()
    if size > MAX_HEALTH_BYTES:
        raise errors.InvalidArgument(field, f"is {size} bytes; at most {MAX_HEALTH_BYTES}")
    counts = {"disks": len(health.disks), "gpu.utilization_pct": len(health.gpu.utilization_pct),
              "gpu.memory_used_bytes": len(health.gpu.memory_used_bytes),
              "verdict.checks": len(health.verdict.checks)}
    for name, count in counts.items():
        if count > MAX_HEALTH_ITEMS:
            raise errors.InvalidArgument(f"{field}.{name}", f"{count} entries; at most {MAX_HEALTH_ITEMS}")


def check_location(field: str, value: str) -> str:
    """Where a shard copy lives: a node id (node-local tiers) or ``shared``/``s3``."""
    if value in SHARED_LOCATIONS or valid_id(value):
        return value
    raise errors.InvalidArgument(field, f"{shown(value)} is not a node id, 'shared' or 's3'")


# ---- one validator per request type ------------------------------------------------------------------


def validate_register(req: coordinator_pb2.RegisterRequest) -> None:
    """Raises :class:`~.errors.InvalidArgument` naming the first malformed field."""
    check_id("node_id", req.node_id)
    check_host("host", req.host)
    if req.role not in (cluster_pb2.ROLE_ACTIVE, cluster_pb2.ROLE_SPARE):
        raise errors.InvalidArgument("role", f"must be ROLE_ACTIVE or ROLE_SPARE, got {req.role}")
    check_labels("labels", req.labels)
    check_address("agent_address", req.agent_address, required=False)
    if req.pid < 0 or req.pid > 2**31:
        raise errors.InvalidArgument("pid", f"must be in [0, 2^31], got {req.pid}")
    check_incarnation("incarnation", req.incarnation)


def validate_heartbeat(req: coordinator_pb2.HeartbeatRequest) -> None:
    """The first heartbeat of a stream; the next ones need only :func:`validate_heartbeat_payload`
    (the stream checks that ids do not change)."""
    check_id("node_id", req.node_id)
    check_incarnation("incarnation", req.incarnation)
    validate_heartbeat_payload(req)


def validate_heartbeat_payload(req: coordinator_pb2.HeartbeatRequest) -> None:
    if req.HasField("health"):
        check_health("health", req.health)
    if req.HasField("progress") and not all(math.isfinite(v) for v in (
            req.progress.reported_unix_s, req.progress.loss, req.progress.grad_norm, req.progress.flops,
            req.progress.restored.at_unix_s)):
        raise errors.InvalidArgument("progress", "times and figures must be finite numbers")
    if req.HasField("progress") and req.progress.HasField("restored"):
        check_text("progress.restored.source", req.progress.restored.source)
    if req.HasField("progress") and req.progress.HasField("timing"):
        t = req.progress.timing
        if not all(math.isfinite(v) and 0 <= v < 1e6 for v in (t.compute_s, t.wall_s, t.data_s)):
            raise errors.InvalidArgument("progress.timing", "step times must be finite seconds in [0, 1e6)")
    if req.HasField("progress") and req.progress.HasField("anomaly"):
        check_text("progress.anomaly.reason", req.progress.anomaly.reason)
        check_text("progress.anomaly.kind", req.progress.anomaly.kind)
    if req.HasField("progress") and req.progress.fingerprints:
        marks = req.progress.fingerprints
        if len(marks) > MAX_FINGERPRINTS:
            raise errors.InvalidArgument("progress.fingerprints", f"{len(marks)} fingerprints; at most "
                                                                  f"{MAX_FINGERPRINTS} (one per local rank)")
        for i, m in enumerate(marks):
            if not (0 <= m.rank < max(m.world_size, 1) <= MAX_RANKS and m.step >= 0):
                raise errors.InvalidArgument(f"progress.fingerprints[{i}]", f"rank {m.rank} of world size "
                                             f"{m.world_size} at step {m.step}: needs 0 <= rank < world_size <= "
                                             f"{MAX_RANKS} and step >= 0")


def validate_commit_shard(req: checkpoint_pb2.CommitShardRequest) -> None:
    if len(req.manifest.files) > MAX_MANIFEST_FILES:
        raise errors.InvalidArgument("manifest.files", f"{len(req.manifest.files)} files; at most {MAX_MANIFEST_FILES}")
    check_location("location", req.location)


def validate_record_copy(req: checkpoint_pb2.RecordCopyRequest) -> None:
    check_location("location", req.location)
    check_text("corrupt_reason", req.corrupt_reason)


def validate_invalidate(req: checkpoint_pb2.InvalidateCheckpointRequest) -> None:
    check_text("reason", req.reason)


def validate_join_round(req: coordinator_pb2.JoinRoundRequest) -> None:
    check_id("node_id", req.node_id)


def validate_set_round_store(req: coordinator_pb2.SetRoundStoreRequest) -> None:
    check_id("node_id", req.node_id)
    check_address("address", req.address)


def validate_close_job(req: coordinator_pb2.CloseJobRequest) -> None:
    check_text("reason", req.reason)


def validate_report_hang(req: coordinator_pb2.ReportHangRequest) -> None:
    check_id("node_id", req.node_id)
    check_text("reason", req.reason)


def validate_drain(req: coordinator_pb2.DrainRequest) -> None:
    check_id("node_id", req.node_id)
    check_text("reason", req.reason)
    if not math.isfinite(req.deadline_unix_s) or req.deadline_unix_s < 0:
        raise errors.InvalidArgument("deadline_unix_s", f"must be a time >= 0, got {req.deadline_unix_s}")
