"""Signed shards on real processes (``ftctl up``: etcd, a coordinator, 2 agents, mutual TLS): a shard on
node-0's disks replaced by another node is refused at restore before anything is unpickled, recorded
corrupt, and the previous copy or step is loaded. Two forgeries of step 2, each of its own job:

* the bytes replaced with the attacker's weights, the last 4 bytes chosen so that the file keeps its
  size and CRC32C (the catalog's check passes: a restore with the signature check off loads the
  attacker's weights), node-0's genuine signature file kept: the SHA-256 it signs does not match;
* the bytes, manifest and signature all replaced, signed with node-1's own valid key (a compromised
  node): signed by a node the catalog does not name as the shard's writer.

The signature rules themselves, pure: tests/test_signing.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from ftd.checkpoints.layout import MANIFEST, FileEntry, ShardManifest, shard_prefix
from ftd.checkpoints.signing import (
    SIGNATURE,
    BadSignature,
    SignedShard,
    load_cas,
    sign_statement,
    statement_for,
    verify_shard,
)
from ftd.ftctl.localcluster import ClusterFile, stop, up
from ftd.identity import TlsMaterial
from ftd.training import Checkpointer
from ftd.v1 import checkpoint_pb2
from ftd.waiting import wait_for

pytestmark = pytest.mark.etcd
GOOD = {1: torch.arange(64, dtype=torch.float32), 2: torch.arange(64, dtype=torch.float32) + 100}
EVIL = torch.full((64,), 666.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFile]:
    started = up(tmp_path_factory.mktemp("signed") / "cluster", nodes=2, spares=0, unmanaged_jobs=True)
    try:
        yield started
    finally:
        stop(started)


def checkpointer(cluster: ClusterFile, job: str) -> Checkpointer:
    node0 = next(a for a in cluster.agents if a.name == "node-0")
    return Checkpointer(job, rank=0, world_size=1, agent_socket=node0.info["socket"], install_signal_handlers=False)


def catalog(cluster: ClusterFile, job: str) -> dict[int, checkpoint_pb2.CheckpointInfo]:
    operator = cluster.client()
    try:
        listed = operator.call("ListCheckpoints", checkpoint_pb2.ListCheckpointsRequest(job=job), idempotent=True)
        return {c.step: c for c in listed.checkpoints}
    finally:
        operator.close()


def copies_of_step_2(cluster: ClusterFile, job: str) -> list[Path]:
    """Every published folder of step 2 on node-0's disks, once the tiering is done with it: its SSD
    and the shared HDD copies recorded (a forgery written while the tiering reads the file would be
    caught by the copy's CRC32C, and the SSD copy recorded corrupt before the restore looked)."""
    node0 = next(a for a in cluster.agents if a.name == "node-0")
    roots = {"ssd": Path(node0.info["workdir"]) / "ssd", "hdd": Path(cluster.workdir) / "shared" / "hdd"}

    def settled() -> list[Path] | None:
        shard = catalog(cluster, job)[2].shards[0]
        folders = [roots[c.tier] / shard_prefix(job, 2, 0) for c in shard.copies if c.tier in roots]
        done = {c.tier for c in shard.copies} >= {"ssd", "hdd"}
        return folders if done and all((f / MANIFEST).exists() for f in folders) else None

    return wait_for(settled, timeout_s=30.0, what=f"step 2 of {job} on node-0's disks")


def replace(path: Path, data: bytes) -> None:
    """The attacker's file in place at once (a reader sees the old bytes or the new, never half)."""
    tmp = path.with_name(f".{path.name}.forged")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def forge_crc32c(data: bytes, at: int, target: int) -> bytes:
    """``data`` with its bytes ``at..at+4`` chosen so that its CRC32C is ``target`` (CRC32C is affine
    in those 32 bits: solved over GF(2)). What anybody can do to a non-cryptographic checksum."""
    base = bytearray(data)
    base[at:at + 4] = bytes(4)
    zero = crc32c.crc32c(bytes(base))
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (crc difference, which input bits make it)
    for bit in range(32):
        flipped = bytearray(base)
        flipped[at + bit // 8] ^= 1 << (bit % 8)
        vector, mask = crc32c.crc32c(bytes(flipped)) ^ zero, 1 << bit
        for lead in sorted(basis, reverse=True):
            if vector >> lead & 1:
                vector, mask = vector ^ basis[lead][0], mask ^ basis[lead][1]
        if vector:
            basis[vector.bit_length() - 1] = (vector, mask)
    want, mask = target ^ zero, 0
    for lead in sorted(basis, reverse=True):
        if want >> lead & 1:
            want, mask = want ^ basis[lead][0], mask ^ basis[lead][1]
    assert want == 0, "no solution"
    for bit in range(32):
        if mask >> bit & 1:
            base[at + bit // 8] ^= 1 << (bit % 8)
    return bytes(base)


def evil_bytes(genuine: bytes) -> bytes:
    """The attacker's weights in the genuine file's place: same size, same CRC32C."""
    at = genuine.find(GOOD[2].numpy().tobytes())
    assert at > 0
    evil = genuine[:at] + EVIL.numpy().tobytes() + genuine[at + GOOD[2].numel() * 4:]
    forged = forge_crc32c(evil, at + GOOD[2].numel() * 4 - 4, crc32c.crc32c(genuine))
    assert len(forged) == len(genuine) and crc32c.crc32c(forged) == crc32c.crc32c(genuine)
    return forged


def saved_steps(cluster: ClusterFile, job: str) -> None:
    ck = checkpointer(cluster, job)
    try:
        for step in (1, 2):
            ck.save(step, {"w": GOOD[step].clone()})
            result = ck.wait()
            assert result is not None and result.ok and result.valid, result
    finally:
        ck.close()


def restored(cluster: ClusterFile, job: str, signed: bool = True) -> tuple[int, Any, str]:
    ck = checkpointer(cluster, job)
    try:
        if not signed:
            ck.restorer.signer = None  # what a restore without signatures (CRC32C only) would load
        got = ck.load_latest()
        assert got is not None
        return got[0], got[1]["w"], ck.restored_from
    finally:
        ck.close()


def node_pki(cluster: ClusterFile, node: str) -> TlsMaterial:
    files = cluster.identity("node", node)
    assert files is not None, "the cluster runs with mTLS"
    return files.load()


def check_signature(cluster: ClusterFile, job: str, folder: Path, expected: dict[str, tuple[int, str]]) -> None:
    """The signature check of a copy on disk, against the catalog's writer of its shard (what the
    restore runs before unpickling)."""
    writer = catalog(cluster, job)[2].shards[0].writer
    assert writer == "node-0"
    verify_shard(folder, cas=load_cas(node_pki(cluster, "node-0").ca_pem), writer=writer, job=job, step=2, rank=0,
                 expected=expected, cluster="local")


def assert_refused(cluster: ClusterFile, job: str, why: str) -> None:
    """The restore loads the previous step, genuine, and the forged copies are recorded corrupt (none is
    offered again)."""
    step, weights, source = restored(cluster, job)
    assert step == 1 and torch.equal(weights, GOOD[1]), (step, source)  # every copy of step 2 was forged
    shard = catalog(cluster, job)[2].shards[0]
    bad = dict(shard.bad)
    assert set(bad) == {f"{c.tier}@{c.location}" for c in shard.copies} >= {"ssd@node-0", "hdd@shared"}, bad
    assert all(why in v for v in bad.values()), bad


def test_bytes_forged_to_keep_their_crc32c_are_refused_by_the_signature(cluster: ClusterFile) -> None:
    job = "forged-bytes"
    saved_steps(cluster, job)
    forged = copies_of_step_2(cluster, job)
    for folder in forged:
        replace(folder / "state.pt", evil_bytes((folder / "state.pt").read_bytes()))
    step, weights, _ = restored(cluster, job, signed=False)
    assert step == 2 and weights[0].item() == 666.0, "without signatures the CRC32C check loads the forgery"
    assert_refused(cluster, job, "signature check failed")


def test_a_shard_resigned_by_another_node_is_refused(cluster: ClusterFile) -> None:
    job = "resigned"
    saved_steps(cluster, job)
    node1 = node_pki(cluster, "node-1")
    for folder in copies_of_step_2(cluster, job):  # node-1 rewrites bytes, signature and manifest, consistent
        replace(folder / "state.pt", evil_bytes((folder / "state.pt").read_bytes()))
        statement = statement_for(folder, job=job, step=2, epoch=0, rank=0, world_size=1, fmt="torch",
                                  now=time.time()).encode()
        replace(folder / SIGNATURE, SignedShard(statement, sign_statement(statement, node1.key_pem),
                                                node1.cert_pem).encode())
        old = ShardManifest.decode(str(folder), (folder / MANIFEST).read_bytes())
        files = tuple(FileEntry(f.name, (folder / f.name).stat().st_size,
                                f"{crc32c.crc32c((folder / f.name).read_bytes()):08x}") for f in old.files)
        replace(folder / MANIFEST, ShardManifest(job, 2, old.epoch, 0, 1, "torch", files).encode())
        with pytest.raises(BadSignature, match="signed by node node-1, and the catalog says node node-0"):
            check_signature(cluster, job, folder, {f.name: (f.size, f.crc32c) for f in files})
    # The forged SHARD.sig differs from the one the catalog lists: refused by its CRC32C before its
    # signature is read (with a catalog rewritten to match, by the signature check above).
    assert_refused(cluster, job, "")
