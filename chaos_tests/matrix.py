"""The chaos matrix: every scenario on an isolated cluster of its own with a real training job.

    python -m chaos_tests.matrix [--only NAME[,NAME...]] [--json] [--workdir DIR] [--keep] [--list]

prints ``[{"scenario", "passed", "seconds", "detail", "invariants": {name: bool}}]`` with ``--json``
(a table otherwise) and exits 0 only when every scenario passed. Needs root (network namespaces,
nftables; :mod:`ftd.netlab`): without it, a clear error and exit 2.

How one scenario runs: this process (in the root namespace) creates the scenario's network lab, one
host per etcd member, coordinator replica, node (and S3 server), plus ``ctl``; it then re-executes
itself inside ``ctl`` (``--inside NAME``), where gRPC reaches every host. That half starts the cluster
(``ftctl up --isolate``'s code), trains the demo DDP job on the warm path, injects the fault, lets
the cluster recover, ends the job at a finish line, checks the invariants (:func:`.scenario.judge`)
and prints one JSON line. Back here the lab is torn down and proven gone (no namespace, veth, nft
table or process of its prefix), which is one more invariant: ``nothing_left_behind``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ftd import netlab
from ftd.ftctl import isolated

from . import invariants
from .scenario import Context, Scenario, judge
from .scenarios_data import SCENARIOS as DATA
from .scenarios_network import SCENARIOS as NETWORK
from .scenarios_process import SCENARIOS as PROCESS
from .scenarios_storage import SCENARIOS as STORAGE
from .scenarios_training import SCENARIOS as TRAINING

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [*PROCESS, *NETWORK, *STORAGE, *DATA, *TRAINING]}
ENV_INSIDE = "FTD_CHAOS_INSIDE"


def select(only: str | None) -> list[Scenario]:
    if not only:
        return list(SCENARIOS.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"chaos matrix: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return [SCENARIOS[n] for n in names]


def run_inside(scenario: Scenario, workdir: Path) -> dict[str, Any]:
    """The ctl-namespace half: cluster, fault, recovery, finish, invariants."""
    started = time.monotonic()
    with Context.started(workdir, scenario.shape, prepare=scenario.prepare) as ctx:
        outcome = scenario.run(ctx)
        line = ctx.finish()
        checks = judge(ctx, outcome, line)
    passed, table, failing = invariants.summary(checks)
    detail = outcome.detail + (f"; FAILED: {failing}" if failing else "")
    return {"scenario": scenario.name, "passed": passed, "seconds": round(time.monotonic() - started, 1),
            "detail": detail, "invariants": table, "checks": {c.name: c.detail for c in checks}}


def run_one(scenario: Scenario, root: Path, keep: bool = False) -> dict[str, Any]:
    """The root half: the lab, the re-executed scenario, the teardown and its proof."""
    work = root / scenario.name
    work.mkdir(parents=True, exist_ok=True)
    cluster_dir = work / "cluster"
    started = time.monotonic()
    result: dict[str, Any] = {"scenario": scenario.name, "passed": False, "detail": "", "invariants": {}}
    log = work / "scenario.log"
    iso = isolated.prepare(cluster_dir, scenario.shape.hosts())
    prefix = iso["prefix"]
    try:
        env = {**os.environ, isolated.ENV_INSIDE: iso["ctl"], ENV_INSIDE: "1"}
        argv = isolated.wrap(iso, isolated.CTL, [sys.executable, "-m", "chaos_tests.matrix", "--inside",
                                                  scenario.name, "--workdir", str(work)])
        with log.open("ab") as err:
            try:
                proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, env=env, timeout=scenario.timeout_s,
                                      cwd=Path(__file__).resolve().parent.parent)
                out = proc.stdout.decode(errors="replace").strip().splitlines()
                if proc.returncode == 0 and out:
                    result = json.loads(out[-1])
                else:
                    result["detail"] = f"exited {proc.returncode}: {_tail(log)}"
            except subprocess.TimeoutExpired:
                result["detail"] = f"timed out after {scenario.timeout_s:g}s: {_tail(log)}"
    finally:
        if not keep:
            isolated.teardown(cluster_dir)
    left = [] if keep else netlab.leftovers(prefix)
    result.setdefault("invariants", {})["nothing_left_behind"] = not left
    if left:
        result["passed"] = False
        result["detail"] += f"; left behind: {left}"
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"


def render(results: list[dict[str, Any]]) -> str:
    lines = [f"{'scenario':26} {'result':6} {'seconds':>7}  detail"]
    for r in results:
        bad = [k for k, ok in r.get("invariants", {}).items() if not ok]
        lines.append(f"{r['scenario']:26} {'pass' if r['passed'] else 'FAIL':6} {r.get('seconds', 0):7.1f}  "
                     f"{r['detail'][:160]}" + (f" [broken: {', '.join(bad)}]" if bad else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ftd's chaos matrix: fault scenarios on isolated clusters")
    ap.add_argument("--only", help="comma-separated scenario names (default: all)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--workdir", type=Path, help="where clusters and logs go (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="leave the last lab running (debugging)")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--inside", metavar="NAME", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:26} {s.summary}")
        return 0
    if args.inside:
        try:
            result = run_inside(SCENARIOS[args.inside], args.workdir)
        except Exception as exc:  # reported as the scenario's failure, with where it broke
            traceback.print_exc()
            result = {"scenario": args.inside, "passed": False, "detail": f"{type(exc).__name__}: {exc}",
                      "invariants": {}}
        print(json.dumps(result), flush=True)
        return 0
    chosen = select(args.only)
    try:
        netlab.check_privileges()
    except netlab.MissingPrivileges as exc:
        print(f"chaos matrix: {exc}", file=sys.stderr)
        return 2
    root = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="ftd-chaos-"))
    results = []
    for scenario in chosen:
        print(f"chaos matrix: {scenario.name} ...", file=sys.stderr, flush=True)
        results.append(run_one(scenario, root, keep=args.keep))
        print(f"chaos matrix: {scenario.name} {'passed' if results[-1]['passed'] else 'FAILED'} in "
              f"{results[-1]['seconds']}s: {results[-1]['detail'][:300]}", file=sys.stderr, flush=True)
    if args.workdir is None and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else render(results))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
