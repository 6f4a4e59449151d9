"""Human-readable output of ftctl's read commands (``--json`` bypasses this module). On a terminal
tables are drawn with rich; piped, they are plain aligned text that ``grep``/``awk`` can read."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import goodput


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    if sys.stdout.isatty():
        return _rich_table(headers, rows)
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _rich_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    t = Table(*headers, header_style="bold")
    for row in rows:
        cells = ["" if c is None else str(c) for c in row]
        bad = any(c in ("dead", "fenced", "MISMATCH") or c.startswith(("invalid", "unrestorable")) for c in cells)
        style = "red" if bad else None
        # Strings come from the cluster (hosts, reasons): shown as text, never read as rich markup.
        t.add_row(*(Text(c) for c in cells), style=style)
    console = Console(width=max(100, Console().width))
    with console.capture() as capture:
        console.print(t)
    return capture.get().rstrip()


def status(s: dict[str, Any]) -> str:
    lines = [
        f"leader:   {s['leader']} ({s['leader_address']})",
        f"epoch:    {s['epoch']}",
        f"world:    {', '.join(f'{r}:{n}' for r, n in enumerate(s['world'])) or '(empty)'}"
        f"  [{len(s['world'])}/{s['target_world_size']} ranks]",
        f"spares:   {', '.join(s['spares']) or 'none'}",
        f"dead:     {', '.join(s['dead']) or 'none'}",
    ]
    for alarm in s.get("etcd_alarms", []):
        lines.append(f"ETCD ALARM: {alarm}")
    for problem in s.get("problems", []):
        lines.append(f"PROBLEM:  {problem}")
    if s.get("draining"):
        lines.append(f"draining: {', '.join(s['draining'])} (planned hand-over pending)")
    if s["suspect"]:
        lines.append(f"suspect:  {', '.join(s['suspect'])}")
    if s["degraded"]:
        lines.append(f"DEGRADED: {s['degraded_reason']}")
    if not s["etcd_reachable"]:
        lines.append("WARNING:  etcd is unreachable; membership changes are on hold")
    for line in s.get("stragglers", []):
        lines.append(f"STRAGGLER: {line}")
    if s.get("stragglers") and s.get("straggler_decision"):
        lines.append(f"straggler action: {s['straggler_decision']}")
    if s.get("rollback_decision"):
        lines.append(f"bad steps: {s['rollback_decision']}")
    lines.append(f"last change: {s['last_change_reason']}")
    job = s.get("job")
    if job:
        state = "CLOSED" if job["closed"] else f"round {job['round']}"
        budget = f"{job['restarts']}/{job['max_restarts']} restarts" + (
            f", {job['rollbacks']} rollback(s)" if job.get("rollbacks") else "")
        spare = f", on_no_spare={job['on_no_spare']}" if job.get("on_no_spare") else ""
        lines.append(f"job:      {job['id']} {state}, {budget}{spare}: {job['message']}")
    if s.get("goodput"):
        lines.append(f"goodput:  {goodput.one_line(s['goodput'])}")
    return "\n".join(lines)


def _why(n: dict[str, Any]) -> str:
    """Why a node is not simply fine: its state's reason, a pending drain, a failing health check."""
    parts = []
    if n["state"] != "alive" or n["state_reason"].startswith("draining"):
        parts.append(n["state_reason"])
    if n.get("healthy") is False:
        parts.append(f"unhealthy: {n['health_reason']}")
    if n.get("slow"):
        parts.append(f"slow: {n['slow']}")
    elif n.get("straggler_reason", "").startswith("straggler"):
        parts.append(n["straggler_reason"])
    return "; ".join(parts)


def nodes(items: Sequence[dict[str, Any]]) -> str:
    rows = [
        (n["node_id"], n["host"], n["pid"], n["role"], n["state"], n["rank"] if n["rank"] >= 0 else "-",
         n["epoch"], f"{n['last_heartbeat_age_s']:.2f}s" if n["last_heartbeat_age_s"] >= 0 else "-",
         n["step"] if n["step"] is not None and n["step"] >= 0 else "-",
         f"{n['straggler_score']:.2f}" if n.get("straggler_score") else "-", _why(n))
        for n in items
    ]
    return table(("NODE", "HOST", "PID", "ROLE", "STATE", "RANK", "EPOCH", "HEARTBEAT", "STEP", "SLOWNESS", "WHY"),
                 rows)


def events(items: Sequence[dict[str, Any]]) -> str:
    rows = [
        (e.get("seq"), time.strftime("%H:%M:%S", time.localtime(float(e.get("at_unix_s", 0)))), e.get("kind"),
         e.get("node_id", ""), e.get("epoch", 0), e.get("message"))
        for e in items
    ]
    return table(("SEQ", "TIME", "KIND", "NODE", "EPOCH", "MESSAGE"), rows)


def drill(r: dict[str, Any]) -> str:
    def secs(value: float | None) -> str:
        return f"{value:.2f}s" if value is not None else "-"

    lines = [
        f"drill:       {r['mode']} on {r['node']} (rank {r['rank'] if r['rank'] >= 0 else 'none: spare'})",
        f"detected:    {secs(r['detected_s'])} after the fault (target {r['target_detect_s']:g}s)",
        f"new epoch:   {r['epoch_before']} -> {r['epoch_after']} at {secs(r['committed_s'])}",
        f"replacement: {r['replacement'] or 'none'}",
    ]
    if r["recovered_s"] is not None or r["resumed_step"] is not None:
        lines += [
            f"training:    last step {r['last_step_before']}, resumed from checkpoint step {r['resumed_step']} "
            f"({r['lost_steps']} steps redone)" + (f" read from {r['resumed_from']}" if r.get("resumed_from") else ""),
            f"recovered:   {secs(r['recovered_s'])} from the fault to the first step in the new world "
            f"(target {r['target_recover_s']:g}s)",
        ]
    lines.append("timeline:")
    lines += [f"  {t:7.2f}s  {what}" for t, what in r["timeline"]]
    lines.append(f"verdict:     {r['verdict']}")
    return "\n".join(lines)


def checkpoints(rows: Sequence[dict[str, Any]]) -> str:
    def yes(v: bool) -> str:
        return "yes" if v else "-"

    def now(r: dict[str, Any]) -> str:
        if "restorable_now" not in r:
            return "-"
        if r["restorable_now"]:
            return "yes"
        missing = r["unreachable_ranks"]
        return f"no: rank(s) {', '.join(map(str, missing))} unreachable" if missing else "no"

    def where(r: dict[str, Any]) -> str:
        sources = r.get("sources") or {}
        return "; ".join(f"{rank}: {', '.join(s[:2]) or '-'}" for rank, s in sorted(sources.items()))

    return table(("JOB", "STEP", "STATUS", "EPOCH", "WORLD", "SIZE", "MEM", "SSD", "HDD", "S3", "RESTORABLE NOW",
                  "FROM (RANK: COPIES)", "CADENCE"), [
        (r["job"], r["step"], r["status"], r["epoch"], r["world_size"], f"{r['bytes'] / 1e6:.1f} MB",
         yes(r["tiers"]["mem"]), yes(r["tiers"]["ssd"]), yes(r["tiers"]["hdd"]), yes(r["tiers"]["s3"]), now(r),
         where(r), r.get("cadence", "")) for r in rows])


def verify(rows: Sequence[dict[str, Any]]) -> str:
    return table(("RANK", "TIER", "LOCATION", "RESULT", "DETAIL"), [
        (r["rank"], r["tier"], r["location"], "ok" if r["ok"] else "MISMATCH" if r.get("checked") else "unchecked",
         r.get("error", "")) for r in rows])
