"""The attack list of issue 11 (items 5, 6 and 4's corrupt record) as regression tests.

* On real processes (``ftctl up``: etcd, a coordinator, agents, mutual TLS): a compromised node acts
  with its own certificate, as the threat model allows (docs/security.md), and floods what it may send.
* In process, where the real service does not pass the field yet (``GetRestoreTarget.world_size``) or
  the transport's authorization would stop the request before the validator under test.
* The ``dcp`` restore path never unpickles unverified data.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ftd.client import CoordinatorClient
from ftd.coordinator import catalog, errors, validation
from ftd.coordinator.control import Controller
from ftd.coordinator.settings import CoordinatorSettings
from ftd.coordinator.store import MemoryStore
from ftd.etcd_client import make_client
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.storage_backends.base import crc32c_file
from ftd.training import dcp_io
from ftd.training import restore as training_restore
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2

# ---- real processes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    # Its tests commit shards of jobs that never rendezvous (the catalog's own checks under attack):
    # unmanaged_jobs lets them; tests/test_insider_catalog.py attacks a cluster without it.
    started = up(tmp_path_factory.mktemp("attacks") / "cluster", nodes=2, spares=1, unmanaged_jobs=True)
    try:
        yield started
    finally:
        stop(started)


def as_node(cluster: ClusterFile, node_id: str) -> CoordinatorClient:
    """A client holding ``node_id``'s own certificate: what a compromised node can do."""
    return CoordinatorClient(cluster.coordinator_endpoints, timeout_s=10.0, tls=cluster.identity("node", node_id))


def refused(fn: Any, *args: Any, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    return err.value


def code(err: grpc.RpcError) -> grpc.StatusCode:
    return err.code()  # type: ignore[attr-defined,no-any-return]


def details(err: grpc.RpcError) -> str:
    return err.details() or ""  # type: ignore[attr-defined,no-any-return]


def registered(cluster: ClusterFile) -> dict[str, coordinator_pb2.NodeInfo]:
    client = cluster.client()
    try:
        return {n.node_id: n for n in client.nodes().nodes}
    finally:
        client.close()


def scrape(cluster: ClusterFile) -> str:
    with urllib.request.urlopen(f"http://{cluster.coordinators[0].info['metrics']}/metrics", timeout=5) as resp:
        return resp.read().decode()


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_a_label_flood_is_refused_and_listing_nodes_keeps_working(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    before = registered(cluster)["node-0"]
    flood = {f"k{i:04d}": "v" * 250 for i in range(5000)}  # 1.3 MB of labels
    err = refused(node0.register, coordinator_pb2.RegisterRequest(
        node_id="node-0", host="127.0.0.1", role=cluster_pb2.ROLE_ACTIVE, labels=flood, incarnation="evil"))
    assert code(err) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), details(err)
    assert code(err) is grpc.StatusCode.RESOURCE_EXHAUSTED or "labels: 5000 labels; at most 32" in details(err)
    after = registered(cluster)["node-0"]
    assert after.labels == before.labels and after.state == before.state
    node0.close()


def test_control_characters_and_markup_in_host_are_refused(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    for host in ("evil\x1b[31mhost", "[bold red]pwned[/]", "h\nFAKE LOG LINE"):
        err = refused(node0.register, coordinator_pb2.RegisterRequest(
            node_id="node-0", host=host, role=cluster_pb2.ROLE_ACTIVE, incarnation="evil"))
        assert code(err) is grpc.StatusCode.INVALID_ARGUMENT and details(err).startswith("host:"), details(err)
    assert registered(cluster)["node-0"].host == "127.0.0.1"
    node0.close()


def test_node_0_with_a_newline_is_not_a_second_node_0(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    err = refused(node0.register, coordinator_pb2.RegisterRequest(
        node_id="node-0\n", host="127.0.0.1", role=cluster_pb2.ROLE_ACTIVE, incarnation="evil"))
    # The authorization table stops it first (node-0 may act only as "node-0"); the validator also does.
    assert code(err) in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), details(err)
    assert sorted(registered(cluster)) == ["node-0", "node-1", "node-2"]
    node0.close()


def test_a_200_kb_reason_is_refused(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    err = refused(node0.call, "Drain", coordinator_pb2.DrainRequest(node_id="node-0", reason="x" * 200_000),
                  idempotent=False)
    assert code(err) is grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in details(err), details(err)
    status = cluster.client().status()
    assert not status.draining
    node0.close()


def test_a_3_mb_health_payload_is_refused_and_ftctl_nodes_still_fits(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    health = cluster_pb2.Health(verdict=cluster_pb2.HealthVerdict(healthy=True, reason="x" * 3_000_000))
    stream = node0.heartbeat_stream(iter([coordinator_pb2.HeartbeatRequest(
        node_id="node-0", incarnation="whatever", health=health, seq=1)]))
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert code(err.value) in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    listed = cluster.client().nodes()
    assert listed.ByteSize() < 64 * 1024 and {n.node_id for n in listed.nodes} == {"node-0", "node-1", "node-2"}
    node0.close()


def test_invalidation_cannot_send_the_job_back_to_scratch(cluster: ClusterFile) -> None:
    for rank, node_id in enumerate(("node-0", "node-1")):
        client = as_node(cluster, node_id)
        client.call("CommitShard", checkpoint_pb2.CommitShardRequest(
            tier="ssd", location=node_id, manifest=checkpoint_pb2.ShardManifest(
                job="trust", step=100, epoch=1, rank=rank, world_size=2, format="torch",
                files=[checkpoint_pb2.ShardFile(name="state.pt", size=4, crc32c="0a0b0c0d")])), idempotent=False)
        client.close()
    node0 = as_node(cluster, "node-0")
    err = refused(node0.call, "InvalidateCheckpoint", checkpoint_pb2.InvalidateCheckpointRequest(
        job="trust", step=100, reason="x"), idempotent=False)
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED, "operators only"
    operator = cluster.client()
    err = refused(operator.call, "InvalidateCheckpoint", checkpoint_pb2.InvalidateCheckpointRequest(
        job="trust", step=100, reason="x"), idempotent=False)
    assert code(err) is grpc.StatusCode.FAILED_PRECONDITION and "last restorable" in details(err)
    target = operator.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job="trust"), idempotent=True)
    assert target.found and target.checkpoint.step == 100
    operator.close()
    node0.close()


def test_metric_labels_stay_bounded_under_a_flood_of_job_names(cluster: ClusterFile) -> None:
    node0 = as_node(cluster, "node-0")
    outcomes: dict[str, int] = {}
    for i in range(150):  # a new job name per call: each used to be a new series
        try:
            node0.call("CommitShard", checkpoint_pb2.CommitShardRequest(
                tier="ssd", location="node-0", manifest=checkpoint_pb2.ShardManifest(
                    job=f"flood-{i}", step=1, epoch=1, rank=0, world_size=1, format="torch",
                    files=[checkpoint_pb2.ShardFile(name="state.pt", size=4, crc32c="0a0b0c0d")])),
                idempotent=False)
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as exc:
            assert code(exc) is grpc.StatusCode.RESOURCE_EXHAUSTED, details(exc)
            outcomes[code(exc).name] = outcomes.get(code(exc).name, 0) + 1
    assert outcomes.get("RESOURCE_EXHAUSTED", 0) > 0, f"the per-node write limit never applied: {outcomes}"
    text = scrape(cluster)
    assert len(series(text, "ftd_coordinator_checkpoint_last_valid_step")) <= catalog.MAX_JOB_SERIES
    limited = [s for s in series(text, "ftd_coordinator_rate_limited_total") if 'method="CommitShard"' in s]
    assert limited and float(limited[0].rsplit(" ", 1)[1]) >= outcomes["RESOURCE_EXHAUSTED"]
    # Every label value of the coordinator's metrics comes from a fixed set or a bounded one.
    assert len([line for line in text.splitlines() if "{" in line and not line.startswith("#")]) < 400
    node0.close()


# ---- a corrupt record never stops a real leader ----------------------------------------------------------


def test_a_corrupt_node_record_does_not_stop_a_real_coordinator(tmp_path: Path) -> None:
    """``nodes/zzz = "not json"`` in etcd: the coordinator process leads and answers, lists the record
    in ``ftctl status`` (ClusterStatus.problems) and in ftd_coordinator_corrupt_records."""
    etcd = EtcdCluster(tmp_path / "etcd", size=1, fast=True).start()
    raw = make_client(etcd.endpoints)
    raw.put("/ftd/default/nodes/zzz", b"not json")
    ready = tmp_path / "ready.json"
    with open(tmp_path / "coordinator.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ftd.coordinator.main", "--etcd-endpoints", etcd.endpoints,
                                 "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--replica-id", "c0",
                                 "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "FTD_COORDINATOR_FAILOVER_GRACE_S": "0.5"})
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        client = CoordinatorClient(info["address"], timeout_s=2.0)
        status = client.status(deadline_s=10.0)  # answered by the leader, not UNAVAILABLE
        assert any("nodes/zzz" in p for p in status.problems), list(status.problems)
        with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert "ftd_coordinator_corrupt_records 1.0" in text
        assert 'ftd_coordinator_etcd_alarm{alarm="nospace"} 0.0' in text
        events = client.events(limit=20)
        assert any(e.kind == "corrupt_record" and "nodes/zzz" in e.message for e in events.events)
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
        raw.close()
        etcd.stop()


# ---- in process: the validators behind the transport, and restore trust ----------------------------------


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def leader() -> tuple[Controller, MemoryStore]:
    async def start() -> tuple[Controller, MemoryStore]:
        clock = Clock()
        store = MemoryStore(clock=clock)
        ctl = Controller(store, CoordinatorSettings(replica_id="c0", failover_grace_s=0.0), "127.0.0.1:1",
                         clock=clock, wall=lambda: 1.7e9 + clock.now)
        await ctl.leadership_step()
        for node_id in ("node-0", "node-1"):
            await ctl.membership.register(coordinator_pb2.RegisterRequest(
                node_id=node_id, host="10.0.0.1", role=cluster_pb2.ROLE_ACTIVE, incarnation="i1"))
        return ctl, store
    return asyncio.run(start())


def test_validators_refuse_what_authorization_lets_through() -> None:
    ctl, store = leader()
    before = dict(store.nodes)

    async def attempts() -> None:
        with pytest.raises(errors.InvalidArgument, match="node_id"):
            await ctl.membership.register(coordinator_pb2.RegisterRequest(
                node_id="node-0\n", host="10.0.0.1", role=cluster_pb2.ROLE_ACTIVE, incarnation="i2"))
        big = "r" * 200_000
        with pytest.raises(errors.InvalidArgument, match="reason"):
            await ctl.jobs.report_hang(coordinator_pb2.ReportHangRequest(job="j", node_id="node-0", reason=big))
        with pytest.raises(errors.InvalidArgument, match="reason"):
            await ctl.jobs.close(coordinator_pb2.CloseJobRequest(job="j", reason=big))
        with pytest.raises(errors.InvalidArgument, match="corrupt_reason"):
            await ctl.catalog.record_copy(checkpoint_pb2.RecordCopyRequest(
                job="j", step=1, rank=0, tier="ssd", location="node-0", present=True, corrupt_reason=big))
        with pytest.raises(errors.InvalidArgument, match="location"):
            await ctl.catalog.record_copy(checkpoint_pb2.RecordCopyRequest(
                job="j", step=1, rank=0, tier="ssd", location="../../etc", present=True))

    asyncio.run(attempts())
    assert dict(store.nodes) == before and list(before) == ["node-0", "node-1"]


def test_a_shard_of_another_world_size_never_breaks_the_restore() -> None:
    ctl, _ = leader()

    def commit(step: int, rank: int, world: int, location: str) -> None:
        asyncio.run(ctl.catalog.commit_shard(checkpoint_pb2.CommitShardRequest(
            tier="ssd", location=location, manifest=checkpoint_pb2.ShardManifest(
                job="train", step=step, epoch=1, rank=rank, world_size=world, format="torch",
                files=[checkpoint_pb2.ShardFile(name="state.pt", size=4, crc32c="0a0b0c0d")]))))

    commit(100, 0, 2, "node-0")
    commit(100, 1, 2, "node-1")
    with pytest.raises(errors.CatalogConflict):  # the same step with another world size: refused
        commit(100, 1, 3, "node-1")
    commit(200, 0, 1, "node-0")  # a newer step that claims a world of one: valid by itself
    target = ctl.catalog.restore_target("train", world_size=2)
    assert target.found and target.checkpoint.step == 100 and "skipped step 200 (world size 1)" in target.reason
    assert all(r in {s.rank for s in target.checkpoint.shards} for r in range(2)), "every rank has its shard"


# ---- dcp restore: nothing unverified is unpickled --------------------------------------------------------


class Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/ftd-pwned",))


def dcp_shard(tmp_path: Path) -> tuple[Path, dict[str, tuple[int, str]]]:
    from torch.distributed.checkpoint import state_dict_saver

    folder = tmp_path / "shard"
    state_dict_saver.save({"model": {"w": torch.arange(6, dtype=torch.float32)}, "step": 7},
                          checkpoint_id=str(folder), no_dist=True)
    return folder, {p.name: (p.stat().st_size, crc32c_file(p)) for p in folder.iterdir()}


def test_a_verified_dcp_shard_loads(tmp_path: Path) -> None:
    folder, expected = dcp_shard(tmp_path)
    template: dict[str, Any] = {"model": {"w": torch.zeros(6)}, "step": 0}
    dcp_io.load_dcp(folder, expected, template, weights_only=True)
    assert torch.equal(template["model"]["w"], torch.arange(6, dtype=torch.float32)) and template["step"] == 7


def test_a_crafted_dcp_metadata_is_never_unpickled(tmp_path: Path) -> None:
    folder, _ = dcp_shard(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Boom()))
    expected = {p.name: (p.stat().st_size, crc32c_file(p)) for p in folder.iterdir()}  # a lying node's manifest
    with pytest.raises(ValueError, match=r"refusing to unpickle (posix|os)\.system"):
        dcp_io.load_dcp(folder, expected, {"model": {"w": torch.zeros(6)}}, weights_only=True)
    assert not Path("/tmp/ftd-pwned").exists()


def test_dcp_metadata_outside_the_manifest_or_pointing_outside_is_refused(tmp_path: Path) -> None:
    folder, expected = dcp_shard(tmp_path)
    unlisted = {k: v for k, v in expected.items() if k != ".metadata"}
    with pytest.raises(ValueError, match=r"does not list \.metadata"):
        dcp_io.load_dcp(folder, unlisted, {"model": {"w": torch.zeros(6)}}, weights_only=False)
    data = [k for k in expected if k.endswith(".distcp")]
    no_data = {k: v for k, v in expected.items() if k not in data}
    with pytest.raises(ValueError, match="not a verified file of this shard"):
        dcp_io.load_dcp(folder, no_data, {"model": {"w": torch.zeros(6)}}, weights_only=True)


def test_the_dcp_path_verifies_checksums_before_reading_anything(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    folder, expected = dcp_shard(tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(Boom()))  # swapped after the manifest was recorded
    reads: list[Path] = []
    monkeypatch.setattr(dcp_io, "safe_metadata", reads.append)
    with pytest.raises(ValueError, match=r"crc32c|bytes"):
        training_restore.load_shard(folder, expected, "dcp", "cpu", {"model": {"w": torch.zeros(6)}}, True)
    assert reads == [], "nothing is unpickled before every file checks out"


def test_the_validation_module_names_the_grpc_size_options() -> None:
    assert dict(validation.SERVER_SIZE_OPTIONS) == {"grpc.max_receive_message_length": 1 << 20,
                                                    "grpc.max_send_message_length": 16 << 20}
    assert dict(validation.CLIENT_SIZE_OPTIONS)["grpc.max_receive_message_length"] == 16 << 20
