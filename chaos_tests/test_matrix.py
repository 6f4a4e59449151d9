"""The chaos matrix in CI: each scenario of ``python -m chaos_tests.matrix`` as one test, on an
isolated cluster with real etcd, coordinators, agents and torch workers (:mod:`chaos_tests.matrix`).
Needs root for the network namespaces; skipped with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos_tests import matrix
from ftd import netlab

_MISSING = netlab.missing_privileges()
_ETCD = os.environ.get("FTD_ETCD_BINARY") or shutil.which("etcd") or Path("/usr/bin/etcd").exists()
pytestmark = [
    pytest.mark.netns, pytest.mark.slow, pytest.mark.etcd, pytest.mark.chaos,
    pytest.mark.skipif(bool(_MISSING), reason=f"network namespaces need root and tools: missing {', '.join(_MISSING)}"),
    pytest.mark.skipif(not _ETCD, reason="etcd server binary not installed (apt-get install -y etcd-server)"),
]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short workdir: node directories hold Unix sockets, whose paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ftdc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", list(matrix.SCENARIOS))
def test_scenario_passes_with_every_invariant(name: str, short_dir: Path) -> None:
    pytest.importorskip("torch")
    result = matrix.run_one(matrix.SCENARIOS[name], short_dir)
    assert result["scenario"] == name
    assert result["invariants"], result["detail"]
    broken = [k for k, ok in result["invariants"].items() if not ok]
    assert result["passed"] and not broken, f"{name}: broken {broken}: {result['detail']}"


def test_the_matrix_has_every_scenario_of_the_issue() -> None:
    wanted = {"agent-kill", "worker-kill", "node-hang", "node-partition", "asymmetric-partition",
              "leader-etcd-partition", "etcd-member-kill", "etcd-outage", "s3-outage", "disk-full", "corrupt-shard",
              "crash-mid-save", "zombie", "double-failure", "latency", "spare-restore-node-local"}
    assert wanted <= set(matrix.SCENARIOS), sorted(wanted - set(matrix.SCENARIOS))


def test_unknown_scenario_is_refused_with_the_known_names() -> None:
    with pytest.raises(SystemExit, match=r"unknown scenario.*no-such.*known: agent-kill"):
        matrix.select("agent-kill,no-such")
