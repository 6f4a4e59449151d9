"""Shared by the benchmark scripts: run from a checkout (``python bench/X.py``), percentiles, output."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # chaos_tests (the fault library) lives in the checkout


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); ``None`` for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            shown = round(value, 3) if isinstance(value, float) else value
            print(f"{key.ljust(width)}  {shown}")


def scrape(address: str) -> dict[str, float]:
    """Prometheus text → {sample name with labels: value} (enough for counters and gauges)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    """Increase of every sample whose name starts with ``prefix`` (all label sets summed)."""
    return sum(v for k, v in after.items() if k.startswith(prefix)) - sum(
        v for k, v in before.items() if k.startswith(prefix))


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
