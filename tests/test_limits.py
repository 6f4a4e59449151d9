"""Bounded inputs (issue 11 item 5) as pure checks: whole-string identifiers, caps on every string,
label count and health payload, pages, the per-node write rate limit, and the garbage
collection rule for fenced node records."""

from __future__ import annotations

import grpc
import pytest

from ftd.checkpoints.layout import BadIdentifier, check_file_name, check_job, parse_shard_key
from ftd.coordinator import errors, paging, rate_limits, validation
from ftd.coordinator.model import Event, Fence, NodeRecord, Role, World, clip_event
from ftd.coordinator.placement import collectable
from ftd.node_ids import valid_node_id
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2


def reg(**kw: object) -> coordinator_pb2.RegisterRequest:
    base: dict[str, object] = dict(node_id="node-0", host="10.0.0.1", role=cluster_pb2.ROLE_ACTIVE,
                                   agent_address="10.0.0.1:7500", pid=42, incarnation="0123abcd")
    base.update(kw)
    return coordinator_pb2.RegisterRequest(**base)  # type: ignore[arg-type]


def refused(fn: object, *args: object) -> errors.InvalidArgument:
    with pytest.raises(errors.InvalidArgument) as err:
        fn(*args)  # type: ignore[operator]
    assert errors.grpc_code(err.value) is grpc.StatusCode.INVALID_ARGUMENT
    return err.value


@pytest.mark.parametrize("bad", ["node-0\n", "node-0\r\n", "\nnode-0", "node 0", "node-0\x00", "../x", ".", "..",
                                 "n" * 129, "", "nöde", "node-٣"])
def test_identifiers_are_whole_strings(bad: str) -> None:
    assert not valid_node_id(bad) and not validation.valid_id(bad)
    with pytest.raises(BadIdentifier):
        check_job(bad)
    assert refused(validation.validate_register, reg(node_id=bad)).field == "node_id"


def test_a_trailing_newline_is_not_a_second_node_0_nor_a_shard_folder() -> None:
    assert valid_node_id("node-0") and not valid_node_id("node-0\n")
    assert parse_shard_key("job/step-000000000001/rank-00000") == ("job", 1, 0)
    assert parse_shard_key("job/step-000000000001\n/rank-00000") is None
    assert parse_shard_key("job\n/step-000000000001/rank-00000") is None
    with pytest.raises(BadIdentifier):
        check_file_name("state.pt\n")


@pytest.mark.parametrize("host", ["node\x1b[31m", "[bold red]evil[/]", "a b", "h\n", "h\t", "", "h" * 254, "a/b",
                                  "h\u202e"])
def test_host_is_a_name_or_an_address_only(host: str) -> None:
    assert refused(validation.validate_register, reg(host=host)).field == "host"


@pytest.mark.parametrize("host", ["10.0.0.1", "::1", "fe80::1%eth0", "node-7.example.com", "gpu_node-3"])
def test_hosts_that_are_names_or_addresses_pass(host: str) -> None:
    validation.validate_register(reg(host=host))


def test_labels_are_capped_in_count_key_value_and_bytes() -> None:
    validation.validate_register(reg(labels={"rack": "r1", "topology.kubernetes.io/zone": "us-east-1a"}))
    flood = {f"k{i}": "v" * 253 for i in range(5000)}
    err = refused(validation.validate_register, reg(labels=flood))
    assert err.field == "labels" and "at most 32" in str(err)
    assert refused(validation.validate_register, reg(labels={"rack": "[red]x"})).field == "labels"
    assert refused(validation.validate_register, reg(labels={"rack\n": "x"})).field == "labels"
    assert refused(validation.validate_register, reg(labels={"k": "v" * 254})).field == "labels"
    big = {f"k{i:02d}" + "x" * 58: "v" * 100 for i in range(30)}  # 30 labels, 4.8 KB together
    assert "bytes" in str(refused(validation.validate_register, reg(labels=big)))


@pytest.mark.parametrize(("field", "change"), [
    ("incarnation", {"incarnation": ""}), ("incarnation", {"incarnation": "x" * 65}),
    ("incarnation", {"incarnation": "a\nb"}), ("pid", {"pid": -1}), ("agent_address", {"agent_address": "x"}),
    ("agent_address", {"agent_address": "[bold]:9"}), ("role", {"role": 7}),
])
def test_every_register_field_is_bounded(field: str, change: dict[str, object]) -> None:
    assert refused(validation.validate_register, reg(**change)).field == field


def test_health_payloads_are_capped() -> None:
    ok = cluster_pb2.Health(disks=[cluster_pb2.DiskHealth(tier="ssd", path="/ssd", free_bytes=1, total_bytes=2)])
    validation.validate_heartbeat(coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i", health=ok))
    huge = cluster_pb2.Health(verdict=cluster_pb2.HealthVerdict(reason="x" * 3_000_000))
    err = refused(validation.validate_heartbeat, coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i",
                                                                             health=huge))
    assert err.field == "health" and "16384" in str(err)
    many = cluster_pb2.Health(disks=[cluster_pb2.DiskHealth(tier="t")] * 65)
    assert refused(validation.validate_heartbeat_payload,
                   coordinator_pb2.HeartbeatRequest(health=many)).field == "health.disks"
    nan = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i",
                                           progress=cluster_pb2.Progress(step=1, reported_unix_s=float("nan")))
    assert refused(validation.validate_heartbeat, nan).field == "progress"
    # The straggler watch's and the anomaly log's inputs: finite, bounded step times and short texts.
    for bad in (float("nan"), -1.0, 1e9):
        timing = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i", progress=cluster_pb2.Progress(
            step=1, timing=cluster_pb2.StepTiming(compute_s=bad)))
        assert refused(validation.validate_heartbeat, timing).field == "progress.timing"
    long_reason = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i", progress=cluster_pb2.Progress(
        step=1, anomaly=cluster_pb2.StepAnomaly(kind="nan", reason="x" * 5000)))
    assert refused(validation.validate_heartbeat, long_reason).field == "progress.anomaly.reason"


def test_reasons_are_capped_and_made_one_printable_line() -> None:
    err = refused(validation.validate_drain, coordinator_pb2.DrainRequest(node_id="a", reason="x" * 200_000))
    assert err.field == "reason" and "200000 characters" in str(err)
    assert validation.check_text("reason", "disk\nfull\x1b[31m \u202eok\t") == "disk full [31m ok"
    assert refused(validation.validate_record_copy, checkpoint_pb2.RecordCopyRequest(
        location="node-0", corrupt_reason="y" * 1025)).field == "corrupt_reason"
    assert refused(validation.validate_drain, coordinator_pb2.DrainRequest(
        node_id="a", deadline_unix_s=float("inf"))).field == "deadline_unix_s"


@pytest.mark.parametrize("location", ["", "../x", "a/b", "node-0\n", "s3 ", "x" * 129])
def test_copy_locations_are_node_ids_or_shared_ones(location: str) -> None:
    assert refused(validation.validate_record_copy,
                   checkpoint_pb2.RecordCopyRequest(location=location)).field == "location"
    assert refused(validation.validate_commit_shard,
                   checkpoint_pb2.CommitShardRequest(location=location)).field == "location"


def test_manifest_file_count_is_capped() -> None:
    files = [checkpoint_pb2.ShardFile(name=f"f{i}", size=1, crc32c="00000000") for i in range(4097)]
    req = checkpoint_pb2.CommitShardRequest(location="node-0", manifest=checkpoint_pb2.ShardManifest(files=files))
    assert refused(validation.validate_commit_shard, req).field == "manifest.files"


def test_events_are_clipped() -> None:
    event = clip_event(Event(1, 0.0, "k", "m" * 10_000))
    assert len(event.message) == validation.MAX_EVENT_MESSAGE and event.message.endswith("...")


def test_pages() -> None:
    assert paging.page(0, "") == paging.Page(paging.DEFAULT_PAGE_SIZE, "")
    assert refused(paging.page, paging.MAX_PAGE_SIZE + 1, "").field == "page_size"
    assert refused(paging.page, 10, "a\nb").field == "page_token"
    items, more = paging.take_page(iter(range(10)), 3, lambda _: 1)
    assert items == [0, 1, 2] and more
    items, more = paging.take_page(iter(["a" * 100, "b" * 100, "c"]), 10, len, max_bytes=150)
    assert items == ["a" * 100] and more
    items, more = paging.take_page(iter(["x" * 500]), 10, len, max_bytes=150)
    assert items == ["x" * 500] and not more, "the first item always fits"


def test_write_limiter_is_a_token_bucket_per_method_and_node() -> None:
    now = [0.0]
    limited: list[str] = []
    limiter = rate_limits.WriteLimiter(rate=2.0, burst=3.0, clock=lambda: now[0], on_limited=limited.append)
    for _ in range(3):
        limiter.check("Register", "a")
    with pytest.raises(errors.RateLimited) as err:
        limiter.check("Register", "a")
    assert errors.grpc_code(err.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Register from 'a'" in str(err.value) and "retry in 0.5s" in str(err.value)
    assert limited == ["Register"]
    limiter.check("Register", "b")  # another node has its own bucket
    limiter.check("JoinRound", "a")  # and another method
    now[0] += 0.5
    limiter.check("Register", "a")  # one token back after 1/rate seconds
    with pytest.raises(errors.RateLimited):
        limiter.check("Register", "a")


def test_write_limiter_keeps_a_bounded_number_of_buckets() -> None:
    limiter = rate_limits.WriteLimiter(rate=1.0, burst=1.0, clock=lambda: 0.0, max_buckets=100)
    for i in range(1000):
        limiter.check("Register", f"n{i}")
    assert len(limiter._buckets) == 100


def test_shared_locations_are_limited_per_rank() -> None:
    assert rate_limits.shard_writer("node-3", 7) == "node-3"
    assert rate_limits.shard_writer("s3", 7) == "s3/rank-7" != rate_limits.shard_writer("s3", 8)


def node(node_id: str, fenced_at: float | None) -> NodeRecord:
    fence = Fence(3, "dead", fenced_at) if fenced_at is not None else None
    return NodeRecord(node_id, "h", Role.SPARE, fence=fence)


def test_fenced_nodes_are_collected_after_the_retention_oldest_first() -> None:
    nodes = {n.node_id: n for n in [node("old", 100.0), node("older", 50.0), node("new", 950.0),
                                    node("alive", None), node("ranked", 10.0), node("kept", 10.0)]}
    world = World(epoch=4, ranks=("ranked",))
    assert collectable(1000.0, world, nodes, 500.0, keep={"kept"}) == ["older", "old"]
    assert collectable(1000.0, world, nodes, 500.0, keep={"kept"}, limit=1) == ["older"]
    assert collectable(1000.0, world, nodes, 5000.0) == []
