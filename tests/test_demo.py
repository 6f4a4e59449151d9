"""The README's main command, end to end: ``ftctl demo`` trains through torchrun + ftd, kills a node for
real, recovers, and writes a drill report that opens in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ftd.ftctl.cli import main

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium not found: apt-get install -y chromium (CI installs it)"
    return path


def test_demo_recovers_and_writes_a_report_chromium_renders(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.html"
    rc = main(["demo", "--json", "--report", str(report), "--workdir", str(tmp_path / "demo")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out["drill"]["verdict"]
    drill = out["drill"]
    assert drill["passed"] and drill["replacement"] == "node-2" and drill["recovered_s"] < 60
    assert drill["resumed_step"] >= 10 and drill["epoch_after"] == drill["epoch_before"] + 1
    assert out["checkpoints"] and any(c["valid"] for c in out["checkpoints"])
    html = report.read_text()
    assert drill["verdict"] in html and "<svg" in html

    browser = chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--enable-logging=stderr"]
    dom = subprocess.run([browser, *flags, "--dump-dom", report.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="verdict"' in dom.stdout and "<circle" in dom.stdout and drill["node"] in dom.stdout
    assert "CONSOLE(" not in dom.stderr, "the page logged to the console"
    shot = tmp_path / "report.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1000,900", report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, "the screenshot is empty"


def test_demo_preempt_hands_over_without_losing_a_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ftctl demo --preempt``: a spot notice (the agent's trigger file), a final checkpoint at one agreed
    step, the spare takes the rank, the job resumes at that step, and the restart budget is untouched."""
    rc = main(["demo", "--preempt", "--json", "--report", str(tmp_path / "r.html"),
               "--workdir", str(tmp_path / "demo")])
    out = json.loads(capsys.readouterr().out)
    drill = out["drill"]
    assert rc == 0 and out["passed"], drill["verdict"]
    assert out["mode"] == "preempt" and out["lost_steps"] == 0
    assert drill["replacement"] == "node-2" and drill["restarts_after"] == drill["restarts_before"]
    assert drill["resumed_step"] == drill["last_step_before"] > 30, "the final checkpoint is the last step run"
    assert 0 <= out["handover_s"] < 30, "committed before the notice's 30 s ran out"
    final = next(c for c in out["checkpoints"] if c["step"] == drill["resumed_step"])
    assert final["valid"]


def test_demo_straggler_replaces_the_slow_node_without_losing_a_step(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``ftctl demo --straggler``: the last rank's node's workers held to a fifth of a CPU (heartbeats green); the
    coordinator's straggler watch scores it against the other node, hands its rank to the spare through
    the planned hand-over, and the job resumes at the step it stopped at."""
    rc = main(["demo", "--straggler", "--json", "--report", str(tmp_path / "r.html"),
               "--workdir", str(tmp_path / "demo")])
    out = json.loads(capsys.readouterr().out)
    drill = out["drill"]
    assert rc == 0 and out["passed"], (drill["verdict"], out.get("decisions"))
    assert out["mode"] == "straggler" and out["lost_steps"] == 0 and drill["replacement"] == "node-2"
    slow = drill["node"]  # the world's last rank (the world is in join order: node-0 or node-1)
    other = ({"node-0", "node-1"} - {slow}).pop()
    assert slow in ("node-0", "node-1") and drill["restarts_after"] == drill["restarts_before"]
    detected = [d for d in out["decisions"] if d.startswith(f"straggler_detected: {slow}")]
    assert detected and "median compute" in detected[0], out["decisions"]
    assert any(d.startswith(f"drain_requested: {slow}: straggler: score") for d in out["decisions"])
    assert not any(d.startswith(f"straggler_detected: {other}") for d in out["decisions"]), "no false alarm"


def test_demo_nan_rolls_the_bad_step_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ftctl demo --nan``: one rank's loss NaN at a step (once); the coordinator rolls the job back to a
    checkpoint before it, once, the rerun is clean, and no restart is counted."""
    rc = main(["demo", "--nan", "--json", "--workdir", str(tmp_path / "demo")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"], out.get("decisions")
    assert out["mode"] == "nan" and out["restarts"] == 0
    assert out["restored_steps"] and all(0 <= s < out["nan_step"] for s in out["restored_steps"])
    rollbacks = [d for d in out["decisions"] if d.startswith("rollback:")]
    assert len(rollbacks) == 1 and f"rolled back before step {out['nan_step']}" in rollbacks[0], rollbacks
    assert all(s >= out["nan_step"] for s in out["suspect_steps"]), "only steps from the bad one on are suspect"
    assert any(d.startswith("step_anomaly:") and f"step {out['nan_step']}: loss is nan" in d for d in out["decisions"])
    assert any("rolled back to" in what for _, what in out["timeline"])
