"""What a node's memory report costs the leader (coordinator/memory_ledger.py ``MemoryLedger.take``), per
report and per new snapshot, at the shape of the scale bench: N nodes x K ranks, each node reporting its
ranks' two newest snapshots and its buddy's replicas of them (4K snapshots, 2K new each step).

    python bench/memory_reports.py [--nodes 2000] [--ranks-per-node 8] [--steps 3] [--json]

Reports are decoded from their wire form as the gRPC server hands them over, then taken. The baseline in
the same run is protobuf's own decode of the same reports (``MemoryReport.FromString``), the floor of any
parser; ``take_us_per_report`` includes it. No gRPC, no event loop: the figure is the ledger's share of a
stream message (bench/coordinator_scale.py measures the whole leader).
"""

from __future__ import annotations

import argparse
import time

from _scale_agents import manifest

from ftd.coordinator.memory_ledger import MemoryLedger
from ftd.v1 import coordinator_pb2

from _common import emit


def reports(nodes: int, k: int, step: int) -> list[bytes]:
    """Every node's report at ``step``: its own ranks and its buddy's (the next node), steps step-1 and step."""
    world = nodes * k
    out = []
    for node in range(nodes):
        buddy = (node + 1) % nodes
        snaps = []
        for s in (step - 1, step):
            now = 1000.0 + s  # a manifest is the same in every report holding it
            snaps += [coordinator_pb2.MemorySnapshot(manifest=manifest(s, 1, node * k + r, world, now))
                      for r in range(k)]
            snaps += [coordinator_pb2.MemorySnapshot(manifest=manifest(s, 1, buddy * k + r, world, now),
                                                     replica=True, owner=f"n{buddy}") for r in range(k)]
        out.append(coordinator_pb2.MemoryReport(snapshots=snaps, version=step).SerializeToString())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after two that fill the ledger)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n, k = args.nodes, args.ranks_per_node
    wire = {s: reports(n, k, s) for s in range(2, args.steps + 4)}
    ledger = MemoryLedger()
    for s in (2, 3):
        for node, data in enumerate(wire[s]):
            ledger.take(f"n{node}", "i", coordinator_pb2.MemoryReport.FromString(data))
    measured = range(4, args.steps + 4)
    began = time.perf_counter()
    for s in measured:
        for node, data in enumerate(wire[s]):
            ledger.take(f"n{node}", "i", coordinator_pb2.MemoryReport.FromString(data))
    took = time.perf_counter() - began
    began = time.perf_counter()
    for s in measured:
        for data in wire[s]:
            coordinator_pb2.MemoryReport.FromString(data)
    decode = time.perf_counter() - began
    count = n * len(measured)
    emit({
        "nodes": n, "ranks_per_node": k, "snapshots_per_report": 4 * k, "new_per_report": 2 * k,
        "take_us_per_report": round(took / count * 1e6, 1),
        "take_us_per_new_snapshot": round(took / count / (2 * k) * 1e6, 2),
        "decode_us_per_report": round(decode / count * 1e6, 1),
        "leader_core_share_at_4s_steps": round(took / count * n / 4.0, 3),
    }, args.json)


if __name__ == "__main__":
    main()
