"""Issue 20's catalog and rendezvous findings as regression tests on real processes: ``ftctl up`` (etcd,
a coordinator, 2 agents + a spare, mutual TLS, the coordinator's defaults), a job whose round node-0
and node-1 joined, and node-1's own certificate in the attacker's hands (a compromised node). Each
attack is refused with PERMISSION_DENIED / RESOURCE_EXHAUSTED naming the rule, and the job's status,
world and catalog stay as they were. The rules themselves: tests/test_shard_rules.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from test_attacks import as_node, code, details, refused

from ftd.client import CoordinatorClient
from ftd.ftctl.cli import main as ftctl
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.v1 import checkpoint_pb2, coordinator_pb2

JOB = "victim"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("insider") / "cluster", nodes=2, spares=1)
    try:
        yield started
    finally:
        stop(started)


def join(client: CoordinatorClient, node_id: str, last_round: int = -1, job: str = JOB) -> coordinator_pb2.RoundInfo:
    info: coordinator_pb2.RoundInfo = client.call("JoinRound", coordinator_pb2.JoinRoundRequest(
        job=job, node_id=node_id, last_round=last_round, min_nodes=2, max_restarts=3), idempotent=False)
    return info


def manifest(step: int, epoch: int, rank: int, job: str = JOB) -> checkpoint_pb2.ShardManifest:
    return checkpoint_pb2.ShardManifest(job=job, step=step, epoch=epoch, rank=rank, world_size=2, format="torch",
                                        files=[checkpoint_pb2.ShardFile(name="state.pt", size=4, crc32c="0a0b0c0d")])


def commit(client: CoordinatorClient, node_id: str, m: checkpoint_pb2.ShardManifest) -> None:
    client.call("CommitShard", checkpoint_pb2.CommitShardRequest(tier="ssd", location=node_id, manifest=m),
                idempotent=False)


def catalog(cluster: ClusterFile) -> dict[tuple[str, int], str]:
    operator = cluster.client()
    try:
        listed = operator.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(), idempotent=True)
        return {(c.job, c.step): c.status for c in listed.checkpoints}
    finally:
        operator.close()


def target(cluster: ClusterFile) -> int:
    operator = cluster.client()
    try:
        found = operator.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=JOB), idempotent=True)
        return int(found.checkpoint.step) if found.found else -1
    finally:
        operator.close()


class Job:
    """The victim job: round 0 joined by node-0 and node-1, step 10 committed by both (valid), node-0's
    rank's copy on the shared HDD recorded by its holder. node-1 is the attacker; ``victim`` is node-0's
    rank, ``own`` node-1's (the world's order decides which is 0)."""

    def __init__(self, cluster: ClusterFile) -> None:
        self.node0, self.node1 = as_node(cluster, "node-0"), as_node(cluster, "node-1")
        first = join(self.node0, "node-0")
        second = join(self.node1, "node-1")
        assert second.status == coordinator_pb2.RoundInfo.READY
        self.epoch, self.victim, self.own = int(first.epoch), int(first.rank), int(second.rank)
        commit(self.node0, "node-0", manifest(10, self.epoch, self.victim))
        commit(self.node1, "node-1", manifest(10, self.epoch, self.own))
        self.node0.call("RecordCopy", checkpoint_pb2.RecordCopyRequest(
            job=JOB, step=10, rank=self.victim, tier="hdd", location="shared", present=True), idempotent=True)


@pytest.fixture(scope="module")
def job(cluster: ClusterFile) -> Iterator[Job]:
    made = Job(cluster)
    assert catalog(cluster)[(JOB, 10)] == "valid" and target(cluster) == 10
    try:
        yield made
    finally:
        made.node0.close()
        made.node1.close()


def denied(err: grpc.RpcError, rule: str) -> None:
    assert code(err) is grpc.StatusCode.PERMISSION_DENIED and f"rule {rule}" in details(err), details(err)


def test_a_node_cannot_commit_another_nodes_rank_at_any_step(cluster: ClusterFile,
                                                              job: Job) -> None:
    node1, epoch = job.node1, job.epoch
    before = catalog(cluster)
    for rank in (job.victim, job.own):  # node-0's rank, and its own far beyond the job's progress
        err = refused(commit, node1, "node-1", manifest(999_999_999_999, epoch, rank))
        denied(err, "shard_holder" if rank == job.victim else "step_progress")
    err = refused(commit, node1, "node-1", manifest(11, epoch, job.victim))
    assert f"rank {job.victim} is held by node-0" in details(err)
    assert catalog(cluster) == before and target(cluster) == 10


def test_a_future_epoch_does_not_wipe_the_catalog(cluster: ClusterFile,
                                                   job: Job) -> None:
    node1, epoch = job.node1, job.epoch
    before = catalog(cluster)
    err = refused(commit, node1, "node-1", manifest(0, 10**18, job.own))
    denied(err, "job_epoch")
    assert f"is at epoch {epoch}" in details(err)
    assert catalog(cluster) == before and target(cluster) == 10


def test_another_ranks_copies_cannot_be_marked_corrupt_or_dropped(
        cluster: ClusterFile, job: Job) -> None:
    node1 = job.node1
    for corrupt in ("bit rot, honest", ""):
        err = refused(node1.call, "RecordCopy", checkpoint_pb2.RecordCopyRequest(
            job=JOB, step=10, rank=job.victim, tier="hdd", location="shared", present=bool(corrupt),
            corrupt_reason=corrupt), idempotent=True)
        denied(err, "copy_owner")
    err = refused(node1.call, "RecordCopy", checkpoint_pb2.RecordCopyRequest(
        job=JOB, step=10, rank=job.victim, tier="ssd", location="node-1", present=True), idempotent=True)
    denied(err, "copy_owner")
    assert catalog(cluster)[(JOB, 10)] == "valid" and target(cluster) == 10


def test_junk_jobs_are_refused_and_a_spare_creates_none(cluster: ClusterFile,
                                                        job: Job) -> None:
    node1, epoch = job.node1, job.epoch
    before = catalog(cluster)
    for location in ("s3", "node-1"):
        err = refused(node1.call, "CommitShard", checkpoint_pb2.CommitShardRequest(
            tier="s3" if location == "s3" else "ssd", location=location, manifest=manifest(1, epoch, 0, "junk-0")),
            idempotent=False)
        denied(err, "shard_holder")
        assert "job junk-0 has no round" in details(err)
    spare = as_node(cluster, "node-2")
    try:
        info = join(spare, "node-2", job="spare-junk")
        assert info.status == coordinator_pb2.RoundInfo.WAIT and info.spare
        missing = refused(spare.call, "GetRound", coordinator_pb2.GetRoundRequest(job="spare-junk"), idempotent=True)
        assert code(missing) is grpc.StatusCode.NOT_FOUND, details(missing)
    finally:
        spare.close()
    assert catalog(cluster) == before


def test_repeated_joins_spend_one_restart_and_made_up_jobs_stay_few(
        cluster: ClusterFile, job: Job) -> None:
    node0, node1 = job.node0, job.node1
    start = node1.call("GetRound", coordinator_pb2.GetRoundRequest(job=JOB), idempotent=True)
    assert start.max_restarts == 10  # the coordinator's job_max_restarts, not the 3 the first join asked for
    for _ in range(6):  # the attacker's "my workers failed" six times: one incident
        info = join(node1, "node-1", last_round=int(start.round) + 1)
        assert info.status == coordinator_pb2.RoundInfo.READY, info.message
    after = node1.call("GetRound", coordinator_pb2.GetRoundRequest(job=JOB), idempotent=True)
    assert after.round == start.round + 1 and after.restarts == start.restarts + 1 and after.status != after.CLOSED
    assert join(node0, "node-0", last_round=int(start.round)).round == after.round  # node-0 follows
    outcomes = []
    for i in range(6):  # node-1 makes up jobs named to sort first
        try:
            outcomes.append(join(node1, "node-1", job=f"aaa-{i}").status)
        except grpc.RpcError as exc:
            assert code(exc) is grpc.StatusCode.RESOURCE_EXHAUSTED, details(exc)
            outcomes.append(-1)
            last = details(exc)
    assert outcomes.count(-1) >= 2 and "created 4 open jobs already" in last
    status = cluster.client()
    try:
        assert status.status().job == JOB  # not the first by name
    finally:
        status.close()


def test_only_an_operator_forgets_a_jobs_checkpoints_and_only_once_it_is_closed(
        cluster: ClusterFile, job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    node0, node1 = job.node0, job.node1
    first, second = join(node0, "node-0", job="old"), join(node1, "node-1", job="old")
    commit(node0, "node-0", manifest(5, int(first.epoch), int(first.rank), "old"))
    commit(node1, "node-1", manifest(5, int(second.epoch), int(second.rank), "old"))
    assert catalog(cluster)[("old", 5)] == "valid"
    denied_call = refused(node1.call, "ForgetJob", checkpoint_pb2.ForgetJobRequest(job=JOB), idempotent=True)
    assert code(denied_call) is grpc.StatusCode.PERMISSION_DENIED and "only operators" in details(denied_call)
    operator = cluster.client()
    try:
        running = refused(operator.call, "ForgetJob", checkpoint_pb2.ForgetJobRequest(job="old"), idempotent=True)
        assert code(running) is grpc.StatusCode.FAILED_PRECONDITION and "close it first" in details(running)
        assert ftctl(["close-job", "old", "--reason", "made up", "--workdir", cluster.workdir]) == 0
        assert "job old: closed (made up)" in capsys.readouterr().out
        assert ftctl(["checkpoints", "forget", "old", "--reason", "junk", "--json", "--workdir", cluster.workdir]) == 0
        assert json.loads(capsys.readouterr().out) == {"job": "old", "removed_steps": [5]}
        again = refused(operator.call, "ForgetJob", checkpoint_pb2.ForgetJobRequest(job="old"), idempotent=True)
        assert code(again) is grpc.StatusCode.NOT_FOUND, details(again)
    finally:
        operator.close()
    listed = catalog(cluster)
    assert ("old", 5) not in listed and listed[(JOB, 10)] == "valid"
