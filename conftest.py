"""Fixtures shared by tests/ and chaos_tests/: real etcd servers on free loopback ports with temporary
data dirs, and the tail of every process log a failed test left (a CI run keeps nothing else)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


LOG_TAIL_LINES = 12  # per log: the last lines above DEBUG
LOG_TAIL_FILES = 8  # logs shown per failed test, newest first


def log_tails(root: Path, lines: int = LOG_TAIL_LINES, files: int = LOG_TAIL_FILES) -> str:
    """The last non-DEBUG lines of the newest ``*.log`` files under ``root``: on a CI box whose
    temporary directories are gone after the run, the only record of what the processes said."""
    logs = sorted(root.rglob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)[:files]
    parts = []
    for log in sorted(logs):
        kept = [line[:240] for line in log.read_text(errors="replace").splitlines() if " DEBUG " not in line]
        if kept:
            parts.append(f"--- {log.relative_to(root)} (last {min(lines, len(kept))} of {len(kept)})\n"
                         + "\n".join(kept[-lines:]))
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(tmp, Path) and tmp.is_dir():
        tails = log_tails(tmp)
        if tails:
            report.sections.append(("process logs (tail)", tails))
