"""The standbys' ``prepare()`` hook (training/warm_worker.py, agent/warm_pool.py): a job that defines
``prepare`` and a two-argument ``main`` gets its setup done by the standby before the assignment, and
its ``main`` receives what ``prepare`` built. The decisions are pure; the protocol runs with real
standby processes (torch imported, as in production)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ftd.agent.warm_pool import WarmPool, WorkerAssignment, standby_argv
from ftd.training import warm_worker as ww
from ftd.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent

# A job module: prepare() writes what it saw and returns a context; main(argv, prepared) writes what it got.
MODULE = '''
import json, os, sys, time

def _write(out, what, record):
    with open(os.path.join(out, what + "-" + os.environ["LOCAL_RANK"] + ".json"), "w") as f:
        json.dump(record, f)

def prepare(argv):
    if "--fail" in argv:
        raise RuntimeError("no model for you")
    seen = {"pid": os.getpid(), "argv": argv, "rank": os.environ.get("RANK"), "t": time.time(),
            "torch": "torch" in sys.modules}
    _write(argv[0], "prepare", seen)
    return {"built_by": os.getpid(), "at": seen["t"]}

def main(argv, prepared=None):
    _write(argv[0], "main", {"pid": os.getpid(), "prepared": prepared, "rank": os.environ.get("RANK"),
                             "t": time.time()})
    return 0
'''

# The same contract in a script: imported ahead (as __ftd_job__), so its __main__ block must not run.
SCRIPT = MODULE + '''
if os.environ.get("SCRIPT_MARK"):
    _write(os.environ["SCRIPT_MARK"], "imported", {"name": __name__})

if __name__ == "__main__":
    _write(sys.argv[1], "ran-as-main", {})
    raise SystemExit(main(sys.argv[1:], None))
'''


@pytest.fixture
def job_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "prep_entry.py").write_text(MODULE)
    (tmp_path / "prep_script.py").write_text(SCRIPT)
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "SCRIPT_MARK": str(tmp_path / "out")}


def _read(out: Path, what: str, local_rank: int) -> dict[str, Any]:
    return dict(json.loads((out / f"{what}-{local_rank}.json").read_text()))


# ---- pure parts ------------------------------------------------------------------------------------


def test_a_script_opts_in_only_with_both_functions_at_top_level() -> None:
    assert ww.script_opts_in("def prepare(argv): pass\ndef main(argv, prepared=None): pass\n")
    assert not ww.script_opts_in("def main(argv): pass\n")  # runs as __main__ at activation, as before
    assert not ww.script_opts_in("if True:\n    def prepare(): pass\n    def main(a, b): pass\n")
    assert not ww.script_opts_in("import torch\ntrain()\n")  # top-level training code is never imported ahead
    assert not ww.script_opts_in("def prepare(:\n")  # does not parse


def test_which_main_can_take_what_prepare_built() -> None:
    assert ww.takes_two_arguments(lambda argv, prepared: 0)
    assert ww.takes_two_arguments(lambda argv=None, prepared=None: 0)
    assert ww.takes_two_arguments(lambda *args: 0)
    assert not ww.takes_two_arguments(lambda argv: 0)
    assert not ww.takes_two_arguments(lambda: 0)


def test_run_prepare_and_the_context_main_gets(capsys: pytest.CaptureFixture[str]) -> None:
    ticks = iter([10.0, 12.5])
    job = ww.JobEntry("m", lambda argv, prepared: 0, lambda argv: {"argv": argv})
    prepared = ww.run_prepare(job, ["--a"], clock=lambda: next(ticks))
    assert prepared.ok and prepared.seconds == 2.5 and prepared.context == {"argv": ["--a"]}
    assert ww.context_for(prepared, ["--a"]) == {"argv": ["--a"]}
    assert ww.context_for(prepared, ["--b"]) is None  # prepared for other arguments: not used
    assert "not the ones prepare() saw" in capsys.readouterr().err

    def broken(argv: list[str]) -> object:
        raise ValueError("bad config")

    failed = ww.run_prepare(ww.JobEntry("m", lambda argv, prepared: 0, broken), [])
    assert not failed.ok and failed.error == "ValueError: bad config" and failed.context is None
    assert "Traceback" in capsys.readouterr().err  # the standby's log gets the traceback
    assert ww.context_for(failed, []) is None

    def bad_flag(argv: list[str]) -> object:
        raise SystemExit(2)  # argparse on a bad flag: main meets it again, as the worker's failure

    assert ww.run_prepare(ww.JobEntry("m", lambda argv, prepared: 0, bad_flag), []).error == "SystemExit: 2"
    assert ww.run_prepare(ww.JobEntry("m", lambda argv, prepared: 0), []) == ww.Prepared()  # no prepare


def test_load_entry_finds_prepare_only_next_to_a_main_that_takes_it(tmp_path: Path, job_env: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "one_arg_main.py").write_text("def prepare():\n    return 1\n\ndef main(argv):\n    return 0\n")
    assert ww.load_entry("prep_entry").prepare is not None
    assert ww.load_entry("one_arg_main").prepare is None  # main could not receive it: prepare is not run
    script = ww.load_entry(str(tmp_path / "prep_script.py"))
    assert script.prepare is not None and str(tmp_path) in sys.path
    plain = tmp_path / "plain_script.py"
    plain.write_text("raise SystemExit(3)\n")  # top-level code: imported at activation only
    assert ww.load_entry(str(plain)).prepare is None
    sys.modules.pop(ww.SCRIPT_MODULE, None)


# ---- real standbys ---------------------------------------------------------------------------------


def test_standbys_prepare_before_the_assignment_and_main_gets_the_result(tmp_path: Path,
                                                                         job_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    entries = {0: "prep_entry", 1: str(tmp_path / "prep_script.py")}  # a module and a script
    pool = WarmPool(lambda lr: standby_argv(entries[lr], [str(out)]), 2, job_env, tmp_path / "w-{local_rank}.log",
                    background_refill=False)
    try:
        assert pool.wait_ready(120)
        assert sorted(r.local_rank for r in pool.readiness if r.prepared and r.prepare_s is not None) == [0, 1]
        standbys = {s.local_rank: s.pid for s in pool._slots if s is not None}
        before = [_read(out, "prepare", lr) for lr in (0, 1)]
        assert [b["pid"] for b in before] == [standbys[0], standbys[1]]  # in the standby, before any assignment
        assert all(b["rank"] is None and b["torch"] and b["argv"] == [str(out)] for b in before)
        imported = _read(out, "imported", 1)
        assert imported == {"name": "__ftd_job__"}  # the script was imported, not run as __main__
        activated_at = time.time()
        procs = pool.activate([WorkerAssignment({"RANK": "2"}), WorkerAssignment({"RANK": "3"}, [str(out)])])
        assert [p.wait(60) for p in procs] == [0, 0]
        for lr, rank in ((0, "2"), (1, "3")):
            got = _read(out, "main", lr)
            assert got["pid"] == standbys[lr] and got["rank"] == rank
            assert got["prepared"] == {"built_by": standbys[lr], "at": before[lr]["t"]}  # what prepare returned
            assert before[lr]["t"] < activated_at
        assert not (out / "ran-as-main-1.json").exists() and pool.prepare_failures == 0
    finally:
        pool.close()


def test_a_failed_prepare_is_reported_and_main_builds_everything_itself(tmp_path: Path,
                                                                        job_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = {0: [str(out), "--fail"], 1: [str(out)]}
    pool = WarmPool(lambda lr: standby_argv("prep_entry", args[lr]), 2, job_env, tmp_path / "w-{local_rank}.log",
                    background_refill=False)
    try:
        assert pool.wait_ready(120)
        wait_for(lambda: pool.prepare_failures == 1, 10, "the failed prepare to be counted")
        ready = {r.local_rank: r for r in pool.readiness}
        assert not ready[0].prepared and ready[0].prepare_s is not None and ready[1].prepared
        assert "RuntimeError: no model for you" in (tmp_path / "w-0.log").read_text()  # the traceback
        # local rank 1 is handed other arguments than its prepare saw: its context is not used either
        procs = pool.activate([WorkerAssignment({"RANK": "0"}), WorkerAssignment({"RANK": "1"}, [str(out), "--x"])])
        assert [p.wait(60) for p in procs] == [0, 0]
        assert [_read(out, "main", lr)["prepared"] for lr in (0, 1)] == [None, None]
        assert "not the ones prepare() saw" in (tmp_path / "w-1.log").read_text()
    finally:
        pool.close()
