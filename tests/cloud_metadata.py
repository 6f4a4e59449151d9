"""Fake cloud metadata servers for the preemption tests (test_preemption*.py): an HTTP server on 127.0.0.1
answering from a table of routes and recording every request, AWS IMDSv2 on top of it (session tokens
that can be revoked), an address nobody listens on, and the fixed time the notices are dated from (the
tests move this clock, never sleep). The fixtures ``md`` and ``silent_port``: conftest.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ftd.ftctl.etcd_server import free_port

T0 = 1_800_000_000.0  # a fixed "now", 2027-01-15T08:00:00Z: tests move this clock, never sleep
AWS_TIME = "2027-01-15T08:02:00Z"
AWS_DEADLINE = T0 + 120

Route = tuple[int, bytes] | tuple[int, bytes, dict[str, str]] | Callable[["Request"], tuple[Any, ...]]


class Request:
    """One request as the server received it (header names in lower case)."""

    def __init__(self, method: str, path: str, headers: dict[str, str]) -> None:
        self.method, self.path, self.headers = method, path, headers


class FakeMetadata:
    """A metadata server on 127.0.0.1: ``routes[(METHOD, path?query)]`` is ``(status, body[, headers])``
    or a function of the request; anything else is 404. Every request is recorded."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.requests: list[Request] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                req = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
                fake.requests.append(req)
                route = fake.routes.get((self.command, self.path), (404, b"Not Found"))
                answer: tuple[Any, ...] = route(req) if callable(route) else route
                status, body = answer[0], answer[1]
                headers: dict[str, str] = answer[2] if len(answer) > 2 else {}
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def count(self, method: str, path: str) -> int:
        return sum(1 for r in list(self.requests) if r.method == method and r.path == path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"


class Imds:
    """IMDSv2 behaviour on a FakeMetadata: tokens are issued by PUT and can be revoked (401)."""

    def __init__(self, md: FakeMetadata) -> None:
        self.md = md
        self.issued = 0
        self.valid: set[str] = set()
        self.action: bytes | None = None
        self.rebalance: bytes | None = None
        md.routes[("PUT", TOKEN_PATH)] = self._token
        md.routes[("GET", ACTION_PATH)] = lambda r: self._get(r, self.action)
        md.routes[("GET", REBALANCE_PATH)] = lambda r: self._get(r, self.rebalance)

    def _token(self, req: Request) -> tuple[int, bytes]:
        if "x-aws-ec2-metadata-token-ttl-seconds" not in req.headers:
            return 400, b"missing TTL"
        self.issued += 1
        token = f"token-{self.issued}"
        self.valid.add(token)
        return 200, token.encode()

    def _get(self, req: Request, item: bytes | None) -> tuple[int, bytes]:
        if req.headers.get("x-aws-ec2-metadata-token") not in self.valid:
            return 401, b"Unauthorized"
        return (404, b"Not Found") if item is None else (200, item)

    def revoke(self) -> None:
        self.valid.clear()
