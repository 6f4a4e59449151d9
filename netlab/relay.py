"""A slow link in user space, for :meth:`ftd.netlab.Lab.delay` on kernels without ``sch_netem``.

``python netlab_relay.py HOST_PORT BRIDGE_PORT DELAY_MS [JITTER_MS]`` runs in the lab's switch
namespace, where the host's switch-side veth (HOST_PORT) has been taken off the bridge and BRIDGE_PORT
is one end of a veth pair whose other end is on the bridge. Frames from the host are held for
DELAY_MS (± JITTER_MS, order kept) before going on; frames to the host pass at once. Sockets carry a
virtio-net header, so offloaded (GSO, partial-checksum) frames pass unchanged. Stdlib only: it runs
with ``python -I`` by file path. It stops when its parent (the lab) goes, after ``--lifetime-s``, or
when an interface disappears; every loop is bounded.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import random
import select
import socket
import sys
import time

SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING, ETH_P_ALL = 263, 15, 23, 3
_MAX_FRAME = 65536 + 10  # a GSO super-frame plus the virtio-net header
_BATCH = 256  # frames read per socket per wake-up, so neither direction starves the other
_GONE = (errno.ENXIO, errno.ENODEV, errno.ENETDOWN)


def _open(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not our own sends back
    s.bind((ifname, 0))
    s.setblocking(False)
    return s


def _send(s: socket.socket, frame: bytes) -> None:
    try:
        s.send(frame)
    except BlockingIOError:
        pass  # a full queue drops the frame, like a real link
    except OSError as exc:
        if exc.errno in _GONE:
            raise
        # other errors (ENOBUFS, EMSGSIZE) lose this frame only


def relay(host_port: str, bridge_port: str, delay_s: float, jitter_s: float, lifetime_s: float) -> None:
    host, bridge = _open(host_port), _open(bridge_port)
    print("ready", flush=True)
    parent, end = os.getppid(), time.monotonic() + lifetime_s
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    last_due = 0.0
    while os.getppid() == parent and time.monotonic() < end:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _send(bridge, held.popleft()[1])
        wait = min(0.5, held[0][0] - now) if held else 0.5
        for s in select.select([host, bridge], [], [], max(0.0, wait))[0]:
            for _ in range(_BATCH):
                try:
                    frame = s.recv(_MAX_FRAME)
                except BlockingIOError:
                    break
                if s is bridge:
                    _send(host, frame)
                    continue
                due = time.monotonic() + delay_s + random.uniform(-jitter_s, jitter_s)
                last_due = max(due, last_due)
                held.append((last_due, frame))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("host_port")
    p.add_argument("bridge_port")
    p.add_argument("delay_ms", type=float)
    p.add_argument("jitter_ms", type=float, nargs="?", default=0.0)
    p.add_argument("--lifetime-s", type=float, default=24 * 3600.0)
    a = p.parse_args(argv)
    try:
        relay(a.host_port, a.bridge_port, a.delay_ms / 1000, a.jitter_ms / 1000, a.lifetime_s)
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
