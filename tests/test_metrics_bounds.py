"""The plaintext metrics endpoint is bounded (ftd/metrics_http.py): an idle connection is closed after the
timeout, and one past the cap is closed at once while the others are served. In-process, a short timeout."""

from __future__ import annotations

import socket
import time
import urllib.request

from doubles import closed_within
from prometheus_client import CollectorRegistry

from ftd import metrics_http


def test_idle_connections_time_out_and_one_past_the_cap_is_closed_unserved() -> None:
    server = metrics_http.serve("127.0.0.1", 0, CollectorRegistry(), lambda: (True, "ok"), lambda: (True, "ok"),
                                timeout_s=0.5, max_connections=2)
    try:
        idle = [socket.create_connection(("127.0.0.1", server.server_port), timeout=2) for _ in range(2)]
        extra = socket.create_connection(("127.0.0.1", server.server_port), timeout=2)
        assert closed_within(extra, 0.4)  # every slot taken: closed before any timeout
        assert server.refused >= 1
        started = time.monotonic()
        assert all(closed_within(s, 3.0) for s in idle)
        assert time.monotonic() - started < 2.0
        for s in [*idle, extra]:
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/healthz", timeout=3) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"  # the slots came back
    finally:
        server.shutdown()
        server.server_close()
