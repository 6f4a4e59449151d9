"""The daemons' HTTP endpoint: ``/metrics`` (Prometheus), ``/healthz`` (liveness: the main loop is
running) and ``/readyz`` (readiness: the daemon is doing its job). Kubernetes probes and load balancers
use the last two; each answers 200 or 503 with a one-line reason."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("ftd.http")
Check = Callable[[], tuple[bool, str]]


def serve(host: str, port: int, registry: CollectorRegistry, healthy: Check, ready: Check) -> ThreadingHTTPServer:
    """Starts the endpoint on a daemon thread; returns the server (``server.server_port`` is the port)."""

    class Handler(BaseHTTPRequestHandler):
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ftd-http", daemon=True).start()
    return server
