"""bench/recovery.py's bookkeeping, without a cluster: the phases add up to the recovery, the logs'
timestamps are read as the wall clock they were written in, and the new world is found in the job's
records (old workers and a failed round's ranks left out)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def rec() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports its sibling _common, as `python bench/recovery.py` does
    try:
        return importlib.import_module("recovery")
    finally:
        sys.path.remove(str(BENCH))


def test_phases_add_up_to_the_recovery_and_an_early_abort_costs_nothing(rec: ModuleType) -> None:
    at = {"detect": 1.6, "commit": 1.61, "abort": 1.2, "restart": 1.7, "process_group": 1.75, "restore": 1.85,
          "first_step": 1.9}
    phases = rec.phases_of(at)
    assert phases["abort"] == 0.0  # the survivors' workers were gone before the commit
    assert phases["commit"] == pytest.approx(0.01) and phases["restart"] == pytest.approx(0.09)
    assert sum(phases.values()) == pytest.approx(at["first_step"])
    # a moment not measured (torchrun has no epoch commit) is None and the next phase runs from the one before
    at_torchrun = {**at, "commit": None}
    phases = rec.phases_of(at_torchrun)
    assert phases["commit"] is None and phases["restart"] == pytest.approx(0.1)
    assert sum(v for v in phases.values() if v is not None) == pytest.approx(at["first_step"])


def test_log_timestamps_are_local_wall_clock(rec: ModuleType, tmp_path: Path) -> None:
    t = int(time.time()) - 3600 + 0.25  # this year: torch's log lines carry no year
    local = time.localtime(t)
    ftd_log = tmp_path / "node-0.log"
    ftd_log.write_text(
        f"{time.strftime('%Y-%m-%dT%H:%M:%S', local)}.250 WARNING ftd.agent [node=node-0] drill: killing node "
        "node-0 now (ftctl drill)\n"
        "  a continuation line without a timestamp\n"
        f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(t - 60))}.000 INFO ftd.agent [-] drill: killing "
        "node node-0 now (an older incident)\n")
    assert rec.ftd_log_times(ftd_log, "drill: killing node node-0", t - 1) == [pytest.approx(t, abs=1e-3)]
    torch_log = tmp_path / "torchrun.log"
    torch_log.write_text(
        f"V{time.strftime('%m%d %H:%M:%S', local)}.250000 4242 torch/distributed/elastic/rendezvous/"
        "dynamic_rendezvous.py:490] Detected dead node '127.0.0.1_1_0', removing it from the rendezvous\n")
    assert rec.torch_log_times(torch_log, "Detected dead node", t - 1) == [pytest.approx(t, abs=1e-6)]


def test_the_new_world_is_the_ranks_that_stepped_after_the_kill(rec: ModuleType, tmp_path: Path) -> None:
    kill = 1000.0
    rows = [
        {"t": 990.0, "event": "step", "step": 40, "pid": 1, "node": "a", "world": 2},  # old workers
        {"t": 990.0, "event": "step", "step": 40, "pid": 2, "node": "b", "world": 2},
        {"t": 1001.0, "event": "boot", "booted": 1000.9, "pid": 3, "node": "a", "world": 2},  # a round that failed
        {"t": 1002.0, "event": "boot", "booted": 1001.8, "pid": 4, "node": "a", "world": 2},
        {"t": 1002.1, "event": "boot", "booted": 1001.9, "pid": 5, "node": "c", "world": 2},
        {"t": 1002.4, "event": "start", "ddp_ready": 1002.2, "restored_step": 39, "pid": 4, "node": "a",
         "world": 2, "restored_from": "mem@a"},
        {"t": 1002.5, "event": "start", "ddp_ready": 1002.3, "restored_step": 39, "pid": 5, "node": "c",
         "world": 2, "restored_from": "mem@a (pulled through the agent)"},
        {"t": 1002.6, "event": "step", "step": 40, "pid": 4, "node": "a", "world": 2},
        {"t": 1002.6, "event": "step", "step": 40, "pid": 5, "node": "c", "world": 2},
    ]
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    marks = rec.new_world(tmp_path, kill)
    assert marks is not None
    assert marks["restart"] == 1001.9 and marks["process_group"] == 1002.3 and marks["restore"] == 1002.5
    assert marks["first_step"] == 1002.6 and marks["restored_step"] == 39
    assert rec.current_step(tmp_path, before=kill) == 40
    assert rec.new_world(tmp_path, 1003.0) is None  # nothing stepped after that
