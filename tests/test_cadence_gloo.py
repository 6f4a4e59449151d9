"""The cadence's agreement on a real process group: two ranks (two processes, gloo) that measure
different slowdowns widen to the same interval at the same step and snapshot the same steps, through
``agree_max``'s all-reduce (the timings are recorded figures on a simulated clock: no sleeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ftd.ftctl.etcd_server import free_port

RANK = r"""
import json, os, sys
import torch.distributed as dist
from ftd.training.cadence import CadencePolicy, CadenceTracker, agree_max

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
busy = (5.2, 7.5)[rank]  # rank 1's steps slow down more with snapshot work (e.g. it is the busier buddy)
now = [100.0]
tracker = CadenceTracker(CadencePolicy(persist_every_steps=100000, probe_every_steps=40),
                         lambda values: agree_max(values, world), clock=lambda: now[0], wall=lambda: now[0])
work_until, snapshots, every = -1.0, [], {}
for step in range(0, 121):
    d = tracker.step_end(step, None if work_until > now[0] else max(work_until, 0.0))
    every[step] = tracker.every
    if d.memory or d.persist:
        snapshots.append(step)
        now[0] += 0.05
        tracker.saved(d, 0.05)
        work_until = now[0] + 3.0
    now[0] += busy if work_until > now[0] else 4.73
dist.destroy_process_group()
json.dump({"snapshots": snapshots, "every": every, "reason": tracker.state.reason}, open(sys.argv[1], "w"))
"""


def test_two_gloo_ranks_widen_together_and_snapshot_the_same_steps(tmp_path: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / f"rank{rank}.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["every"] == r1["every"], "the ranks adopted different intervals"
    widened = [int(s) for s, e in r0["every"].items() if e > 1]
    assert widened, f"no widening: {r0['reason']} / {r1['reason']}"
    assert r0["snapshots"] == r1["snapshots"]
    # Rank 0 alone would widen to 2 (+10 %); rank 1 to 8 (+58 %): both use 8 after the widening.
    assert r0["every"]["120"] == 8 and "another rank" in r0["reason"] and "another rank" not in r1["reason"]
    after = [s for s in r0["snapshots"] if s > min(widened)]
    assert after and all(s % 8 == 0 for s in after)
