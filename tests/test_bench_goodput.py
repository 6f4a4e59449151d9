"""bench/goodput.py's bookkeeping, without a cluster: the seeded schedule is the same for every arm and
has the asked MTTF, goodput and the time with no training are computed from the job's step records."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def gp() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports its siblings, as `python bench/goodput.py` does
    try:
        return importlib.import_module("goodput")
    finally:
        sys.path.remove(str(BENCH))


def test_the_schedule_is_seeded_bounded_and_has_the_asked_mttf(gp: ModuleType) -> None:
    one = gp.schedule(1, 600.0, 90.0, gp.KINDS, 2)
    assert one == gp.schedule(1, 600.0, 90.0, gp.KINDS, 2) and one != gp.schedule(2, 600.0, 90.0, gp.KINDS, 2)
    assert all(0 < f.at_s <= 570.0 and f.kind in gp.KINDS and f.rank in (0, 1) for f in one)
    assert [f.at_s for f in one] == sorted(f.at_s for f in one)
    long = gp.schedule(7, 900_000.0, 90.0, ("node", "worker"), 2)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(long)]
    assert statistics.fmean(gaps) == pytest.approx(90.0, rel=0.05)
    assert {f.kind for f in long} == {"node", "worker"} and {f.rank for f in long} == {0, 1}


def test_goodput_and_idle_time_from_the_step_records(gp: ModuleType, tmp_path: Path) -> None:
    rows = [{"event": "step", "t": 100.0 + 0.2 * s, "step": s, "rank": 0} for s in range(50)]
    rows += [{"event": "step", "t": 120.0 + 0.2 * (s - 40), "step": s, "rank": 0} for s in range(40, 60)]  # redone
    (tmp_path / "rank0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert gp.failure_free_step_s(tmp_path, 100.0, 109.0) == pytest.approx(0.2)
    times = [r["t"] for r in rows]
    assert gp.idle_seconds(times, 0.2) == pytest.approx(120.0 - 109.8 - 0.2)
    assert gp.goodput(59, 0.2, 23.8) == pytest.approx(59 * 0.2 / 23.8)
    assert gp.goodput(10, 0.0, 10.0) is None


def test_costs_by_kind(gp: ModuleType) -> None:
    rows = [{"kind": "node", "recovered": True, "detected_s": 1.0, "recovered_s": 5.0, "lost_steps": 0, "cost_s": 5.0},
            {"kind": "node", "recovered": False, "detected_s": None, "recovered_s": None, "lost_steps": None},
            {"kind": "worker", "recovered": True, "detected_s": None, "recovered_s": 3.0, "lost_steps": 2,
             "cost_s": 3.4}]
    stats = gp.by_kind(rows)
    assert stats["node"]["injected"] == 2 and stats["node"]["recovered"] == 1
    assert stats["node"]["mean_recovered_s"] == 5.0 and stats["worker"]["mean_detected_s"] is None
    assert stats["worker"]["p90_cost_s"] == 3.4


def test_the_lab_phase_and_a_bad_workload_are_refused_with_the_reason(tmp_path: Path) -> None:
    """``--phase`` belongs to the re-executed half inside a lab the script made; run by hand it says so
    (nothing is started), as does a workload with no ranks."""
    script = BENCH / "goodput.py"
    env = {k: v for k, v in os.environ.items() if k != "FTD_BENCH_GOODPUT_INSIDE"}
    by_hand = subprocess.run([sys.executable, str(script), "--phase", "run", "--arms", "ftd", "--workdir",
                              str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert by_hand.returncode == 2 and "inside a lab it made" in by_hand.stderr
    assert not any(tmp_path.iterdir())
    bad = subprocess.run([sys.executable, str(script), "--workload", "fsdp", "--nproc-per-node", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--nproc-per-node must be >= 1" in bad.stderr
