"""Detection latency of a SIGKILLed (or SIGSTOPped) agent, with a CPU-stress process running.

    python bench/detection.py --trials 20 [--mode kill|stop] [--stress-workers N] [--json]

Each trial kills the agent holding rank 0 by pid and polls the coordinator every 10 ms until the node
is declared dead; the killed agent is then restarted (it rejoins as a spare) for the next trial.
False positives are nodes declared dead that were never killed, read from the coordinator's event log.
Prints {"trials", "p50_s", "p99_s", "max_s", "false_positives", ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

from ftd.client import CoordinatorClient
from ftd.ftctl.localcluster import spawn_agent, stop, up, wait_agent
from ftd.waiting import wait_for

from _common import emit, percentile

GONE = (3, 4)  # NODE_STATE_DEAD, NODE_STATE_FENCED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--mode", choices=("kill", "stop"), default="kill", help="SIGKILL, or SIGSTOP (a hung node)")
    ap.add_argument("--stress-workers", type=int, default=2, help="busy-loop processes during the run (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from chaos_tests.faults import CpuStress  # from the checkout, found through _common's sys.path entry

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-detect-"))
    cluster = up(work, nodes=2, spares=1)
    client = CoordinatorClient(cluster.coordinator_endpoints, timeout_s=5.0)
    stress = CpuStress(workers=args.stress_workers, seconds=args.trials * 15 + 60)
    samples: list[float] = []
    victims: set[str] = set()
    stopped: list[int] = []
    try:
        if args.stress_workers:
            stress.inject()
        for trial in range(args.trials):
            status = client.status()
            victim = status.world[0]
            pid = next(a.pid for a in cluster.agents if a.name == victim)
            victims.add(victim)
            os.kill(pid, signal.SIGKILL if args.mode == "kill" else signal.SIGSTOP)
            if args.mode == "stop":
                stopped.append(pid)
            t0 = time.monotonic()
            wait_for(lambda v=victim: next(n.state for n in client.nodes().nodes if n.node_id == v) in GONE,
                     30, f"{victim} declared dead", interval_s=0.01)
            samples.append(time.monotonic() - t0)
            wait_for(lambda e=status.epoch: client.status().epoch > e, 30, "new epoch")
            if args.mode == "stop":
                os.kill(pid, signal.SIGKILL)
            proc, _, _ = spawn_agent(cluster, victim, "active")
            wait_agent(cluster, victim, proc)
            wait_for(lambda v=victim: v in client.status().spares, 30, f"{victim} back as a spare")
            if not args.json:
                print(f"trial {trial + 1:2d}: {victim} dead after {samples[-1]:.3f}s", flush=True)
        dead_events = [e for e in client.events(1000).events if e.kind == "node_dead"]
        false_positives = sum(1 for e in dead_events if e.node_id not in victims)
        # every kill was one death: more node_dead events than trials means a live node was judged dead
        false_positives += max(0, len(dead_events) - args.trials - false_positives)
    finally:
        stress.recover() if stress.procs else None
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        client.close()
        stop(cluster)
    emit({
        "trials": args.trials, "mode": args.mode, "stress_workers": args.stress_workers,
        "p50_s": percentile(samples, 50), "p99_s": percentile(samples, 99), "max_s": max(samples),
        "min_s": min(samples), "false_positives": false_positives,
        "target_p99_s": 3.0, "meets_target": (percentile(samples, 99) or 99) <= 3.0 and false_positives == 0,
    }, args.json)


if __name__ == "__main__":
    main()
