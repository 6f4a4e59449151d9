"""The leader's stall guard with beacons (coordinator/beacon_listener.py ``judged_on_beacons``): after a gap
of the leader's own, the beaconing nodes are judged on the beacons that waited in the port when the kernel
dropped none there (``SO_MEMINFO``), everyone else keeps the stall's grace; in a stalled judgement nobody
is probed, and beacons queued in the socket count before judging. The in-memory controller, no sleeping."""

from __future__ import annotations

import asyncio
import socket

import pytest
from test_beacons import _beacon, _beaconing_leader, _hb

from ftd.coordinator.beacon_listener import BeaconPort, BeaconProtocol, judged_on_beacons
from ftd.coordinator.detector import State


def test_no_probe_in_a_stalled_judgement_and_queued_beacons_count_before_judging() -> None:
    async def scenario() -> None:
        clock, ctl, stream = await _beaconing_leader()
        membership = ctl.membership
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


@pytest.mark.parametrize("lost", [False, True])
def test_after_a_stall_beaconing_nodes_are_judged_on_their_queued_beacons_unless_the_port_lost_some(
        lost: bool) -> None:
    """The leader busy for 3 s (a burst of work: no freeze, no datagram lost): a beaconing node that
    died is declared on the tick after the gap, one whose beacons waited in the port is alive, and a
    node judged on its stream keeps the stall's grace. A port that dropped datagrams: grace for all."""
    async def scenario() -> None:
        clock, ctl, a = await _beaconing_leader()
        membership, view = ctl.membership, ctl.committer.view
        assert view is not None
        b = membership.open_stream(_hb("b"))
        membership.open_stream(_hb("s", beaconing=False))
        target = membership.heartbeat_response(a).beacon
        assert membership.heartbeat_response(b).HasField("beacon")
        membership.beacons_lost = lambda: lost
        await ctl.tick()
        epoch = ctl.store.world.epoch
        clock.advance(3.0)  # b died; the leader did not judge for 3 s; a's beacon waits in the socket
        queued = [_beacon("a", target.key_id, 1, target.key)]
        membership.drain_beacons = lambda: [membership.on_beacon(x) for x in queued] and None
        await ctl.tick()
        assert view.verdicts["a"].state is State.ALIVE
        assert view.verdicts["s"].state is State.SUSPECT and view.liveness["s"].grace_until > clock.now
        if lost:
            assert view.verdicts["b"].state is State.SUSPECT and ctl.store.world.epoch == epoch
            assert view.liveness["b"].grace_until > clock.now, "its beacons may have been lost: grace"
        else:
            assert ctl.store.world.epoch == epoch + 1 and "b" not in ctl.store.world.ranks, "declared at once"
            assert ctl.store.nodes["b"].fence is not None

    asyncio.run(scenario())


def test_judged_on_beacons_only_after_a_stall_and_only_when_nothing_was_lost() -> None:
    nodes = lambda: iter(("a", "b"))  # noqa: E731
    assert judged_on_beacons(10.0, 7.0, 1.0, False, nodes) == {"a", "b"}
    assert judged_on_beacons(10.0, 7.0, 1.0, True, nodes) == frozenset(), "the port dropped datagrams"
    assert judged_on_beacons(10.0, 9.5, 1.0, False, nodes) == frozenset(), "no stall: judged as always"
    assert judged_on_beacons(10.0, None, 1.0, False, nodes) == frozenset(), "a term's first judgement"


def test_the_beacon_port_says_whether_the_kernel_dropped_datagrams_since_it_was_last_asked() -> None:
    """What lets a judgement after a stall trust queued beacons (judged_on_beacons): SO_MEMINFO's drops."""
    async def scenario() -> None:
        _, ctl, _ = await _beaconing_leader()
        metrics = ctl.metrics
        protocol = BeaconProtocol(ctl.membership.on_beacon, metrics.beacons_accepted, metrics.beacons_dropped)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # room for a few datagrams
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        port = BeaconPort(sock, protocol)
        try:
            assert not port.lost()
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as agent:
                for _ in range(200):  # the loop does not run meanwhile: nothing reads them
                    agent.sendto(b"x" * 100, sock.getsockname())
            assert port.lost(), "a full buffer dropped some"
            port.drain()
            assert not port.lost(), "counted once: nothing dropped since"
        finally:
            port.close()

    asyncio.run(scenario())
