"""``ftctl drill ... --report FILE.html``: a self-contained page (no scripts, no network) with the
drill's figures and an SVG timeline of kill → detected → new epoch → round → first step."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

_WIDTH, _LEFT, _RIGHT, _ROW = 900, 260, 40, 34
_COLORS = {"kill": "#c0392b", "detect": "#e67e22", "epoch": "#2980b9", "round": "#8e44ad", "step": "#27ae60"}


def _kind(what: str) -> str:
    text = what.lower()
    if "drill on" in text:
        return "kill"
    if "dead" in text or "restarted in round" in text:
        return "detect"
    if "epoch" in text:
        return "epoch"
    if "round" in text:
        return "round"
    return "step"


def timeline_svg(timeline: list[tuple[float, str]], slo_detect: float, slo_recover: float) -> str:
    end = max([t for t, _ in timeline] + [slo_detect, 1.0])
    end = max(end, min(slo_recover, end * 1.2)) * 1.05
    height = _ROW * (len(timeline) + 2)

    def x(t: float) -> float:
        return _LEFT + (_WIDTH - _LEFT - _RIGHT) * t / end

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" role="img" '
             f'aria-label="drill timeline">',
             f'<line x1="{x(0)}" y1="{height - _ROW}" x2="{x(end)}" y2="{height - _ROW}" stroke="#555"/>']
    ticks = max(1, int(end // 5) or 1)
    for i in range(0, int(end) + 1, ticks):
        parts.append(f'<line x1="{x(i):.1f}" y1="{height - _ROW}" x2="{x(i):.1f}" y2="{height - _ROW + 5}" '
                     f'stroke="#555"/><text x="{x(i):.1f}" y="{height - _ROW + 18}" font-size="11" '
                     f'text-anchor="middle">{i}s</text>')
    if slo_detect <= end:
        parts.append(f'<line x1="{x(slo_detect):.1f}" y1="0" x2="{x(slo_detect):.1f}" y2="{height - _ROW}" '
                     f'stroke="#e67e22" stroke-dasharray="4 3"><title>detection SLO {slo_detect:g}s</title></line>')
    for row, (t, what) in enumerate(timeline):
        y = _ROW * (row + 1)
        color = _COLORS[_kind(what)]
        parts.append(f'<text x="{_LEFT - 10}" y="{y + 4}" font-size="12" text-anchor="end">'
                     f'{html.escape(what[:40])}</text>')
        parts.append(f'<rect x="{x(0):.1f}" y="{y - 5}" width="{max(1.0, x(t) - x(0)):.1f}" height="10" '
                     f'fill="{color}" opacity="0.35"/>')
        parts.append(f'<circle cx="{x(t):.1f}" cy="{y}" r="6" fill="{color}"><title>{html.escape(what)} at '
                     f'{t:.2f}s</title></circle>')
        parts.append(f'<text x="{x(t) + 10:.1f}" y="{y + 4}" font-size="12">{t:.2f}s</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(result: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "—"
        return f"{value:.2f} s" if isinstance(value, float) else html.escape(str(value))

    rows = [("node", result["node"]), ("mode", result["mode"]), ("rank", result["rank"]),
            ("detected", result["detected_s"]), ("new epoch", f"{result['epoch_before']} → {result['epoch_after']}"),
            ("replacement", result["replacement"]), ("last step before", result["last_step_before"]),
            ("resumed from step", result["resumed_step"]), ("steps redone", result["lost_steps"]),
            ("recovered", result["recovered_s"])]
    passed = result["passed"]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{cell(v)}</td></tr>" for k, v in rows)
    svg = timeline_svg([(float(t), str(w)) for t, w in result["timeline"]], result["target_detect_s"],
                       result["target_recover_s"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ftd drill: {html.escape(result['node'])}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
.verdict {{ padding: .6em 1em; border-radius: 4px; color: #fff; background: {'#27ae60' if passed else '#c0392b'}; }}
table {{ border-collapse: collapse; margin: 1em 0; }} th, td {{ text-align: left; padding: .3em 1em; }}
th {{ color: #555; font-weight: normal; }} tr:nth-child(odd) {{ background: #f5f5f5; }}
</style></head><body>
<h1>ftd drill — {html.escape(result['mode'])} on {html.escape(result['node'])}</h1>
<p class="verdict" id="verdict">{html.escape(result['verdict'])}</p>
<p>SLOs: detection ≤ {result['target_detect_s']:g} s, recovery ≤ {result['target_recover_s']:g} s.
Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.</p>
<table id="figures">{table}</table>
<h2>Timeline</h2>
<figure id="timeline">{svg}<figcaption>seconds after the fault; dashed line: detection SLO</figcaption></figure>
</body></html>
"""


def write(result: dict[str, Any], path: Path) -> Path:
    path.write_text(render(result))
    return path
