"""The daemons' HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness: the main loop is
running) and ``/readyz`` (readiness: the daemon is doing its job). Kubernetes probes and load balancers
use the last two; each answers 200 or 503 with a one-line reason.

The endpoint is plaintext and reachable by whoever reaches the port, so it is bounded: a connection that
sends no complete request within :data:`TIMEOUT_S` is closed, and at most :data:`MAX_CONNECTIONS` are
served at once (one more is closed at once): idle connections cost a thread each and, without a timeout,
were kept for ever."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("ftd.http")
Check = Callable[[], tuple[bool, str]]
TIMEOUT_S = 5.0  # a connection's socket timeout: a request line, headers and each write
MAX_CONNECTIONS = 256  # connections served at once (a thread each); Prometheus and probes need a few


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most ``max_connections`` of them: one more is closed unserved."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 dropped connections arriving together)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections closed unserved because every slot was taken

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def serve(host: str, port: int, registry: CollectorRegistry, healthy: Check, ready: Check,
          timeout_s: float = TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> BoundedHTTPServer:
    """Starts the endpoint on a daemon thread; returns the server (``server.server_port`` is the port)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler sets it on the socket: an idle connection is closed

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                ok, why = (healthy if path == "/healthz" else ready)()
                self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    server = BoundedHTTPServer((host, port), Handler, max_connections)
    threading.Thread(target=server.serve_forever, name="ftd-http", daemon=True).start()
    return server
