"""Liveness beacons as pure functions: the wire format (ftd/beacons.py), the leader's admission of one
beacon and its probe decision (coordinator/beacon_listener.py), the detector's reuse of fresh verdicts,
and the membership's handling of beacons and probes on the in-memory controller (no sleeping)."""

from __future__ import annotations

import asyncio
import queue
import random
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
    progress_events,
    stream_due,
)
from ftd.agent.heartbeat import Identity, Session
from ftd.coordinator.beacon_listener import BeaconBook, BeaconKey, admit, probe_due
from ftd.coordinator.detector import DetectorSettings, Liveness, State, judge
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


def _hb(node: str, beaconing: bool = True) -> coordinator_pb2.HeartbeatRequest:
    return coordinator_pb2.HeartbeatRequest(node_id=node, incarnation="i1", seq=1, beaconing=beaconing)


def test_membership_beacons_refresh_liveness_and_a_silent_beaconing_node_is_probed() -> None:
    async def scenario() -> None:
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        membership = ctl.membership
        membership.beacons = BeaconBook(4000, 0.5)
        await cluster(ctl, clock)  # a, b active, s spare: streams opened without beacons
        membership.close_streams(None)
        stream = membership.open_stream(_hb("a"))
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
        target = coordinator_pb2.BeaconTarget(port=receiver.getsockname()[1], key=KEY, key_id=3, interval_s=0.5)
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
        wait_for(lambda: len(call.sent) >= count + 3, 5, "beats at full rate until beacons are seen again")
    finally:
        session.stop()
        for t in threads:
            t.join(5)
        receiver.close()


def test_no_probe_in_a_stalled_judgement_and_queued_beacons_count_before_judging() -> None:
    async def scenario() -> None:
        clock = Clock()
        ctl = make(MemoryStore(), clock)
        membership = ctl.membership
        membership.beacons = BeaconBook(4000, 0.5)
        await cluster(ctl, clock)
        membership.close_streams(None)
        stream = membership.open_stream(_hb("a"))
        target = membership.heartbeat_response(stream).beacon
        view = ctl.committer.view
        assert view is not None
        await ctl.tick()
        clock.advance(1.5)  # the leader did not run for 1.5 s (> stall_after_s): a's silence is no evidence
        await ctl.tick()
        assert view.verdicts["a"].state is State.SUSPECT and not stream.probe_pending
        queued = [_beacon("a", target.key_id, 1, target.key)]  # a beacon waiting in the socket
        membership.drain_beacons = lambda: [membership.on_beacon(b) for b in queued] and None
        clock.advance(0.1)
        await ctl.tick()
        assert view.verdicts["a"].state is State.ALIVE and not stream.probe_pending
        queued.clear()
        for _ in range(13):  # silent again, the leader running: probed
            clock.advance(0.1)
            await ctl.tick()
        assert stream.probe_pending

    asyncio.run(scenario())
