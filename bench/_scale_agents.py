"""Simulated agents for ``bench/coordinator_scale.py``: asyncio tasks over real gRPC (and UDP), each
speaking the agent's protocol the way ``agent/heartbeat.py`` does, in one of two shapes:

* ``rpc`` (the path before issue 19): a heartbeat on the stream every 1/hz s with the training progress,
  and every step, per rank, a ``CommitShard(tier="mem")`` for the node's own ranks and a
  ``RecordCopy(tier="mem")`` for each rank of the nodes it mirrors (the buddy's replica), one unary RPC each.
* ``beacons`` (issue 19): liveness as UDP beacons (ftd/beacons.py) every 1/hz s, and one stream message
  per step carrying the progress and the node's whole memory tier (``HeartbeatRequest.memory``); a probe
  is answered on the stream at once.

Each simulated node follows the leader: when its stream ends it tries the next coordinator replica
(a new stream's first message carries the full memory report, as a real agent's does).
"""

from __future__ import annotations

import asyncio
import functools
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from ftd import rpc
from ftd.client import next_endpoint
from ftd.identity import IdentityFiles
from ftd.v1 import checkpoint_pb2, cluster_pb2, coordinator_pb2, coordinator_pb2_grpc

JOB = "bench"
OPTIONS = [("grpc.max_concurrent_streams", 100_000), *rpc.NEVER_IDLE]
SHARD_BYTES = 2 << 30  # a DCP shard of a 16k-GPU job: ~2 GiB per rank
# The simulated job is unmanaged (no ftd rendezvous) and does not restart when a node dies: it saves in
# the epoch it started in, so a dead node's ranks stay restorable from its buddy's replicas (a real job
# would restart in the new epoch and save every rank again).
JOB_EPOCH = 0


@dataclass
class Plan:
    """What every simulated node of one run does (picklable: it crosses into the worker processes)."""

    endpoints: list[str]
    hz: float
    path: str                  # "rpc" or "beacons"
    ranks_per_node: int
    memory: bool
    step_s: float
    n: int
    start_at: float
    kill_at: float
    stop_at: float
    victims: dict[str, str]
    spares: set[str]
    pki_dir: str | None
    keepalive_s: float = 5.0
    window: tuple[float, float] = (0.0, 0.0)  # the measured window (unix s): errors in it count as saturation
    warm: bool = True          # connect the other replicas' channels once answered (a real agent does)


@dataclass
class _Tally:
    died: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    window: tuple[float, float] = (0.0, 0.0)
    in_window: dict[str, int] = field(default_factory=dict)  # kinds of the errors in the measured window
    sent: dict[str, int] = field(default_factory=dict)
    up: dict[str, list[float]] = field(default_factory=dict)  # node -> when each of its streams was first answered

    def count(self, phase: str, exc: BaseException) -> None:
        self.errors += 1
        code = rpc.rpc_code(exc)
        key = f"{phase}:{code.name if code else type(exc).__name__}"
        if key not in self.kinds:  # the first of each kind, with its details
            print(f"simulated agent {phase} failed: {rpc.describe(exc)}"[:400], file=sys.stderr)
        self.kinds[key] = self.kinds.get(key, 0) + 1
        if self.window[0] <= time.time() <= self.window[1]:
            self.in_window[key] = self.in_window.get(key, 0) + 1

    def sent_one(self, what: str, k: int = 1) -> None:
        self.sent[what] = self.sent.get(what, 0) + k


def index_of(node_id: str) -> int:
    return int(node_id.rsplit("-", 1)[1])


def trainers(plan: Plan) -> dict[str, int]:
    """The nodes that train -> their position: node p holds ranks p*K .. p*K+K-1. Not the spares, and
    not the nodes that will die: a real job stops at a death and restarts in a new world, which the
    simulation does not model, so the simulated job's ranks all live through the run."""
    ids = sorted(f"sim-{i:05d}" for i in range(plan.n))
    return {node: p for p, node in enumerate(n for n in ids if n not in plan.spares and n not in plan.victims)}


@functools.lru_cache(maxsize=65_536)
def manifest(step: int, epoch: int, rank: int, world: int, now: float) -> checkpoint_pb2.ShardManifest:
    """A DCP shard's manifest as a rank's snapshot writes it (its data file and its signature). Built
    once per process (the owner's report and its buddy's replica hold the same one; a report copies it)."""
    crc = f"{(step * 7919 + rank * 104729) & 0xFFFFFFFF:08x}"
    return checkpoint_pb2.ShardManifest(
        job=JOB, step=step, epoch=epoch, rank=rank, world_size=world, format="dcp", created_unix_s=now,
        files=[checkpoint_pb2.ShardFile(name=f"__{rank}_0.distcp", size=SHARD_BYTES, crc32c=crc),
               checkpoint_pb2.ShardFile(name="SHARD.sig", size=1400, crc32c=crc[::-1])])


def backoff_s(attempt: int, max_s: float = 1.0) -> float:
    """The agent's reconnect backoff (agent/heartbeat.py: tenacity's ``wait_exponential_jitter(initial=0.05,
    max=reconnect_max_backoff_s, jitter=0.1)``, 1 s by default): after a leader's death 2,000 agents try
    again at that pace, not all at once every few hundred milliseconds."""
    return min(max_s, 0.05 * 2 ** attempt) + random.uniform(0, 0.1)


class _Node:
    def __init__(self, plan: Plan, node_id: str, tally: _Tally, udp: socket.socket,
                 positions: dict[str, int], by_key: dict[int, _Node] | None = None) -> None:
        self.plan, self.node_id, self.tally, self.udp = plan, node_id, tally, udp
        self.by_key = by_key if by_key is not None else {}  # the process's nodes by their stream's beacon key id
        self.inc = f"sim-{node_id}"
        self.idx = index_of(node_id)
        self.k = plan.ranks_per_node
        self.position = positions
        self.world = len(positions) * plan.ranks_per_node
        self.epoch = 0
        self.mirrors: list[str] = []
        self.target: Any = None  # the stream's BeaconTarget
        self.confirmed = False  # the leader has answered with a beacon it accepted (the stream may go quiet)
        self.probed = asyncio.Event()
        self.beacon_seq = 0
        self.dead = False
        self.echo: tuple[int, float] = (0, -1e18)  # the leader's newest echo: (seen, time.time())
        self.report_version = 0
        self.report: tuple[int, coordinator_pb2.MemoryReport] | None = None  # (step, the report built for it)
        self.endpoint = self.idx % len(plan.endpoints)
        self.channels: dict[int, aio.Channel] = {}
        self.pending: set[asyncio.Task[None]] = set()

    def _stub(self, endpoint: int | None = None) -> coordinator_pb2_grpc.CoordinatorStub:
        """A channel per replica, kept (as ftd.client does): moving to another replica costs no new
        TLS handshake when its channel is up already."""
        endpoint = self.endpoint if endpoint is None else endpoint
        channel = self.channels.get(endpoint)
        if channel is None:
            tls = IdentityFiles(Path(self.plan.pki_dir), "node", self.node_id) if self.plan.pki_dir else None
            channel = self.channels[endpoint] = rpc.aio_channel(self.plan.endpoints[endpoint], OPTIONS, tls=tls)
        return coordinator_pb2_grpc.CoordinatorStub(channel)

    def _warm(self) -> None:
        """The other replicas' channels connected now, as a real agent's once its stream is answered
        (``CoordinatorClient.warm``): a failover then moves the stream over a connection already up."""
        for endpoint in range(len(self.plan.endpoints)):
            if endpoint != self.endpoint:
                self._stub(endpoint)
                self.channels[endpoint].get_state(try_to_connect=True)

    async def _next_endpoint(self) -> None:
        """As ``CoordinatorClient.follow`` with no leader named: the next replica whose channel is not
        in TRANSIENT_FAILURE (a dead one refuses connections)."""
        endpoints = self.plan.endpoints
        broken = {endpoints[i] for i, ch in self.channels.items()
                  if ch.get_state() in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)}
        self.endpoint = endpoints.index(next_endpoint(endpoints, endpoints[self.endpoint], broken))

    def step(self, now: float) -> int:
        return max(0, int((now - self.plan.start_at) / self.plan.step_s))

    def memory_report(self, step: int, now: float) -> coordinator_pb2.MemoryReport:
        """The node's memory tier: its ranks' two newest snapshots, and those of the nodes it mirrors.
        A snapshot's manifest is the same in every report that holds it (a real agent keeps what it
        announced, agent/memory_report.py): created when its step began, not at each report. Built once
        per step, as a real agent's inventory changes only with a snapshot (a stream re-opened within the
        step sends the same report, version and all)."""
        if self.report is not None and self.report[0] == step:
            return self.report[1]
        snaps = []
        for s in (step - 1, step):
            if s < 1:
                continue
            now = self.plan.start_at + s * self.plan.step_s
            for r in range(self.k if self.node_id in self.position else 0):
                snaps.append(coordinator_pb2.MemorySnapshot(
                    manifest=manifest(s, JOB_EPOCH, self.position[self.node_id] * self.k + r, self.world, now)))
            for m in (x for x in self.mirrors if x in self.position):
                for r in range(self.k):
                    snaps.append(coordinator_pb2.MemorySnapshot(
                        manifest=manifest(s, JOB_EPOCH, self.position[m] * self.k + r, self.world, now),
                        replica=True, owner=m))
        self.report_version += 1
        report = coordinator_pb2.MemoryReport(snapshots=snaps, version=self.report_version)
        self.report = (step, report)
        return report

    async def run(self) -> None:
        plan = self.plan
        role = cluster_pb2.ROLE_SPARE if self.node_id in plan.spares else cluster_pb2.ROLE_ACTIVE
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                await self._stub().Register(coordinator_pb2.RegisterRequest(
                    node_id=self.node_id, host="127.0.0.1", role=role, agent_address="127.0.0.1:1", pid=1,
                    incarnation=self.inc), timeout=30)
                break
            except grpc.RpcError as exc:
                self.tally.count("register", exc)
                await self._next_endpoint()
                await asyncio.sleep(0.5)
        await asyncio.sleep(random.random() / plan.hz)  # spread the phases
        attempt = 0
        while time.time() < plan.stop_at:
            ended = await self._stream()
            if ended == "done":
                return
            await self._next_endpoint()
            attempt = 0 if self.answered else attempt + 1
            await asyncio.sleep(backoff_s(attempt))

    answered = False  # the last stream got an answer (the agent's backoff starts over)

    async def _stream(self) -> str:
        """One heartbeat stream, until it fails ("retry"), the node dies or the run ends ("done")."""
        plan = self.plan
        call = self._stub().Heartbeat()
        self.answered = False
        self.target = None
        self.confirmed = False
        self.echo = (0, -1e18)
        self.probed.clear()
        reader = asyncio.create_task(self._read(call))
        seq = 0
        mode = plan.victims.get(self.node_id)
        beacons = plan.path == "beacons"
        last_step, last_stream = -1, 0.0
        first = True
        began, ticks = time.time(), 0
        try:
            while time.time() < plan.stop_at:
                now = time.time()
                if mode and now >= plan.kill_at:
                    self.dead = True  # its beacons stop with it
                    self.tally.died[self.node_id] = now
                    if mode == "close":
                        call.cancel()
                    else:  # hung: silent, stream open
                        await asyncio.sleep(max(0.0, plan.stop_at - time.time()))
                    return "done"
                if reader.done():
                    return "retry"
                step = self.step(now)
                req = coordinator_pb2.HeartbeatRequest(node_id=self.node_id, incarnation=self.inc,
                                                       known_epoch=self.epoch, beaconing=beacons)
                # as a real agent (agent/beacon_sender.py quiet): beacons confirmed, no probe waiting, echoed lately
                req.quiet = beacons and self.confirmed and not self.probed.is_set() and \
                    now - self.echo[1] <= plan.keepalive_s
                if plan.memory or beacons:
                    req.progress.step = step
                stepped = step != last_step
                if beacons:
                    send = first or stepped or self.probed.is_set() or self.target is None or \
                        now - last_stream >= plan.keepalive_s
                    if plan.memory and (first or stepped):
                        req.memory.CopyFrom(self.memory_report(step, now))
                else:
                    send = True
                    if plan.memory and stepped and not first:
                        task = asyncio.create_task(self._commit_rpcs(step))
                        self.pending.add(task)
                        task.add_done_callback(self.pending.discard)
                if send:
                    seq += 1
                    req.seq = seq
                    self.probed.clear()
                    await call.write(req)
                    self.tally.sent_one("stream")
                    last_stream = now
                first = False
                last_step = step
                ticks += 1  # a fixed schedule: a slow iteration does not lower the rate
                await asyncio.sleep(max(0.0, began + ticks / plan.hz - time.time()))
            return "done"
        except (grpc.RpcError, asyncio.CancelledError, asyncio.InvalidStateError) as exc:  # the last: call over
            if time.time() < plan.stop_at:
                self.tally.count("heartbeat", exc)
            return "retry"
        finally:
            reader.cancel()
            if not call.done():
                call.cancel()

    async def _read(self, call: Any) -> None:
        try:
            async for response in call:
                if not self.answered:
                    self.answered = True
                    self.tally.up.setdefault(self.node_id, []).append(time.time())
                    if self.plan.warm:
                        self._warm()
                a = response.assignment
                self.epoch = max(self.epoch, a.epoch)
                if a.HasField("peers"):
                    self.mirrors = list(a.peers.mirrors)
                if response.HasField("beacon"):
                    self.target = response.beacon
                    self.by_key[response.beacon.key_id] = self
                if response.probe:
                    self.probed.set()
                    self.confirmed = False
                elif response.beacon_seq_seen > 0:
                    self.confirmed = True
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    def on_echo(self, data: bytes) -> None:
        """A datagram for this node's stream key: the leader's echo (agent/beacon_sender.py)."""
        from ftd import beacons

        t = self.target
        seen = beacons.decode_echo(data, t.key_id, t.key) if t is not None else "no key"
        if isinstance(seen, str) or not self.echo[0] < seen <= self.beacon_seq:
            return
        self.echo = (seen, time.time())
        self.confirmed = self.confirmed or not self.probed.is_set()
        self.tally.sent_one("echoes")

    def beacon_due(self) -> None:
        """From the process's beacon thread (:func:`_beacons`): a beacon while the stream has a target, no
        probe waits and the node lives."""
        if not self.dead and self.target is not None and not self.probed.is_set():
            self._beacon()

    def _beacon(self) -> None:
        from ftd import beacons  # issue 19's wire format

        self.beacon_seq += 1
        t = self.target
        self.udp.sendto(beacons.encode(self.node_id, t.key_id, self.beacon_seq, t.key),
                        (self.plan.endpoints[self.endpoint].rsplit(":", 1)[0], t.port))
        self.tally.sent_one("beacons")

    async def _commit_rpcs(self, step: int) -> None:
        """The per-rank RPCs of one step on the rpc path: own ranks' commits, then, as a buddy's replica
        lands a moment later, the mirrored ranks' copies of the same step."""
        try:
            await self._commit_rpcs_of(step)
        except Exception as exc:
            self.tally.count("memory-rpc", exc)

    async def _commit_rpcs_of(self, step: int) -> None:
        stub = self._stub()
        now = time.time()
        if self.node_id in self.position:  # a spare trains nothing but keeps replicas
            mine = self.position[self.node_id] * self.k
            commits = [stub.CommitShard(checkpoint_pb2.CommitShardRequest(
                manifest=manifest(step, JOB_EPOCH, mine + r, self.world, now), tier="mem",
                location=self.node_id), timeout=30) for r in range(self.k)]
            self._tally(await asyncio.gather(*commits, return_exceptions=True))
        await asyncio.sleep(1.0 / self.plan.hz + 0.3)  # the buddies noticed the step and committed by then
        copies = [stub.RecordCopy(checkpoint_pb2.RecordCopyRequest(
            job=JOB, step=step, rank=self.position[m] * self.k + r, tier="mem", location=self.node_id,
            present=True), timeout=30) for m in self.mirrors if m in self.position for r in range(self.k)]
        self._tally(await asyncio.gather(*copies, return_exceptions=True))

    def _tally(self, outcomes: list[Any]) -> None:
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                self.tally.count("memory-rpc", outcome)
            else:
                self.tally.sent_one("memory-rpc")


async def _simulate(plan: Plan, ids: list[str], out: Any) -> None:
    tally = _Tally(window=plan.window)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setblocking(False)
    positions = trainers(plan)
    by_key: dict[int, _Node] = {}
    nodes = [_Node(plan, n, tally, udp, positions, by_key) for n in ids]
    loop = asyncio.get_running_loop()
    loop.add_reader(udp.fileno(), _echoes, udp, by_key)
    sender = None
    if plan.path == "beacons":
        sender = threading.Thread(target=_beacons, args=(nodes, plan.hz, plan.stop_at), daemon=True)
        sender.start()
    await asyncio.gather(*(node.run() for node in nodes))
    if sender is not None:
        sender.join(5)
    loop.remove_reader(udp.fileno())
    for node in nodes:
        for channel in node.channels.values():
            await channel.close()
    udp.close()
    tally.sent["nodes_with_mirrors"] = sum(1 for node in nodes if node.mirrors)
    out.put({"died": tally.died, "errors": tally.errors, "kinds": tally.kinds, "in_window": tally.in_window,
             "sent": tally.sent, "up": tally.up})


def _beacons(nodes: list[_Node], hz: float, stop_at: float) -> None:
    """The process's beacon sender, a thread of its own as a real agent's (agent/beacon_sender.py): a
    burst of work on the simulated agents' event loop (every node's memory report at a step's start)
    must not hold beacons back, which a real node's separate machine never would. Each node keeps its
    own phase."""
    period = 1.0 / hz
    due = [time.time() + random.random() * period for _ in nodes]
    while time.time() < stop_at:
        now = time.time()
        for i, node in enumerate(nodes):
            if due[i] <= now:
                due[i] = max(due[i] + period, now)  # behind: the next one a period on, not a burst
                node.beacon_due()
        time.sleep(max(0.0, min(0.02, stop_at - time.time())))


def _echoes(udp: socket.socket, by_key: dict[int, _Node]) -> None:
    """The leader's echoes on the process's shared beacon socket, each handed to its stream's node."""
    from ftd import beacons

    for _ in range(512):
        try:
            data = udp.recv(beacons.ECHO_BYTES + 1)
        except OSError:
            return
        if len(data) == beacons.ECHO_BYTES:
            node = by_key.get(beacons.ECHO_HEADER.unpack_from(data)[1])
            if node is not None:
                node.on_echo(data)


def worker(plan: Plan, ids: list[str], out: Any) -> None:
    asyncio.run(_simulate(plan, ids, out))
