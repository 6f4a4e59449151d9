"""deploy/grafana/ftd-dashboard.json: an importable dashboard whose every query names metrics ftd exports.

The static tests check the structure Grafana needs (schema version, uid, the data source variable, ids,
layout, targets). The live test starts a real local cluster and checks every metric the dashboard
queries against what the coordinator and the agents actually serve on /metrics. The only other
metrics allowed are NVIDIA DCGM exporter's (EXTERNAL), which the optional manifest
deploy/kubernetes/optional/dcgm-exporter.yaml must be configured to collect.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ftd.ftctl.localcluster import ClusterFile

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "ftd-dashboard.json"
DCGM_MANIFEST = ROOT / "deploy" / "kubernetes" / "optional" / "dcgm-exporter.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = ["Cluster state", "Recovery", "Checkpoints & tiers", "Training", "Network"]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# The metric names ftd exports (the contract the dashboard is written against).
EXPORTED = {
    # coordinator
    "ftd_coordinator_nodes", "ftd_coordinator_heartbeats_received_total", "ftd_coordinator_heartbeat_streams",
    "ftd_coordinator_beacons_accepted_total", "ftd_coordinator_beacons_dropped_total",
    "ftd_coordinator_detection_latency_seconds", "ftd_coordinator_epoch", "ftd_coordinator_world_size",
    "ftd_coordinator_world_target_size", "ftd_coordinator_spares", "ftd_coordinator_epoch_changes_total",
    "ftd_coordinator_nodes_declared_dead_total", "ftd_coordinator_is_leader", "ftd_coordinator_etcd_errors_total",
    "ftd_coordinator_etcd_writes_total", "ftd_coordinator_etcd_commit_duration_seconds",
    "ftd_coordinator_tick_duration_seconds", "ftd_coordinator_detector_stalls_total",
    "ftd_coordinator_recovery_seconds", "ftd_coordinator_recovery_phase_seconds", "ftd_coordinator_job_round",
    "ftd_coordinator_straggler_score", "ftd_coordinator_stragglers", "ftd_coordinator_straggler_replacements_total",
    "ftd_coordinator_step_anomalies_total", "ftd_coordinator_rollbacks_total",
    "ftd_coordinator_fingerprint_checks_total", "ftd_job_goodput_ratio", "ftd_job_lost_seconds_total",
    "ftd_coordinator_job_restarts", "ftd_coordinator_checkpoint_last_valid_step",
    "ftd_coordinator_checkpoint_last_valid_timestamp_seconds", "ftd_coordinator_checkpoint_interval_seconds",
    # agent
    "ftd_agent_heartbeats_sent_total", "ftd_agent_connected", "ftd_agent_reconnects_total", "ftd_agent_epoch",
    "ftd_agent_rank", "ftd_agent_disk_free_bytes", "ftd_agent_gpu_utilization_ratio", "ftd_agent_training_step",
    "ftd_agent_training_steps_total", "ftd_agent_training_loss", "ftd_agent_training_grad_norm",
    "ftd_agent_checkpoint_save_blocked_seconds", "ftd_agent_checkpoint_persist_seconds",
    "ftd_agent_checkpoint_save_in_progress_seconds", "ftd_agent_checkpoint_bytes_written_total",
    "ftd_agent_checkpoint_save_failures_total", "ftd_agent_checkpoint_last_valid_step",
    "ftd_agent_tier_migrations_total", "ftd_agent_tier_errors_total", "ftd_agent_tier_retention_deleted_total",
    "ftd_agent_tier_lag_steps", "ftd_agent_tier_pending_shards", "ftd_agent_checkpoint_save_bytes",
    "ftd_agent_training_mfu_ratio", "ftd_agent_training_mfu_floor_ratio",
    # agent, agent/rtt.py (RttMetrics, on the agent's registry)
    "ftd_agent_peer_rtt_seconds", "ftd_agent_peer_probe_failures_total",
}
HISTOGRAMS = {
    "ftd_coordinator_detection_latency_seconds", "ftd_coordinator_etcd_commit_duration_seconds",
    "ftd_coordinator_tick_duration_seconds", "ftd_coordinator_recovery_seconds",
    "ftd_coordinator_recovery_phase_seconds", "ftd_agent_checkpoint_save_blocked_seconds",
    "ftd_agent_checkpoint_persist_seconds", "ftd_agent_peer_rtt_seconds",
}
# Metrics the live cluster of the test may legitimately not export, and why.
RTT_NOT_WIRED = ("registered by RttMetrics (agent/rtt.py), which the agent daemon does not create yet: the "
                 "RttProber is wired into agent/daemon.py after issue 9 item 4, so the test cluster's agents serve "
                 "no ftd_agent_peer_* family until then")
CONDITIONAL = {
    "ftd_agent_gpu_utilization_ratio": "set only on nodes where NVML finds GPUs (labelled by gpu); the test "
                                       "cluster's agents may have none",
}
# Metrics of other exporters the dashboard may query, and why they can be absent from the live check.
EXTERNAL = {
    "DCGM_FI_DEV_GPU_UTIL": "NVIDIA's dcgm-exporter (deploy/kubernetes/optional/dcgm-exporter.yaml, optional); "
                            "not exported by ftd, and the test cluster runs no DCGM exporter (no GPUs)",
    "DCGM_FI_DEV_XID_ERRORS": "NVIDIA's dcgm-exporter, optional, as DCGM_FI_DEV_GPU_UTIL",
}
# What each row must show (metric names, after stripping histogram suffixes).
ROW_METRICS = {
    "Cluster state": {"ftd_coordinator_is_leader", "ftd_coordinator_epoch", "ftd_coordinator_world_size",
                      "ftd_coordinator_world_target_size", "ftd_coordinator_nodes", "ftd_coordinator_spares",
                      "ftd_coordinator_heartbeats_received_total", "ftd_coordinator_detection_latency_seconds"},
    "Recovery": {"ftd_coordinator_recovery_seconds", "ftd_coordinator_recovery_phase_seconds",
                 "ftd_coordinator_epoch_changes_total", "ftd_coordinator_job_restarts", "ftd_coordinator_job_round",
                 "ftd_job_goodput_ratio", "ftd_job_lost_seconds_total"},
    "Checkpoints & tiers": {"ftd_coordinator_checkpoint_last_valid_step", "ftd_agent_checkpoint_save_blocked_seconds",
                            "ftd_agent_checkpoint_persist_seconds", "ftd_agent_checkpoint_bytes_written_total",
                            "ftd_agent_tier_lag_steps", "ftd_agent_tier_pending_shards",
                            "ftd_agent_checkpoint_save_failures_total", "ftd_agent_tier_retention_deleted_total"},
    "Training": {"ftd_agent_training_steps_total", "ftd_agent_training_loss", "ftd_agent_training_grad_norm",
                 "ftd_agent_gpu_utilization_ratio", "ftd_agent_training_mfu_ratio",
                 "ftd_agent_training_mfu_floor_ratio", "DCGM_FI_DEV_GPU_UTIL"},
    "Network": {"ftd_agent_peer_rtt_seconds", "ftd_agent_peer_probe_failures_total"},
}
METRIC_RE = re.compile(r"\b(?:ftd|DCGM)_[A-Za-z0-9_:]*")
RANGE_FUNCTION_RE = re.compile(r"\b(rate|irate|increase)\(\s*(ftd_[A-Za-z0-9_:]*)")
QUANTILE_RE = re.compile(r"histogram_quantile\(")


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Top-level panels and those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _graph_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in _all_panels(dashboard) if p["type"] != "row"]


def _base(name: str) -> str:
    """A metric name as exported: ``x_bucket`` of histogram ``x`` is ``x``."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def _metrics(exprs: list[str]) -> set[str]:
    return {_base(m) for expr in exprs for m in METRIC_RE.findall(expr)}


def _exprs(panel: dict[str, Any]) -> list[str]:
    return [str(t.get("expr", "")) for t in panel.get("targets", [])]


def _dashboard_metrics() -> set[str]:
    return _metrics([e for p in _graph_panels(_dashboard()) for e in _exprs(p)])


# ---- structure -------------------------------------------------------------------------------------------


def test_dashboard_header() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "ftd-overview"
    assert dashboard["title"].strip()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_panels_have_unique_ids_and_a_place_on_the_grid() -> None:
    panels = _all_panels(_dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    boxes = []
    for p in panels:
        grid = p["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        boxes.append((p["title"], grid))
    for i, (title_a, a) in enumerate(boxes):
        for title_b, b in boxes[i + 1:]:
            overlap = (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                       and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])
            assert not overlap, f"panels {title_a!r} and {title_b!r} overlap"


def test_every_panel_queries_prometheus_through_the_datasource_variable() -> None:
    panels = _graph_panels(_dashboard())
    assert len(panels) >= 20
    for p in panels:
        assert p["datasource"] == DATASOURCE, p["title"]
        targets = p.get("targets", [])
        assert targets, f"{p['title']}: no target"
        for t in targets:
            assert str(t.get("expr", "")).strip(), f"{p['title']}: target {t.get('refId')} has no expr"
            assert t.get("datasource", DATASOURCE) == DATASOURCE, p["title"]
        assert len({t["refId"] for t in targets}) == len(targets), f"{p['title']}: duplicate refIds"


def test_rows_in_order_and_what_each_shows() -> None:
    dashboard = _dashboard()
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ROWS
    # A panel belongs to the last row above it (or to the row that nests it when collapsed).
    starts = [(r["gridPos"]["y"], r["title"]) for r in rows]
    shown: dict[str, set[str]] = {title: set() for title in ROWS}
    for row in rows:
        for p in row.get("panels", []):
            shown[row["title"]] |= _metrics(_exprs(p))
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        above = [title for y, title in starts if y < p["gridPos"]["y"]]
        assert above, f"panel {p['title']!r} is above the first row"
        shown[above[-1]] |= _metrics(_exprs(p))
    for title, needed in ROW_METRICS.items():
        assert not needed - shown[title], f"row {title!r} lacks {sorted(needed - shown[title])}"


def test_queries_use_only_exported_metrics() -> None:
    used = _dashboard_metrics()
    assert not used - EXPORTED - set(EXTERNAL), f"not exported by ftd: {sorted(used - EXPORTED - set(EXTERNAL))}"
    assert set(CONDITIONAL) <= used  # keep the conditional list to names the dashboard really uses
    assert set(EXTERNAL) <= used  # ...and the external one


def _dcgm_counters() -> set[str]:
    """The DCGM fields the optional exporter's ConfigMap tells it to collect."""
    docs = [d for d in yaml.safe_load_all(DCGM_MANIFEST.read_text()) if d]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    collectors = Path(next(e["value"] for e in container["env"] if e["name"] == "DCGM_EXPORTER_COLLECTORS"))
    (mount,) = [m for m in container["volumeMounts"] if collectors.parent == Path(m["mountPath"])]
    volume = next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    csv = config["data"][collectors.name]
    return {line.split(",")[0].strip() for line in csv.splitlines() if line.strip() and not line.startswith("#")}


def test_dcgm_panels_read_what_the_optional_exporter_collects() -> None:
    used = {m for m in _dashboard_metrics() if m.startswith("DCGM_")}
    assert used == set(EXTERNAL)
    counters = _dcgm_counters()
    assert "DCGM_FI_DEV_GPU_UTIL" in counters
    assert used <= counters, f"the optional DCGM exporter does not collect {sorted(used - counters)}"
    for p in _graph_panels(_dashboard()):  # say so on the panel: it is empty without the exporter
        if _metrics(_exprs(p)) & set(EXTERNAL):
            assert "optional" in p["title"].lower() and "dcgm" in p["description"].lower(), p["title"]


def test_gpu_panel_shows_every_gpu() -> None:
    """As FtdGpuUtilizationLow judges them: a node average would hide one idle GPU among eight."""
    exprs = [e for p in _graph_panels(_dashboard()) for e in _exprs(p) if "ftd_agent_gpu_utilization_ratio" in e]
    aggregated_away = re.compile(r"\b(avg|sum|min|max)\b(?!\s*by\s*\([^)]*\bgpu\b)")
    assert exprs and not [e for e in exprs if aggregated_away.search(e)], exprs
    assert not aggregated_away.search("max by (instance, gpu) (ftd_agent_gpu_utilization_ratio)")
    assert aggregated_away.search("avg by (instance) (ftd_agent_gpu_utilization_ratio)")


def test_queries_are_well_formed() -> None:
    for p in _graph_panels(_dashboard()):
        for expr in _exprs(p):
            for open_, close in ("()", "[]", "{}"):
                assert expr.count(open_) == expr.count(close), f"{p['title']}: unbalanced {open_}{close} in {expr}"
            # rate()/increase() only over counters and histogram series, never over a gauge.
            for _, name in RANGE_FUNCTION_RE.findall(expr):
                assert name.endswith(("_total", *HISTOGRAM_SUFFIXES)), f"{p['title']}: rate of gauge {name}"
            # histogram_quantile() needs the _bucket series, aggregated keeping `le`.
            if QUANTILE_RE.search(expr):
                assert "_bucket[" in expr and re.search(r"by \([^)]*\ble\b", expr), f"{p['title']}: {expr}"


def test_rtt_panel_shows_p50_and_p99_per_link_against_the_alert_threshold() -> None:
    """Per link (instance, peer), as FtdNetworkLatencyHigh judges it, with its 50 us drawn as a threshold line."""
    panels = [p for p in _graph_panels(_dashboard())
              if any("ftd_agent_peer_rtt_seconds_bucket" in e for e in _exprs(p))]
    assert len(panels) == 1, [p["title"] for p in panels]
    (panel,) = panels
    exprs = _exprs(panel)
    for quantile in ("0.5", "0.99"):
        assert any(re.search(rf"histogram_quantile\({re.escape(quantile)},\s*sum by \(instance, peer, le\)", e)
                   for e in exprs), (quantile, exprs)
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "s"
    assert defaults["custom"]["thresholdsStyle"]["mode"].startswith("line")
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 50e-6]


def test_rtt_exemption_is_still_needed() -> None:
    """The ftd_agent_peer_* entries of CONDITIONAL hold only while the agent daemon does not register
    RttMetrics: once it does, its scrape serves both families and the live check must cover them."""
    wired = "RttMetrics" in (ROOT / "agent" / "daemon.py").read_text()
    exempt = {name for name, why in CONDITIONAL.items() if why == RTT_NOT_WIRED}
    assert not (wired and exempt), f"agent/daemon.py registers RttMetrics now: drop {sorted(exempt)} from CONDITIONAL"


# ---- the live check --------------------------------------------------------------------------------------


def _scrape(address: str) -> set[str]:
    """Every metric name a /metrics page declares: family names (with a counter's ``_total``) and sample names."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        text = response.read().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        names.update(sample.name for sample in family.samples)
    return names


@pytest.mark.etcd
def test_every_dashboard_metric_is_exported_by_a_live_cluster(local_cluster: ClusterFile) -> None:
    coordinator = _scrape(local_cluster.coordinators[0].info["metrics"])
    agents: set[str] = set()
    for agent in local_cluster.agents:
        agents |= _scrape(agent.info["metrics"])
    used = _dashboard_metrics()
    assert {m for m in used if m.startswith("ftd_coordinator_")} and {m for m in used if m.startswith("ftd_agent_")}
    missing = sorted(m for m in used - set(CONDITIONAL) - set(EXTERNAL)  # ftd_job_*: the leader's, per job
                     if m not in (agents if m.startswith("ftd_agent_") else coordinator))
    assert not missing, f"the dashboard queries metrics the live daemons do not export: {missing}"
