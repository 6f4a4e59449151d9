"""The JSON-lines records a training job under test writes (``demo_job``, ``examples/fsdp2_train.py``:
one file per rank in ``--out``) and the catalog's restore target, as the end-to-end tests read them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ftd.v1 import checkpoint_pb2


def records(out: Path) -> list[dict[str, Any]]:
    """Every record of every rank's file in ``out``, oldest first (a line still being written is skipped)."""
    found = []
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                found.append(json.loads(line))
    return sorted(found, key=lambda r: r["t"])


def fsdp2_reference(tmp_path: Path, job_args: list[str]) -> dict[tuple[int, int], tuple[float, str]]:
    """examples/fsdp2_train.py uninterrupted: 4 ranks under plain torchrun, no ftd (``--no-ftd``):
    (rank, step) -> (loss, params_crc), what a recovered or rolled-back run must equal."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "reference"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(root / "examples" / "fsdp2_train.py"), *job_args, "--no-ftd", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {(r["rank"], r["step"]): (r["loss"], r["params_crc"]) for r in records(out) if r["event"] == "step"}


def restore_target_step(client: Any, job: str) -> int:
    """The step the catalog would restore ``job`` from now (-1: none)."""
    target = client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=job), idempotent=True)
    return int(target.checkpoint.step) if target.found else -1
