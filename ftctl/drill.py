"""``ftctl drill``: break a node for real through its agent and measure the whole recovery.

Modes: ``node`` (SIGKILL of the training workers, then of the agent), ``worker`` (SIGKILL of one
training process), ``hang`` (SIGSTOP of the training workers; the agent stays up and its hang
detection must find them).

The clock starts when the agent acknowledges (it acts before answering; for ``node`` the agent dies
50 ms later), so the figures are, if anything, slightly pessimistic. Training progress comes from the
agent of the failed rank's node in the new world (its workers' ``report_step``), with the agents' wall
clocks: on one host exact, across hosts as good as their clock sync. ``resumed_step`` is what the new
world *restored*, as its Checkpointer reported it to that agent (``Progress.restored``), not what
the catalog offered: a drill fails when the job restarted from scratch or from a step older than the
catalog's restore target at the new epoch, and ``lost_steps`` (the last step before the failure less
the resumed one) is never negative. The drill follows the
coordinator's event log (``ListEvents`` after a sequence number, nearly free when nothing happened)
and reads the status only when an event arrives: at 2,000 nodes a 50 ms poll of the node list is
not. The outcome is a pure function of the measurements (:func:`verdict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from ftd import rpc
from ftd.client import CoordinatorClient
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import agent_pb2, agent_pb2_grpc, checkpoint_pb2, cluster_pb2

_GONE = (cluster_pb2.NODE_STATE_DEAD, cluster_pb2.NODE_STATE_FENCED)
_DEATHS = ("node_dead", "node_handed_over")  # the events of a node fenced out (coordinator.placement)
MODES = {"node": agent_pb2.KillRequest.NODE, "worker": agent_pb2.KillRequest.WORKER,
         "hang": agent_pb2.KillRequest.HANG}


class DrillError(RuntimeError):
    pass


@dataclass
class DrillResult:
    node: str
    mode: str
    rank: int
    detected_s: float | None
    replacement: str | None
    epoch_before: int
    epoch_after: int
    committed_s: float | None
    last_step_before: int | None
    resumed_step: int | None
    lost_steps: int | None
    recovered_s: float | None
    target_detect_s: float
    target_recover_s: float
    verdict: str
    passed: bool
    timeline: list[tuple[float, str]] = field(default_factory=list)
    handover_s: float | None = None  # preempt: from the notice to the new world committed
    restarts_before: int | None = None  # the job's restart budget use before and after the drill
    restarts_after: int | None = None
    restore_target_step: int | None = None  # the catalog's restore target when the new world was committed
    resumed_from: str = ""  # the copy (or copies) the new world read, as its Checkpointer reported

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lost_steps(last_step_before: int | None, resumed_step: int | None) -> int | None:
    """Steps run before the failure that the new world runs again: never negative (a snapshot may be
    newer than the last progress report read before the drill); from scratch (-1) all of them."""
    if last_step_before is None or resumed_step is None:
        return None
    return max(0, last_step_before - resumed_step)


def restored_since(progress: cluster_pb2.Progress | None, round_unix_s: float,
                   epoch_after: int = -1) -> cluster_pb2.Restored | None:
    """The restore a node's progress reports, when it is the new world's: reported after the round
    began, or by the new epoch (``epoch_after``; clocks of other hosts may lag the coordinator's)."""
    if progress is None or not progress.HasField("restored"):
        return None
    r = progress.restored
    return r if r.at_unix_s >= round_unix_s or (epoch_after >= 0 and r.epoch >= epoch_after > 0) else None


def verdict(mode: str, detected_s: float | None, target_s: float, was_active: bool, replacement: str | None,
            epoch_before: int, epoch_after: int, spares_before: int, training: bool, recovered_s: float | None,
            target_recover_s: float, restore_target: int | None = None,
            resumed_step: int | None = None) -> tuple[bool, str]:
    """Pass/fail with the reason, from the measurements alone. ``restore_target``: the catalog's
    target when the new world was committed (-1: none); ``resumed_step``: what the new world
    restored (-1: nothing; ``None``: not reported)."""
    if detected_s is None:
        return False, "fail: the failure was not detected before the drill timed out"
    if detected_s > target_s:
        return False, f"fail: detected after {detected_s:.2f}s, target {target_s:g}s"
    if mode != "worker" and was_active and epoch_after <= epoch_before:
        return False, "fail: no new epoch was committed for the failed active node"
    if mode != "worker" and was_active and spares_before > 0 and replacement is None:
        return False, "fail: a spare was available but none took the failed node's rank"
    if training and recovered_s is None:
        return False, "fail: training did not complete a step in the new world before the drill timed out"
    if training and recovered_s is not None and recovered_s > target_recover_s:
        return False, f"fail: training recovered after {recovered_s:.1f}s, target {target_recover_s:g}s"
    if training and resumed_step is not None and restore_target is not None and restore_target >= 0:
        if resumed_step < 0:
            return False, (f"fail: the job restarted from scratch although step {restore_target} was restorable "
                           "(see the training log for why it restored nothing)")
        if resumed_step < restore_target:
            return False, (f"fail: the job restarted from step {resumed_step}, older than the restore target "
                           f"step {restore_target}")
    detail = f"detected in {detected_s:.2f}s (target {target_s:g}s)"
    if mode != "worker" and was_active:
        detail += f"; {replacement} took the rank" if replacement else "; no spare: the world shrank"
    if training and recovered_s is not None:
        detail += f"; training recovered in {recovered_s:.1f}s (target {target_recover_s:g}s)"
        detail += (f", resumed from step {resumed_step}" if resumed_step is not None and resumed_step >= 0
                   else ", from scratch (no checkpoint was restorable)" if resumed_step is not None
                   else " (the job reports no restore: not an ftd Checkpointer job?)")
    return True, f"pass: {detail}"


def _progress(client: CoordinatorClient, world: list[str]) -> list[tuple[int, float]]:
    return [(n.progress.step, n.progress.reported_unix_s) for n in client.nodes().nodes
            if n.node_id in world and n.HasField("progress") and n.progress.step >= 0]


def _newest_seq(client: CoordinatorClient) -> int:
    newest = client.events(1).events
    return newest[0].seq if newest else 0


class _Stepping:
    """Training progress of one node of the new world, read from its agent: every rank steps in
    lockstep, so one tells whether the world trains again, and the coordinator is not asked for the
    whole node list each tick."""

    def __init__(self, client: CoordinatorClient, addresses: dict[str, str]) -> None:
        self.client, self.addresses = client, addresses
        self._channel: grpc.Channel | None = None
        self._node = ""

    def latest(self, node_id: str) -> cluster_pb2.Progress | None:
        if node_id != self._node:
            self.close()
            if node_id not in self.addresses:  # registered after the drill began: one read of the list
                self.addresses.update({n.node_id: n.agent_address for n in self.client.nodes().nodes})
            address = self.addresses.get(node_id, "")
            if not address:
                return None
            self._channel, self._node = rpc.agent_channel(address, node_id, self.client.tls), node_id
        assert self._channel is not None
        try:
            info = agent_pb2_grpc.AgentStub(self._channel).GetInfo(agent_pb2.GetInfoRequest(), timeout=2.0)
        except grpc.RpcError:
            return None  # not up yet, or restarting: asked again next tick
        return info.progress if info.HasField("progress") else None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._node = None, ""


def run(client: CoordinatorClient, node_id: str, token: str = "", mode: str = "node", target_detect_s: float = 3.0,
        target_recover_s: float = 60.0, timeout_s: float = 180.0, reason: str = "ftctl drill",
        inject: Callable[[], None] | None = None) -> DrillResult:
    """Breaks ``node_id`` and measures the recovery, watching the coordinator's event log (the events
    after the newest one before the drill): the status is read again only when an event arrives, and
    the node list never in the loop. ``inject``: breaks the node another way than through its agent
    (a network partition from the lab, which no agent can do to itself); ``mode`` says what the
    failure amounts to (``node``: the node is lost)."""
    if mode not in MODES:
        raise DrillError(f"unknown drill mode {mode!r}; one of {', '.join(MODES)}")
    status = client.status()
    nodes = {n.node_id: n for n in client.nodes().nodes}
    if node_id not in nodes:
        raise DrillError(f"node {node_id!r} is not registered; known nodes: {', '.join(sorted(nodes)) or 'none'}")
    node = nodes[node_id]
    if node.state in _GONE:
        raise DrillError(f"node {node_id} is already {cluster_pb2.NodeState.Name(node.state)}; nothing to break")
    if not node.agent_address:
        raise DrillError(f"node {node_id} registered no agent address; cannot reach its agent")
    world_before = list(status.world)
    rank = world_before.index(node_id) if node_id in world_before else -1
    epoch_before, spares_before, round_before = status.epoch, len(status.spares), status.job_round
    job = status.job if status.job and not status.job_closed else ""
    steps_before = _progress(client, world_before) if job else []
    last_step_before = max((s for s, _ in steps_before), default=None)
    seq = _newest_seq(client)  # before the drill: every event it causes comes after

    # The operator certificate of the client authorises the drill (the agent's authorization table);
    # a token is only sent to agents that want one as a second factor.
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    if inject is not None:
        inject()
    else:
        with rpc.agent_channel(node.agent_address, node.node_id, client.tls) as channel:
            try:
                agent_pb2_grpc.AgentStub(channel).Kill(agent_pb2.KillRequest(reason=reason, mode=MODES[mode]),
                                                       timeout=5.0, metadata=metadata)
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                raise DrillError(f"agent of {node_id} at {node.agent_address} refused the drill: "
                                 f"{code.name if code else '?'} {rpc_details(exc)}") from exc
    t0 = time.monotonic()
    timeline: list[tuple[float, str]] = [(0.0, f"{mode} drill on {node_id} (rank {rank})")]

    def mark(what: str) -> float:
        elapsed = round(time.monotonic() - t0, 3)
        timeline.append((elapsed, what))
        return elapsed

    deadline = t0 + timeout_s
    detected_s = committed_s = recovered_s = None
    replacement: str | None = None
    epoch_after = epoch_before
    restore_target: int | None = None  # the catalog's, once the new world is committed
    resumed: cluster_pb2.Restored | None = None  # what the new world restored, as it reported
    round_start = 0.0
    stale = 0  # ticks left that read the status again: the one an event arrived in, and two more (the
    # leader applies a commit to its view right after the etcd write the event came with)
    stepping = _Stepping(client, {n.node_id: n.agent_address for n in nodes.values()})
    try:
        while time.monotonic() < deadline:
            events = client.events_after(seq, deadline_s=max(0.5, deadline - time.monotonic()))
            if events:
                seq, stale = events[-1].seq, 3
            if detected_s is None and mode != "worker" and any(
                    e.kind in _DEATHS and e.node_id == node_id for e in events):
                detected_s = mark(f"{node_id} declared dead")
            if stale:
                status, stale = client.status(deadline_s=max(0.5, deadline - time.monotonic())), stale - 1
            if detected_s is None and mode == "worker" and status.job_round > round_before:
                detected_s = mark(f"job {job} restarted in round {status.job_round}: {status.job_message}")
            settled = mode == "worker" or rank < 0 or status.epoch > epoch_before
            if detected_s is not None and committed_s is None and settled:
                epoch_after = status.epoch
                committed_s = (mark(f"epoch {status.epoch} committed: world {list(status.world)}")
                               if status.epoch > epoch_before else detected_s)
                if 0 <= rank < len(status.world) and status.world[rank] not in world_before:
                    replacement = status.world[rank]  # a newcomer at the rank, not a shifted survivor
            if committed_s is not None and not job:
                break
            if committed_s is not None and restore_target is None:
                target = client.call("GetRestoreTarget", checkpoint_pb2.GetRestoreTargetRequest(job=job),
                                     idempotent=True)
                restore_target = target.checkpoint.step if target.found else -1
            if restore_target is not None and status.job_round > round_before and not round_start:
                round_start = status.job_round_unix_s
                mark(f"round {status.job_round} formed")
            if round_start and restore_target is not None and status.world:
                watched = status.world[rank] if 0 <= rank < len(status.world) else status.world[0]
                latest = stepping.latest(watched)
                if resumed is None and (resumed := restored_since(
                        latest, round_start, epoch_after if mode != "worker" else -1)) is not None:
                    mark(f"the new world restored step {resumed.step} ({resumed.source})" if resumed.step >= 0
                         else f"the new world restored nothing ({resumed.source})")
                floor = resumed.step if resumed is not None else restore_target
                if latest is not None and latest.reported_unix_s > round_start and latest.step > floor:
                    recovered_s = mark(f"training steps again in the new world (step {latest.step})")
                    break
            time.sleep(0.05)
    finally:
        stepping.close()
    resumed_step = resumed.step if resumed is not None else None
    lost = lost_steps(last_step_before, resumed_step)
    ok, why = verdict(mode, detected_s, target_detect_s, rank >= 0, replacement, epoch_before, epoch_after,
                      spares_before, bool(job), recovered_s, target_recover_s, restore_target, resumed_step)
    return DrillResult(node_id, mode, rank, detected_s, replacement, epoch_before, epoch_after, committed_s,
                       last_step_before, resumed_step, lost, recovered_s, target_detect_s, target_recover_s, why, ok,
                       timeline, restore_target_step=restore_target,
                       resumed_from=resumed.source if resumed is not None else "")
