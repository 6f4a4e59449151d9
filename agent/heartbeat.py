"""The agent's session with the coordinator: register, then stream heartbeats to the leader.

Reconnects with jittered exponential backoff (tenacity) and follows the leader named by a standby's
refusal. Whatever happens to coordinators (restart, failover, etcd outage) the agent keeps trying;
it never gives up on its own. The latest assignment is kept here and handed to ``on_assignment``.
Health is not sampled here: ``health`` hands over the sampling thread's latest (agent.health_monitor).
When the leader offers beacons (``HeartbeatResponse.beacon``) liveness rides on them
(:mod:`.beacon_sender`) and the stream carries only changes, probe answers and keepalives.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from ftd.client import CoordinatorClient
from ftd.rpc import parse_hostport, rpc_code, rpc_details
from ftd.v1 import cluster_pb2, coordinator_pb2

from .beacon_sender import (
    BeaconSender,
    StreamPolicy,
    StreamState,
    confirm,
    confirm_echo,
    leader_silent,
    progress_events,
    quiet,
    stream_due,
)

log = logging.getLogger("ftd.agent")


class SessionEnded(Exception):
    """The heartbeat stream ended; the session is re-established after a backoff."""


@dataclass(frozen=True)
class Identity:
    node_id: str
    host: str
    role: int  # cluster_pb2.Role
    labels: dict[str, str]
    agent_address: str


class Session:
    def __init__(
        self,
        client: CoordinatorClient,
        identity: Identity,
        interval_s: float,
        timeout_s: float,
        max_backoff_s: float,
        health: Callable[[], cluster_pb2.Health],
        progress: Callable[[], cluster_pb2.Progress],
        on_assignment: Callable[[cluster_pb2.Assignment], None] = lambda a: None,
        on_heartbeat: Callable[[], None] = lambda: None,
        on_reconnect: Callable[[], None] = lambda: None,
        on_connected: Callable[[bool], None] = lambda up: None,
        on_response: Callable[[coordinator_pb2.HeartbeatResponse], None] = lambda r: None,
        beacons: BeaconSender | None = None,
        keepalive_s: float = 4.0,
        progress_interval_s: float = 1.0,
    ) -> None:
        self.client = client
        self.identity = identity
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.health = health
        self.progress = progress
        self.on_assignment = on_assignment
        self.on_heartbeat = on_heartbeat
        self.on_reconnect = on_reconnect
        self.on_connected = on_connected
        self.on_response = on_response  # every answer (pending hand-overs ride on them)
        # The node's memory report for a message (agent.memory_report.MemoryInventory.take): given
        # ``first`` (a stream's first message: always the whole report), None when unchanged.
        self.memory: Callable[[bool], coordinator_pb2.MemoryReport | None] = lambda first: None
        # Whether the memory report changed since it was last taken (MemoryInventory.changed): with
        # beacons, a change is what makes a stream message due.
        self.memory_changed: Callable[[], bool] = lambda: False
        self.beacons = beacons  # None: beacons off (every beat is a stream message)
        self.policy = StreamPolicy(interval_s, keepalive_s, progress_interval_s)
        self._stream = StreamState()
        self._stream_lock = threading.Lock()
        self._wake = threading.Event()  # a probe or stop: the request iterator goes on now
        self.incarnation = uuid.uuid4().hex
        self.assignment = cluster_pb2.Assignment(rank=-1)
        self._connected = False
        self._since = time.monotonic()  # when ``connected`` last changed
        self.reconnects = 0
        self.leader_address = ""
        self._registered = False
        self._stop = threading.Event()
        self._call: Any = None  # the open stream (a grpc.Call); cancelled to force a reconnect

    # ---- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        """Blocks until :meth:`stop`; every session failure is retried with backoff."""
        retrying = Retrying(
            retry=retry_if_exception_type((SessionEnded, grpc.RpcError, ConnectionError)),
            wait=wait_exponential_jitter(initial=0.05, max=self.max_backoff_s, jitter=0.1),
            stop=lambda state: self._stop.is_set(),
            sleep=self._sleep,
            before_sleep=self._before_retry,
            reraise=False,
        )
        while not self._stop.is_set():
            try:
                retrying(self._session)
            except Exception:  # tenacity's RetryError after stop, or a bug: keep the agent alive
                if not self._stop.is_set():
                    log.exception("heartbeat session failed unexpectedly; restarting it")
                    self._stop.wait(self.max_backoff_s)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.beacons is not None:
            self.beacons.stop()
        call = self._call
        if call is not None:
            call.cancel()

    @property
    def connected(self) -> bool:
        """A leader answers this node's heartbeat stream now."""
        return self._connected

    @connected.setter
    def connected(self, up: bool) -> None:
        if up != self._connected:
            self._connected, self._since = up, time.monotonic()

    def disconnected_for(self) -> float:
        """Seconds without a leader answering (0 while connected)."""
        return 0.0 if self._connected else time.monotonic() - self._since

    def _before_retry(self, state: RetryCallState) -> None:
        self.connected = False
        self.reconnects += 1
        self.on_reconnect()
        exc = state.outcome.exception() if state.outcome else None
        code = rpc_code(exc) if exc is not None else None
        if exc is not None and code is not None:
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                self._registered = False  # unknown to this leader, or a stale incarnation: register again
            else:
                self.client.follow(exc)  # a standby's hint, or the next endpoint
            log.info("heartbeat session to %s ended (%s: %s); retry %d", self.client.current,
                     code.name, rpc_details(exc), state.attempt_number)
        elif exc is not None:
            log.info("heartbeat session ended: %s; retry %d", exc, state.attempt_number)

    # ---- one session -------------------------------------------------------------------------

    def _register(self) -> None:
        req = coordinator_pb2.RegisterRequest(
            node_id=self.identity.node_id, host=self.identity.host, role=self.identity.role,  # type: ignore[arg-type]
            labels=self.identity.labels, agent_address=self.identity.agent_address, pid=os.getpid(),
            incarnation=self.incarnation,
        )
        # One attempt per endpoint; the retry loop above provides the backoff between rounds.
        resp = self.client.register(req, deadline_s=self.timeout_s)
        self._registered = True
        log.info("registered with %s: %s (epoch %d, rank %d)", self.client.current, resp.message,
                 resp.assignment.epoch, resp.assignment.rank)
        self._apply(resp.assignment)

    def _requests(self) -> Iterator[coordinator_pb2.HeartbeatRequest]:
        """A message every beat, or with beacons only when :func:`~.beacon_sender.stream_due` says so.
        Every message carries the latest health: ``health`` returns what its sampling thread last
        measured, judged now, and never waits on a measurement (a hung NVML call must not stop beats)."""
        seq = 0
        state = self._stream
        while not self._stop.is_set():
            self._wake.clear()  # before reading the state: a probe from now on wakes the wait below
            now = time.monotonic()
            health, progress, epoch = self.health(), self.progress(), self.assignment.epoch
            verdict = (health.verdict.healthy, health.verdict.reason) if health.HasField("verdict") else None
            beaconing = self.beacons is not None and self.beacons.aimed
            memory_changed = self.memory_changed()
            events = progress_events(progress)
            echo_seen, echo_at = self.beacons.echo if self.beacons is not None else (0, None)
            with self._stream_lock:
                confirm_echo(state, echo_seen)
                calm = quiet(state, beaconing, now, echo_at, self.policy)
                due = stream_due(now, beaconing, state, epoch, verdict, progress, memory_changed, self.policy, events,
                                 calm)
                if due is not None:
                    if progress is not state.progress or memory_changed:
                        state.progress_at = now
                    state.sent_at, state.epoch, state.verdict, state.progress = now, epoch, verdict, progress
                    state.events = events
                    state.sent_quiet = calm
                    state.probed = False
            if due is not None:
                if beaconing:
                    log.debug("stream message: %s", due)
                seq += 1
                yield coordinator_pb2.HeartbeatRequest(
                    node_id=self.identity.node_id, incarnation=self.incarnation, known_epoch=epoch,
                    health=health, progress=progress, seq=seq, memory=self.memory(seq == 1), beaconing=beaconing,
                    quiet=calm,
                )
                self.on_heartbeat()
            self._wake.wait(self.interval_s)

    def _session(self) -> None:
        if self._stop.is_set():
            return
        if not self._registered:
            self._register()
        self._last_answer = time.monotonic()
        with self._stream_lock:
            self._stream = StreamState()  # a new stream: a new key, beacons to be confirmed again
        call = self.client.heartbeat_stream(self._requests())
        self._call = call
        ended = threading.Event()
        # The watchdog must not depend on the call making progress (the request iterator is only
        # pulled while the stream is healthy): its own thread cancels a stream that went silent.
        threading.Thread(target=self._watch, args=(call, ended), name="ftd-heartbeat-watchdog", daemon=True).start()
        try:
            for response in call:
                self._last_answer = time.monotonic()
                if not self.connected:
                    self.connected = True
                    self.on_connected(True)
                    self.leader_address = self.client.current
                    log.info("heartbeating to leader %s at %s", response.leader_id, self.client.current)
                    self.client.warm()  # the standbys' connections, up before a failover needs them
                self._beacon_answer(response)
                self._apply(response.assignment)
                self.on_response(response)
                if response.assignment.fenced:
                    log.warning("this node was fenced out of epoch %d; re-registering as a spare",
                                response.assignment.epoch)
                    self._registered = False
                    call.cancel()
                    raise SessionEnded("fenced")
        finally:
            ended.set()
            self._call = None
            if self.beacons is not None:
                self.beacons.disarm()
            if self.connected:
                self.connected = False
                self.on_connected(False)
        if not self._stop.is_set():
            raise SessionEnded(f"heartbeat stream to {self.client.current} closed")

    def _beacon_answer(self, response: coordinator_pb2.HeartbeatResponse) -> None:
        """Aims the beacons at a stream's target; a probe wakes the request iterator at once."""
        sender = self.beacons
        if sender is None:
            return
        if response.HasField("beacon"):
            with self._stream_lock:
                self._stream.answer_interval_s = response.beacon.answer_interval_s
            host = response.beacon.host or parse_hostport(self.client.current)[0]  # the leader's own, else dialed
            sender.aim(host, response.beacon)
            log.info("sending liveness beacons to %s UDP %d every %.2fs", host,
                     sender.port_override or response.beacon.port, sender.interval_s)
        with self._stream_lock:
            confirm(self._stream, response, sender.seq)
        if response.probe:
            log.info("probed by the leader (its beacons from this node stopped): answering on the stream")
            self._wake.set()

    def leader_silent(self) -> str | None:
        """Why the leader is given up now, if it is (:func:`~.beacon_sender.leader_silent`)."""
        sender = self.beacons
        echo_at = sender.echo[1] if sender is not None else None
        return leader_silent(time.monotonic(), self._last_answer, echo_at, self._stream,
                             sender is not None and sender.aimed, self.timeout_s, self.policy)

    def _watch(self, call: Any, ended: threading.Event) -> None:
        while not ended.wait(min(0.5, self.interval_s)):
            why = self.leader_silent()
            if why is not None:
                log.warning("%s from %s; reconnecting", why, self.client.current)
                call.cancel()
                return

    def _apply(self, assignment: cluster_pb2.Assignment) -> None:
        old = self.assignment
        if not assignment.world and assignment.epoch == old.epoch:
            assignment.world.extend(old.world)  # the world is only sent when the epoch changes
        if not assignment.HasField("peers") and old.HasField("peers"):
            assignment.peers.CopyFrom(old.peers)  # the buddy and the addresses: only sent when they change
        self.assignment = assignment
        if (assignment.epoch, assignment.rank, assignment.fenced) != (old.epoch, old.rank, old.fenced):
            log.info("assignment: epoch %d, rank %d of %d%s", assignment.epoch, assignment.rank,
                     assignment.world_size, " (fenced)" if assignment.fenced else "")
            self.on_assignment(assignment)
