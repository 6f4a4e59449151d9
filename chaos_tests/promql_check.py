"""Prometheus helpers for the chaos matrix: scrape a daemon's ``/metrics`` over HTTP, read a
histogram's buckets per label set, compute its quantile the way PromQL's ``histogram_quantile`` does,
and check an alert rule against measured figures with ``promtool test rules``.

The promtool check turns what a scenario measured (each bucket's rate of increase over a window) into
a rule-test file whose input series grow at exactly those rates for ``minutes`` minutes, evaluates the
real rules file (deploy/prometheus/ftd-alerts.yml) on them and expects the alert to be firing for the
links that should fire and for no other. The file is JSON, which is YAML too (no YAML writer needed).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "ftd-alerts.yml"
PROMTOOL = "/usr/bin/promtool"

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, the bucket bound ``le`` left out
Buckets = dict[float, float]  # upper bound (math.inf for +Inf) -> cumulative count


def scrape(address: str, timeout_s: float = 3.0) -> str:
    """The text of ``http://ADDRESS/metrics``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        return str(resp.read().decode())


def histogram(text: str, name: str) -> dict[Labels, Buckets]:
    """Every label set of histogram ``name`` in an exposition text: its cumulative bucket counts."""
    out: dict[Labels, Buckets] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name != f"{name}_bucket":
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            out.setdefault(labels, {})[float(sample.labels["le"])] = float(sample.value)
    return out


def gauge(text: str, name: str) -> float | None:
    """The value of an unlabelled gauge (the first sample named ``name``), ``None`` when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return None


def delta(before: Buckets, after: Buckets) -> Buckets:
    """Bucket counts of the observations between two scrapes (a counter reset counts as a restart)."""
    return {le: (after[le] - before.get(le, 0.0)) if after[le] >= before.get(le, 0.0) else after[le]
            for le in after}


def count(buckets: Buckets) -> float:
    return buckets.get(math.inf, 0.0)


def quantile(q: float, buckets: Buckets) -> float:
    """PromQL's ``histogram_quantile``: linear interpolation inside the bucket holding the rank, the
    lowest bucket starting at 0, the +Inf bucket answered with the highest finite bound; NaN without
    observations."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, 0.0)
    if not bounds or bounds[-1] != math.inf or total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for le in bounds:
        cum = buckets[le]
        if cum >= rank:
            if le == math.inf:
                return bounds[-2] if len(bounds) > 1 else math.nan
            if cum == prev_count:
                return le
            return prev_bound + (le - prev_bound) * (rank - prev_count) / (cum - prev_count)
        prev_bound, prev_count = le, cum
    return math.nan


def label(labels: Labels, key: str) -> str:
    return dict(labels).get(key, "")


@dataclass(frozen=True)
class Link:
    """One measured series: the probing agent's scrape instance, the peer, and bucket rates per second."""

    instance: str
    peer: str
    rates: Mapping[float, float]

    @property
    def median_s(self) -> float:
        return quantile(0.5, dict(self.rates))


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(bound)


def rule_test(links: Iterable[Link], firing: Iterable[tuple[str, str]], *, rules: Path = RULES,
              metric: str = "ftd_agent_peer_rtt_seconds", alert: str = "FtdNetworkLatencyHigh",
              minutes: int = 15, step_s: int = 15, pending_at: str = "4m", firing_at: str = "12m") -> dict[str, object]:
    """A promtool rule-test document: each link's buckets growing at its measured rates for
    ``minutes`` (a sample every ``step_s``), the alert expected pending-only (nothing firing) at
    ``pending_at`` and firing for exactly ``firing`` ((instance, peer) pairs) at ``firing_at``."""
    series = []
    for link in links:
        for bound, rate in sorted(link.rates.items()):
            series.append({
                "series": f'{metric}_bucket{{job="ftd-agent", instance="{link.instance}", peer="{link.peer}", '
                          f'le="{_le(bound)}"}}',
                "values": f"0+{rate * step_s!r}x{minutes * 60 // step_s}"})
    expr = f'count by (instance, peer) (ALERTS{{alertname="{alert}", alertstate="firing"}})'
    expected = [{"labels": f'{{instance="{i}", peer="{p}"}}', "value": 1} for i, p in sorted(set(firing))]
    return {"rule_files": [str(rules)], "evaluation_interval": f"{step_s}s",
            "tests": [{"name": f"{alert} on the chaos matrix's measured rates", "interval": f"{step_s}s",
                       "input_series": series,
                       "promql_expr_test": [{"expr": expr, "eval_time": pending_at, "exp_samples": []},
                                            {"expr": expr, "eval_time": firing_at, "exp_samples": expected}]}]}


def run_promtool(document: Mapping[str, object], path: Path, promtool: str = PROMTOOL,
                 timeout_s: float = 60.0) -> tuple[bool | None, str]:
    """Writes the rule test to ``path`` and runs ``promtool test rules`` on it: (passed, its output);
    passed is ``None`` when promtool is not installed."""
    exe = promtool if Path(promtool).exists() else shutil.which("promtool")
    if exe is None:
        return None, f"promtool not found ({promtool}, PATH); install it with ./install.sh --dev"
    path.write_text(json.dumps(document, indent=1))
    res = subprocess.run([exe, "test", "rules", str(path)], capture_output=True, text=True, timeout=timeout_s)
    return res.returncode == 0, (res.stdout + res.stderr).strip()
