"""The JSON-lines records a training job under test writes (``demo_job``, ``examples/fsdp2_train.py``:
one file per rank in ``--out``) and the catalog's restore target, as the end-to-end tests read them."""

from __future__ import annotations

import contextlib
import json
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


def restore_target_step(client: Any, job: str) -> int:
    """The step the catalog would restore ``job`` from now (-1: none)."""
    target = client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=job), idempotent=True)
    return int(target.checkpoint.step) if target.found else -1
