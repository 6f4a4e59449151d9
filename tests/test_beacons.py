"""Liveness beacons as pure functions: the wire format (ftd/beacons.py), the leader's admission of one
beacon and its probe decision (coordinator/beacon_listener.py), the detector's reuse of fresh verdicts,
and the membership's handling of beacons and probes on the in-memory controller (no sleeping)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import random
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from controller_harness import Clock, cluster, make

from ftd import beacons
from ftd.agent.beacon_sender import (
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
from ftd.agent.heartbeat import Identity, Session
from ftd.coordinator.beacon_listener import (
    BeaconBook,
    BeaconKey,
    BeaconProtocol,
    admit,
    answer_due,
    echo_due,
    probe_due,
)
from ftd.coordinator.control import Controller
from ftd.coordinator.detector import DetectorSettings, Liveness, State, judge
from ftd.coordinator.membership import Stream
from ftd.coordinator.store import MemoryStore
from ftd.v1 import cluster_pb2, coordinator_pb2
from ftd.waiting import wait_for

KEY = bytes(range(32))


def test_a_beacon_round_trips_and_verifies_only_under_its_key() -> None:
    data = beacons.encode("node-7", 42, 9, KEY)
    assert len(data) <= beacons.MAX_DATAGRAM
    beacon = beacons.decode(data)
    assert isinstance(beacon, beacons.Beacon)
    assert (beacon.node_id, beacon.key_id, beacon.seq) == ("node-7", 42, 9)
    assert beacons.verify(beacon, KEY)
    assert not beacons.verify(beacon, bytes(32))


@pytest.mark.parametrize("mangle", [
    lambda d: d[:-1],                                   # truncated MAC
    lambda d: d[:10],                                   # truncated header
    lambda d: b"",
    lambda d: bytes([0x00]) + d[1:],                    # another version
    lambda d: d + b"x",                                 # trailing byte
    lambda d: d[:13] + bytes([200]) + d[14:],           # node id length beyond the datagram
    lambda d: b"\xb1" + bytes(400),                     # oversized
])
def test_malformed_datagrams_give_a_reason_never_an_exception(mangle: object) -> None:
    data = beacons.encode("node-7", 1, 1, KEY)
    out = beacons.decode(mangle(data))  # type: ignore[operator]
    assert isinstance(out, str) and out


def test_random_garbage_never_raises() -> None:
    rng = random.Random(19)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        out = beacons.decode(data)
        assert isinstance(out, (str, beacons.Beacon))


def test_a_tampered_field_fails_the_mac() -> None:
    data = bytearray(beacons.encode("node-7", 42, 9, KEY))
    data[12] ^= 1  # the seq's last byte: a forged newer seq
    beacon = beacons.decode(bytes(data))
    assert isinstance(beacon, beacons.Beacon) and beacon.seq != 9
    assert not beacons.verify(beacon, KEY)


def test_encode_refuses_what_no_leader_accepts() -> None:
    with pytest.raises(ValueError):
        beacons.encode("", 1, 1, KEY)
    with pytest.raises(ValueError):
        beacons.encode("n", 1, 0, KEY)
    with pytest.raises(ValueError):
        beacons.encode("n", 1, 1, b"short")


def _beacon(node: str, key_id: int, seq: int, key: bytes = KEY) -> beacons.Beacon:
    out = beacons.decode(beacons.encode(node, key_id, seq, key))
    assert isinstance(out, beacons.Beacon)
    return out


def test_admit_names_why_a_beacon_is_dropped() -> None:
    entry = BeaconKey("node-1", 5, KEY, seq_seen=10)
    assert admit(_beacon("node-1", 5, 11), entry) is None
    assert admit(_beacon("node-1", 5, 11), None) == "unknown_key"
    assert admit(_beacon("node-2", 5, 11), entry) == "wrong_node"  # another node's stream key
    assert admit(_beacon("node-1", 5, 11, bytes(32)), entry) == "bad_mac"
    assert admit(_beacon("node-1", 5, 10), entry) == "replay"  # seen already
    assert admit(_beacon("node-1", 5, 3), entry) == "replay"


def test_the_book_issues_distinct_keys_and_revokes_them() -> None:
    book = BeaconBook(4000, 0.5, "coordinator-0.example")
    a, b = book.issue("a"), book.issue("a")
    assert a.key_id != b.key_id and a.key != b.key and len(a.key) == beacons.KEY_BYTES
    target = book.target(a)
    assert (target.port, target.key, target.key_id, target.interval_s, target.host) == (
        4000, a.key, a.key_id, 0.5, "coordinator-0.example")
    book.revoke(a)
    assert a.key_id not in book.keys and b.key_id in book.keys


def test_probe_once_per_silence_and_only_for_beaconing_nodes() -> None:
    assert probe_due(10.0, 9.5, True, None, 1.2) is None  # not silent long enough
    why = probe_due(10.0, 8.7, True, None, 1.2)
    assert why is not None and "1.30s" in why
    assert probe_due(10.0, 8.7, False, None, 1.2) is None  # stream heartbeats: silence speaks for itself
    assert probe_due(10.5, 8.7, True, 10.0, 1.2) is None  # probed in this silence already
    assert probe_due(13.0, 11.0, True, 10.0, 1.2) is not None  # answered, then silent again


def test_judge_with_previous_verdicts_agrees_with_a_full_judgement() -> None:
    rng = random.Random(7)
    settings = DetectorSettings()
    table = {f"n{i}": Liveness(last_seen=rng.uniform(0, 10), connected=rng.random() < 0.9,
                               disconnected_at=rng.choice([None, rng.uniform(5, 10)]),
                               grace_until=rng.choice([0.0, 11.0])) for i in range(500)}
    previous = judge(9.5, table, settings).verdicts
    full, fast = judge(10.0, table, settings).verdicts, judge(10.0, table, settings, previous=previous).verdicts
    assert {n: (v.state, v.reason) for n, v in full.items()} == {n: (v.state, v.reason) for n, v in fast.items()}
    reused = [n for n in fast if fast[n] is previous[n]]
    assert reused and all(fast[n].state is State.ALIVE for n in reused)
    assert {fast[n].reason for n in reused} == {"heartbeating", "in grace"}, "a storm's nodes in grace reused too"


def _hb(node: str, beaconing: bool = True) -> coordinator_pb2.HeartbeatRequest:
    return coordinator_pb2.HeartbeatRequest(node_id=node, incarnation="i1", seq=1, beaconing=beaconing)


async def _beaconing_leader() -> tuple[Clock, Controller, Stream]:
    """A leader taking beacons, wired as coordinator/main.py does, over the harness's cluster (a, b active,
    s spare; their streams opened without beacons, then closed) and a's stream opened anew: its first
    answer carries the BeaconTarget."""
    clock = Clock()
    ctl = make(MemoryStore(), clock)
    ctl.membership.beacons = BeaconBook(4000, 0.5, answer_interval_s=ctl.settings.quiet_answer_interval_s)
    await cluster(ctl, clock)
    ctl.membership.close_streams(None)
    return clock, ctl, ctl.membership.open_stream(_hb("a"))


def test_membership_beacons_refresh_liveness_and_a_silent_beaconing_node_is_probed() -> None:
    async def scenario() -> None:
        clock, ctl, stream = await _beaconing_leader()
        membership = ctl.membership
        first = membership.heartbeat_response(stream)
        assert first.HasField("beacon") and first.beacon.port == 4000
        assert not membership.heartbeat_response(stream).HasField("beacon")  # given once per stream
        key_id, key = first.beacon.key_id, first.beacon.key
        view = ctl.committer.view
        assert view is not None
        for n in ("b", "s"):
            membership.open_stream(_hb(n))
        for seq in range(1, 25):  # 2.4 s of beacons from a only
            clock.advance(0.1)
            assert membership.on_beacon(_beacon("a", key_id, seq, key)) is None
            for n in ("b", "s"):
                membership.on_heartbeat(membership.streams[n], _hb(n))
            await ctl.tick()
        assert view.verdicts["a"].state is State.ALIVE
        assert membership.heartbeat_response(stream).beacon_seq_seen == 24
        assert membership.on_beacon(_beacon("a", key_id, 24, key)) == "replay"
        assert membership.on_beacon(_beacon("b", key_id, 25, key)) == "wrong_node"
        # a's beacons stop: suspect at 1.2 s, one probe pushed on its stream, not two
        for _ in range(13):
            clock.advance(0.1)
            for n in ("b", "s"):
                membership.on_heartbeat(membership.streams[n], _hb(n))
            await ctl.tick()
        assert view.verdicts["a"].state is State.SUSPECT
        assert stream.probe_pending and ctl.metrics.probes._value.get() == 1
        assert membership.heartbeat_response(stream).probe
        await ctl.tick()
        assert ctl.metrics.probes._value.get() == 1
        membership.on_heartbeat(stream, _hb("a"))  # the agent answers the probe on the stream
        await ctl.tick()
        assert view.verdicts["a"].state is State.ALIVE
        membership.close_stream(stream)
        assert membership.on_beacon(_beacon("a", key_id, 99, key)) == "unknown_key"  # revoked with its stream

    asyncio.run(scenario())


def test_a_quiet_stream_is_answered_every_quiet_interval_and_news_at_once() -> None:
    assert answer_due(10.0, 9.0, False, 1.0, 6.0) and not answer_due(10.0, 9.5, False, 1.0, 6.0)
    assert not answer_due(14.0, 9.0, True, 1.0, 6.0) and answer_due(15.0, 9.0, True, 1.0, 6.0)
    assert answer_due(10.0, 9.0, True, 1.0, 0.0)  # 0: a quiet stream is answered like any other

    async def scenario() -> None:
        clock, ctl, stream = await _beaconing_leader()
        membership = ctl.membership
        quiet_s = ctl.settings.quiet_answer_interval_s
        assert membership.heartbeat_response(stream).beacon.answer_interval_s == quiet_s  # the agent budgets for it
        quiet_hb = coordinator_pb2.HeartbeatRequest(node_id="a", incarnation="i1", seq=2, beaconing=True, quiet=True)
        answered = []
        for tenth in range(1, int(quiet_s * 25) + 1):  # 2.5 intervals of a quiet stream's messages, one every 0.5 s
            clock.advance(0.1)
            if tenth % 5 == 0:
                membership.on_heartbeat(stream, quiet_hb)
                if membership.ack_due(stream):
                    membership.heartbeat_response(stream)
                    answered.append(round(clock(), 1))
        gaps = [b - a for a, b in itertools.pairwise(answered)]
        assert len(answered) == 2 and all(g >= quiet_s for g in gaps), answered
        membership.on_heartbeat(stream, _hb("a"))  # not quiet (a probe's answer): answered within 1 s again
        clock.advance(1.0)
        assert membership.ack_due(stream)
        membership.heartbeat_response(stream)
        view = ctl.committer.view
        assert view is not None
        membership.on_heartbeat(stream, quiet_hb)
        view.world = dataclasses.replace(view.world, epoch=view.world.epoch + 1)
        assert membership.ack_due(stream), "a new epoch is news: answered at once"

    asyncio.run(scenario())


# ---- the agent's side ------------------------------------------------------------------------------

POLICY = StreamPolicy(interval_s=0.5, keepalive_s=4.0, progress_interval_s=1.0)


def _sent(state: StreamState, now: float, epoch: int = 3, verdict: tuple[bool, str] | None = (True, ""),
          progress: object = None) -> None:
    state.sent_at, state.epoch, state.verdict, state.progress, state.progress_at = now, epoch, verdict, progress, now


def test_without_beacons_every_beat_is_a_stream_message() -> None:
    state = StreamState()
    assert stream_due(0.0, False, state, 3, None, None, False, POLICY) == "first message of the stream"
    _sent(state, 0.0)
    assert stream_due(0.5, False, state, 3, (True, ""), None, False, POLICY) == "heartbeat"


def test_with_confirmed_beacons_the_stream_carries_changes_and_keepalives_only() -> None:
    progress, newer = object(), object()
    state = StreamState(confirmed=True)
    _sent(state, 10.0, progress=progress)

    def due(now: float, **kw: object) -> str | None:
        args: dict[str, object] = {"epoch": 3, "verdict": (True, ""), "progress": progress, "memory": False, **kw}
        return stream_due(now, True, state, args["epoch"], args["verdict"], args["progress"],  # type: ignore[arg-type]
                          bool(args["memory"]), POLICY)

    assert due(10.5) is None and due(13.9) is None
    assert due(14.0) == "keepalive"
    assert due(10.5, epoch=4) == "epoch changed"
    assert due(10.5, verdict=(False, "disk full")) == "health verdict changed"
    assert due(10.5, memory=True) is None  # the step's memory report: rate-limited like its progress
    assert due(11.0, memory=True) == "memory report changed"
    assert due(10.5, progress=newer) is None  # a new step, but within progress_interval_s of the last
    anomaly = cluster_pb2.Progress(step=7, anomaly=cluster_pb2.StepAnomaly(step=7, rank=1, kind="nan"))
    assert stream_due(10.5, True, state, 3, (True, ""), anomaly, False, POLICY,
                      progress_events(anomaly)) == "training event (a step anomaly, a parked step or a restore)"
    assert due(11.0, progress=newer) == "training progress"


def test_a_probe_is_answered_at_once_and_the_stream_beats_until_beacons_are_seen_again() -> None:
    state = StreamState()
    _sent(state, 0.0)
    assert stream_due(0.5, True, state, 3, (True, ""), None, False, POLICY) == "beacons not confirmed by the leader yet"
    confirm(state, coordinator_pb2.HeartbeatResponse(beacon_seq_seen=2), sent_seq=3)
    assert state.confirmed and stream_due(1.0, True, state, 3, (True, ""), None, False, POLICY) is None
    confirm(state, coordinator_pb2.HeartbeatResponse(probe=True, beacon_seq_seen=2), sent_seq=9)
    assert stream_due(1.1, True, state, 3, (True, ""), None, False, POLICY) == "probed by the leader"
    state.probed = False  # answered
    confirm(state, coordinator_pb2.HeartbeatResponse(beacon_seq_seen=9), sent_seq=11)
    assert stream_due(1.6, True, state, 3, (True, ""), None, False, POLICY) == "beacons not confirmed by the leader yet"
    confirm(state, coordinator_pb2.HeartbeatResponse(beacon_seq_seen=10), sent_seq=12)  # one sent after the probe
    assert state.confirmed


def test_echoes_keep_a_quiet_stream_and_its_silence_gives_the_leader_up() -> None:
    state = StreamState()
    assert not quiet(state, True, 10.0, 9.0, POLICY)
    assert leader_silent(13.1, 10.0, None, state, True, 3.0, POLICY) == "no answer for 3.1s"  # unconfirmed
    confirm_echo(state, 1)
    assert state.confirmed, "an echo confirms beacons as an answer does"
    assert not quiet(state, True, 10.0, 9.0, POLICY), "a leader that names no answer interval answers everything"
    state.answer_interval_s = 30.0
    assert quiet(state, True, 10.0, 9.0, POLICY)
    assert not quiet(state, True, 13.5, 9.0, POLICY), "no echo for a keepalive's period: answers are wanted"
    assert not quiet(state, False, 10.0, 9.0, POLICY)  # beacons off
    # the leader lives while echoes come, and the stream's answers may be rare
    assert leader_silent(20.0, 0.0, 19.0, state, True, 3.0, POLICY) is None
    assert leader_silent(20.0, 0.0, 12.9, state, True, 3.0, POLICY) == "no answer or echo for 7.1s"
    assert leader_silent(38.0, 0.0, 37.5, state, True, 3.0, POLICY) == "echoes but no answer on the stream for 38.0s"
    _sent(state, 13.0)
    state.sent_quiet = True
    assert stream_due(14.0, True, state, 3, (True, ""), None, False, POLICY, calm=True) is None
    assert stream_due(14.0, True, state, 3, (True, ""), None, False, POLICY, calm=False) == \
        "the leader's echoes stopped: its answer is wanted"
    confirm(state, coordinator_pb2.HeartbeatResponse(probe=True), sent_seq=5)
    confirm_echo(state, 9)
    assert not state.confirmed, "a probe waits for its answer on the stream, not for an echo"
    assert leader_silent(13.1, 10.0, 13.0, state, True, 3.0, POLICY) == "no answer for 3.1s"


def test_the_sender_beacons_under_the_streams_key_until_disarmed() -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(5.0)
    sender = BeaconSender("node-9", interval_s=0.05)
    thread = threading.Thread(target=sender.run, daemon=True)
    thread.start()
    try:
        sender.aim("127.0.0.1", coordinator_pb2.BeaconTarget(port=receiver.getsockname()[1], key=KEY, key_id=77,
                                                             interval_s=0.5))
        got = [beacons.decode(receiver.recvfrom(2048)[0]) for _ in range(3)]
        assert all(isinstance(b, beacons.Beacon) and beacons.verify(b, KEY) for b in got)
        assert [b.seq for b in got if isinstance(b, beacons.Beacon)] == [1, 2, 3]
        assert {b.node_id for b in got if isinstance(b, beacons.Beacon)} == {"node-9"}
        sender.disarm()
        assert not sender.aimed
    finally:
        sender.stop()
        thread.join(5)
        receiver.close()
    assert not thread.is_alive()


class _FakeCall:
    """A heartbeat stream the test answers by hand; a thread pulls the session's requests as gRPC would."""

    def __init__(self, requests: Iterator[coordinator_pb2.HeartbeatRequest]) -> None:
        self.answers: queue.Queue[coordinator_pb2.HeartbeatResponse | None] = queue.Queue()
        self.sent: list[tuple[float, coordinator_pb2.HeartbeatRequest]] = []
        self._pull = threading.Thread(target=self._consume, args=(requests,), daemon=True)
        self._pull.start()

    def _consume(self, requests: Iterator[coordinator_pb2.HeartbeatRequest]) -> None:
        for req in requests:
            self.sent.append((time.monotonic(), req))

    def __iter__(self) -> Iterator[coordinator_pb2.HeartbeatResponse]:
        while (answer := self.answers.get(timeout=10)) is not None:
            yield answer

    def cancel(self) -> None:
        self.answers.put(None)


class _FakeClient:
    current = "127.0.0.1:7400"

    def __init__(self) -> None:
        self.calls: queue.Queue[_FakeCall] = queue.Queue()
        self.warmed = 0

    def warm(self) -> list[str]:
        """The standbys' channels connected (CoordinatorClient.warm): one configured endpoint, none."""
        self.warmed += 1
        return []

    def register(self, req: coordinator_pb2.RegisterRequest, **kw: object) -> coordinator_pb2.RegisterResponse:
        return coordinator_pb2.RegisterResponse(assignment=cluster_pb2.Assignment(epoch=1, rank=0))

    def heartbeat_stream(self, requests: Iterator[coordinator_pb2.HeartbeatRequest]) -> _FakeCall:
        call = _FakeCall(requests)
        self.calls.put(call)
        return call


def test_the_session_goes_quiet_once_beacons_are_confirmed_and_answers_a_probe_at_once() -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    client = _FakeClient()
    sender = BeaconSender("node-1", interval_s=0.5)
    session = Session(client, Identity("node-1", "h", cluster_pb2.ROLE_ACTIVE, {}, "127.0.0.1:1"),  # type: ignore[arg-type]
                      interval_s=0.5, timeout_s=3.0, max_backoff_s=0.1, health=cluster_pb2.Health,
                      progress=cluster_pb2.Progress, beacons=sender, keepalive_s=30.0)
    threads = [threading.Thread(target=t, daemon=True) for t in (session.run, sender.run)]
    for t in threads:
        t.start()
    try:
        call = client.calls.get(timeout=5)
        wait_for(lambda: call.sent, 5, "the stream's first message")
        assert not call.sent[0][1].beaconing  # no target yet
        target = coordinator_pb2.BeaconTarget(port=receiver.getsockname()[1], key=KEY, key_id=3, interval_s=0.5,
                                              answer_interval_s=6.0)
        call.answers.put(coordinator_pb2.HeartbeatResponse(beacon=target))
        wait_for(lambda: len(call.sent) >= 2 and sender.seq >= 1, 5, "a beat with beacons, unconfirmed")
        assert call.sent[-1][1].beaconing
        assert client.warmed >= 1  # answered: the standbys' connections are opened now
        call.answers.put(coordinator_pb2.HeartbeatResponse(beacon_seq_seen=sender.seq))  # confirmed
        wait_for(lambda: session._stream.confirmed, 5, "beacons confirmed")
        quiet_from = len(call.sent)
        seq = sender.seq
        wait_for(lambda: sender.seq >= seq + 3, 5, "three more beacons")  # 1.5 s
        assert len(call.sent) <= quiet_from + 1, "the stream stays quiet while beacons carry liveness"
        probed = time.monotonic()
        count = len(call.sent)
        call.answers.put(coordinator_pb2.HeartbeatResponse(probe=True, beacon_seq_seen=seq))
        wait_for(lambda: len(call.sent) > count, 5, "the probe's answer")
        assert call.sent[count][0] - probed < 0.25, "answered at once, not at the next beat"
        assert not call.sent[count][1].quiet, "a probe's answer asks for the leader's answer"
        wait_for(lambda: len(call.sent) >= count + 3, 5, "beats at full rate until beacons are seen again")
    finally:
        session.stop()
        for t in threads:
            t.join(5)
        receiver.close()


# ---- echoes: the leader's liveness for a quiet stream ------------------------------------------------


def test_an_echo_verifies_only_under_its_key_and_never_passes_for_a_beacon() -> None:
    echo = beacons.encode_echo(7, 42, KEY)
    assert beacons.decode_echo(echo, 7, KEY) == 42
    assert beacons.decode_echo(echo, 7, bytes(32)) == "bad MAC"
    assert beacons.decode_echo(echo, 8, KEY) == "key id 7, not this stream's 8"
    assert isinstance(beacons.decode(echo), str), "an echo is no beacon"
    beacon = beacons.encode("node-1", 7, 42, KEY)
    assert isinstance(beacons.decode_echo(beacon, 7, KEY), str), "a beacon is no echo"
    forged = bytes([beacons.MAGIC]) + echo[1:]
    assert beacons.decode_echo(forged, 7, KEY) == f"unknown magic/version byte 0x{beacons.MAGIC:02x}"
    assert echo_due(1, 0, 0.5) and not echo_due(4, 1, 0.5) and echo_due(5, 1, 0.5)  # every 2 s of beacons
    assert echo_due(2, 1, 2.0) and echo_due(3, 1, 0.0)


def test_the_leader_echoes_a_streams_beacons_to_where_they_came_from() -> None:
    async def scenario() -> None:
        _, ctl, stream = await _beaconing_leader()
        membership = ctl.membership
        target = membership.heartbeat_response(stream).beacon
        metrics = ctl.metrics
        protocol = BeaconProtocol(membership.on_beacon, metrics.beacons_accepted, metrics.beacons_dropped,
                                  membership.echo, metrics.beacon_echoes)
        leader = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        agent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            leader.bind(("127.0.0.1", 0))
            leader.setblocking(False)
            agent.bind(("127.0.0.1", 0))
            agent.settimeout(5)
            seen = []
            for seq in range(1, 10):
                agent.sendto(beacons.encode("a", target.key_id, seq, target.key), leader.getsockname())
                wait_for(lambda: _readable(leader), 5, "the beacon at the leader's port")
                protocol.drain(leader)
                if seq in (1, 5, 9):
                    seen.append(beacons.decode_echo(agent.recv(64), target.key_id, target.key))
            agent.sendto(beacons.encode("a", target.key_id, 3, target.key), leader.getsockname())  # a replay
            wait_for(lambda: _readable(leader), 5, "the replayed beacon")
            protocol.drain(leader)
            agent.settimeout(0.2)
            with pytest.raises(TimeoutError):
                agent.recv(64)  # echoed every 4 beacons (2 s), and a dropped beacon gets none
            assert seen == [1, 5, 9]
            assert metrics.beacon_echoes._value.get() == 3
        finally:
            leader.close()
            agent.close()

    asyncio.run(scenario())


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_the_sender_takes_the_echoes_of_its_key_and_refuses_replays_and_forgeries() -> None:
    leader = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    leader.bind(("127.0.0.1", 0))
    leader.settimeout(5)
    sender = BeaconSender("node-9", interval_s=0.05)
    thread = threading.Thread(target=sender.run, daemon=True)
    thread.start()
    try:
        sender.aim("127.0.0.1", coordinator_pb2.BeaconTarget(port=leader.getsockname()[1], key=KEY, key_id=77,
                                                             interval_s=0.05))
        _, addr = leader.recvfrom(2048)
        leader.sendto(beacons.encode_echo(77, 1, bytes(32)), addr)  # forged: another key
        leader.sendto(beacons.encode_echo(78, 1, KEY), addr)  # another stream's key id
        leader.sendto(beacons.encode_echo(77, 10**6, KEY), addr)  # a beacon not sent yet
        leader.sendto(beacons.encode_echo(77, 1, KEY), addr)
        wait_for(lambda: sender.echo[0] == 1, 5, "the echo of beacon 1")
        at = sender.echo[1]
        assert at is not None and at <= time.monotonic()
        wait_for(lambda: sender.seq >= 3, 5, "more beacons")
        leader.sendto(beacons.encode_echo(77, 2, KEY), addr)
        wait_for(lambda: sender.echo[0] == 2, 5, "the echo of beacon 2")
        leader.sendto(beacons.encode_echo(77, 1, KEY), addr)  # replayed
        seq = sender.seq
        wait_for(lambda: sender.seq >= seq + 3, 5, "the replay read")
        assert sender.echo[0] == 2
        sender.disarm()
        assert sender.echo == (0, None)
    finally:
        sender.stop()
        thread.join(5)
        leader.close()
