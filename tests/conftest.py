"""Fixtures of tests/: a whole local cluster as real processes, moto's S3 server per module, and a fake
cloud metadata server and a hung port for the preemption tests (etcd fixtures: ../conftest.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cloud_metadata import FakeMetadata
from storage_fixtures import MotoServer

from ftd.ftctl.localcluster import ClusterFile, stop, up


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[ClusterFile]:
    """A whole local cluster (etcd, one coordinator, 2 active + 1 spare agents) as real processes, secure
    as ``ftctl up`` makes it (mTLS, the authorization table, etcd with client certificates and auth):
    dial it with ``cluster.client()`` or ``tls=cluster.operator`` / ``cluster.identity(kind, name)``. Its
    tests save checkpoints of jobs that never rendezvous (a Checkpointer per rank, no torchrun): the
    coordinator allows them (``unmanaged_jobs``; off by default, docs/security.md)."""
    cluster = up(tmp_path / "cluster", nodes=2, spares=1, unmanaged_jobs=True)
    try:
        yield cluster
    finally:
        stop(cluster)


@pytest.fixture
def md() -> Iterator[FakeMetadata]:
    """A fake cloud metadata server on 127.0.0.1 (tests/cloud_metadata.py), closed after the test."""
    server = FakeMetadata()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers: a hung metadata server."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's standalone S3 server for one test module (a module may define its own ``moto``)."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()
