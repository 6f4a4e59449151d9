"""The armed failpoint of the chaos matrix: listed in FTD_FAILPOINTS it does nothing until its file
appears in FTD_FAILPOINTS_ARMED, then kills exactly one process (the one that removed the file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

CODE = "from ftd.training.checkpoint import failpoint; failpoint('ckpt.before_publish'); print('survived')"


def run(armed: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FTD_FAILPOINTS": "ckpt.before_publish", "FTD_FAILPOINTS_ARMED": str(armed)}
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)


def test_unarmed_failpoint_lets_the_process_go_on(tmp_path: Path) -> None:
    res = run(tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "survived", res.stderr


def test_armed_failpoint_fires_once(tmp_path: Path) -> None:
    (tmp_path / "ckpt.before_publish").write_text("")
    first = run(tmp_path)
    assert first.returncode == -signal.SIGKILL and first.stdout == ""
    assert not (tmp_path / "ckpt.before_publish").exists()
    second = run(tmp_path)  # disarmed by the first
    assert second.returncode == 0 and second.stdout.strip() == "survived"
