"""Fixtures of tests/: a whole local cluster as real processes (etcd fixtures: ../conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.ftctl.localcluster import ClusterFile, stop, up


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[ClusterFile]:
    """A whole local cluster (etcd, one coordinator, 2 active + 1 spare agents) as real processes, secure
    as ``ftctl up`` makes it (mTLS, the authorization table, etcd with client certificates and auth):
    dial it with ``cluster.client()`` or ``tls=cluster.operator`` / ``cluster.identity(kind, name)``."""
    cluster = up(tmp_path / "cluster", nodes=2, spares=1)
    try:
        yield cluster
    finally:
        stop(cluster)
