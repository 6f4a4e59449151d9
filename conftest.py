"""Fixtures shared by tests/ and chaos_tests/: real etcd servers on free loopback ports with temporary
data dirs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ftctl.etcd_server import EtcdCluster


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A single real etcd member, stopped after the test."""
    cluster = EtcdCluster(tmp_path / "etcd", size=1, fast=True).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A real three-member etcd cluster with fast raft timings."""
    cluster = EtcdCluster(tmp_path / "etcd3", size=3, fast=True).start()
    try:
        yield cluster
    finally:
        cluster.stop()
