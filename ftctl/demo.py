"""``ftctl demo``: the README's main command. Starts a local cluster on the embedded default (etcd
started for you, local directories as tiers), shows it, kills a node for real, shows the recovery
timeline, and tears everything down."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ftd.coordinator.client import CoordinatorClient

from . import drill, localcluster


def run_demo(workdir: Path | None, nodes: int = 2, spares: int = 1, keep: bool = False,
             say: Any = print) -> dict[str, Any]:
    """Returns ``{"drill", "status_before", "status_after", "timeline", "workdir"}``."""
    from .cli import node_dict, status_dict  # the CLI owns the JSON shapes

    temp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="ftd-demo-")) if workdir is None else workdir
    started = time.monotonic()
    timeline: list[tuple[float, str]] = []

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - started, 3), what))
        say(f"[{timeline[-1][0]:7.2f}s] {what}")

    mark(f"starting etcd, a coordinator, {nodes} active + {spares} spare agents in {work}")
    cluster = localcluster.up(work, nodes, spares)
    client = CoordinatorClient(cluster.coordinator_endpoints)
    try:
        before = status_dict(client.status())
        mark(f"cluster formed: epoch {before['epoch']}, world {before['world']}, spares {before['spares']}")
        victim = before["world"][-1]
        mark(f"drill: killing {victim} (rank {len(before['world']) - 1}) for real through its agent")
        result = drill.kill_node(client, victim, cluster.drill_token)
        if result.detected_s is not None:
            mark(f"{victim} declared dead {result.detected_s:.2f}s after the kill")
        if result.replacement:
            mark(f"{result.replacement} promoted into rank {result.rank}; epoch "
                 f"{result.epoch_before} -> {result.epoch_after} at {result.committed_s:.2f}s")
        after = status_dict(client.status())
        nodes_after = [node_dict(n) for n in client.nodes().nodes]
        mark(f"verdict: {result.verdict}")
        return {"drill": result.as_dict(), "status_before": before, "status_after": after,
                "nodes_after": nodes_after, "timeline": timeline, "workdir": str(work)}
    finally:
        client.close()
        if not keep:
            localcluster.stop(cluster)
            mark("cluster stopped")
            if temp:
                shutil.rmtree(work, ignore_errors=True)
