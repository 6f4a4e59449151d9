"""Preemption notices: each cloud's format against a fake metadata server on 127.0.0.1, the file and
signal triggers, and the watcher (once per notice, bounded, stops by itself). Nothing sleeps: the
clock is an argument, threads are awaited with deadlines."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ftd.agent.preemption import (
    AwsImds,
    AzureScheduledEvents,
    FileTrigger,
    GceMetadata,
    MalformedNotice,
    Notice,
    NoticeKind,
    NoticeSource,
    PreemptionConfig,
    PreemptionWatcher,
    SignalTrigger,
    SourceUnreachable,
    build_sources,
    detect_clouds,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gce_preempted,
    parse_trigger_file,
    signal_number,
)
from ftd.ftctl.etcd_server import free_port
from ftd.settings import SettingsError, load
from ftd.waiting import wait_for

T0 = 1_800_000_000.0  # a fixed "now", 2027-01-15T08:00:00Z: tests move this clock, never sleep
AWS_TIME = "2027-01-15T08:02:00Z"
AWS_DEADLINE = T0 + 120

Route = tuple[int, bytes] | tuple[int, bytes, dict[str, str]] | Callable[["Request"], tuple[Any, ...]]


class Request:
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


@pytest.fixture
def md() -> Iterator[FakeMetadata]:
    server = FakeMetadata()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers: a hung metadata server."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


# ---- AWS ---------------------------------------------------------------------------------------

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


def test_aws_parsers() -> None:
    n = parse_aws_instance_action(json.dumps({"action": "terminate", "time": AWS_TIME}).encode())
    assert (n.source, n.kind, n.deadline_unix) == ("aws", NoticeKind.TERMINATE, AWS_DEADLINE)
    assert parse_aws_instance_action(b'{"action": "stop", "time": "2027-01-15T08:02:00Z"}').kind is NoticeKind.STOP
    hib = parse_aws_instance_action(b'{"action": "hibernate", "time": "2027-01-15T08:02:00Z"}')
    assert hib.kind is NoticeKind.STOP and "hibernat" in hib.detail
    r = parse_aws_rebalance(b'{"noticeTime": "2020-10-27T08:22:00Z"}')
    assert (r.kind, r.deadline_unix) == (NoticeKind.REBALANCE, None) and "2020-10-27T08:22:00Z" in r.detail
    for bad, why in [(b'{"action": "terminate", "time": ', "not JSON"), (b'["terminate"]', "JSON object"),
                     (b'{"action": "explode", "time": "2027-01-15T08:02:00Z"}', "unknown action"),
                     (b'{"action": "stop", "time": "soon"}', "ISO 8601"), (b'{"action": "stop"}', "time is None")]:
        with pytest.raises(MalformedNotice, match=why):
            parse_aws_instance_action(bad)
    with pytest.raises(MalformedNotice, match="noticeTime"):
        parse_aws_rebalance(b"{}")


def test_aws_absent_then_present_with_the_deadline(md: FakeMetadata) -> None:
    imds = Imds(md)
    aws = AwsImds(md.url, timeout_s=1.0, token_ttl_s=21600)
    assert aws.poll(T0) is None
    imds.action = json.dumps({"action": "terminate", "time": AWS_TIME}).encode()
    notice = aws.poll(T0 + 5)
    assert notice is not None and notice.kind is NoticeKind.TERMINATE
    assert notice.deadline_unix == AWS_DEADLINE
    again = aws.poll(T0 + 10)
    assert again is not None and again.key == notice.key  # the same notice on every poll
    token_put = next(r for r in md.requests if r.method == "PUT")
    assert token_put.headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert imds.issued == 1  # one session token for all the polls


def test_aws_rebalance_when_no_interruption_yet(md: FakeMetadata) -> None:
    imds = Imds(md)
    imds.rebalance = b'{"noticeTime": "2027-01-15T07:59:00Z"}'
    notice = AwsImds(md.url).poll(T0)
    assert notice is not None and notice.kind is NoticeKind.REBALANCE and notice.deadline_unix is None
    assert not notice.ends_node(T0, 900)


def test_aws_token_is_renewed_after_401_and_when_its_ttl_runs_out(md: FakeMetadata) -> None:
    imds = Imds(md)
    aws = AwsImds(md.url, token_ttl_s=600)
    assert aws.poll(T0) is None and imds.issued == 1
    imds.revoke()  # expired on IMDS's side (or the wall clock jumped)
    imds.action = b'{"action": "stop", "time": "2027-01-15T08:02:00Z"}'
    notice = aws.poll(T0 + 1)
    assert notice is not None and notice.kind is NoticeKind.STOP and imds.issued == 2
    assert aws.poll(T0 + 2) is not None and imds.issued == 2
    assert aws.poll(T0 + 600) is not None and imds.issued == 3  # renewed before its TTL, without a 401
    assert md.count("GET", ACTION_PATH) == 4 + 1  # the 401 was retried once


def test_aws_token_refused_twice_is_unreachable(md: FakeMetadata) -> None:
    md.routes[("PUT", TOKEN_PATH)] = (200, b"token-x")
    md.routes[("GET", ACTION_PATH)] = (401, b"Unauthorized")
    with pytest.raises(SourceUnreachable, match="HTTP 401"):
        AwsImds(md.url).poll(T0)
    assert md.count("PUT", TOKEN_PATH) == 2


def test_aws_malformed_answer_is_an_error_not_a_notice(md: FakeMetadata, caplog: pytest.LogCaptureFixture) -> None:
    imds = Imds(md)
    imds.action = b'{"action": "terminate", "time": '
    with pytest.raises(MalformedNotice, match="not JSON"):
        AwsImds(md.url).poll(T0)
    got: list[Notice] = []
    watcher = PreemptionWatcher([AwsImds(md.url)], got.append)
    with caplog.at_level(logging.ERROR, logger="ftd.agent.preemption"):
        assert watcher.poll_once(T0) == [] and watcher.poll_once(T0 + 5) == []
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert got == [] and len(errors) == 1  # rate-limited
    assert "aws" in errors[0].getMessage() and "does not parse" in errors[0].getMessage()


# ---- GCE ---------------------------------------------------------------------------------------

GCE_PATH = "/computeMetadata/v1/instance/preempted"


def gce_route(value: bytes) -> Callable[[Request], tuple[int, bytes, dict[str, str]]]:
    def answer(req: Request) -> tuple[int, bytes, dict[str, str]]:
        if req.headers.get("metadata-flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", {"Metadata-Flavor": "Google"}
        return 200, value, {"Metadata-Flavor": "Google"}
    return answer


def test_gce_parser() -> None:
    assert parse_gce_preempted(b"FALSE", T0, 30) is None
    n = parse_gce_preempted(b"TRUE\n", T0, 30)
    assert n is not None and (n.kind, n.deadline_unix) == (NoticeKind.PREEMPT, T0 + 30)
    with pytest.raises(MalformedNotice, match="TRUE or FALSE"):
        parse_gce_preempted(b"<html>", T0, 30)


def test_gce_absent_then_preempted_keeps_its_first_deadline(md: FakeMetadata) -> None:
    md.routes[("GET", GCE_PATH)] = gce_route(b"FALSE")
    gce = GceMetadata(md.url, notice_s=30)
    assert gce.poll(T0) is None
    md.routes[("GET", GCE_PATH)] = gce_route(b"TRUE")
    first = gce.poll(T0 + 5)
    assert first is not None and first.kind is NoticeKind.PREEMPT and first.deadline_unix == T0 + 35
    assert gce.poll(T0 + 10) == first
    assert gce.probe(0.5)
    md.routes[("GET", GCE_PATH)] = gce_route(b"maybe")
    with pytest.raises(MalformedNotice):
        GceMetadata(md.url).poll(T0)


def test_gce_probe_wants_googles_header(md: FakeMetadata) -> None:
    md.routes[("GET", GCE_PATH)] = (200, b"FALSE")  # an answer, but not from Google's metadata server
    assert not GceMetadata(md.url).probe(0.5)


# ---- Azure -------------------------------------------------------------------------------------

EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
NOT_BEFORE = "Fri, 15 Jan 2027 08:00:30 GMT"  # T0 + 30


def azure_doc(*events: dict[str, Any]) -> bytes:
    return json.dumps({"DocumentIncarnation": 2, "Events": list(events)}).encode()


def azure_event(event_type: str = "Preempt", resources: tuple[str, ...] = ("vm-7",), not_before: str = NOT_BEFORE,
                event_id: str = "602d9444-d2cd-49c7-8624-8643e7171297") -> dict[str, Any]:
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": "Scheduled", "NotBefore": not_before,
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


def azure_route(body: bytes) -> Callable[[Request], tuple[int, bytes]]:
    def answer(req: Request) -> tuple[int, bytes]:
        return (200, body) if req.headers.get("metadata") == "true" else (400, b"Bad Request")
    return answer


def test_azure_parser() -> None:
    assert parse_azure_events(azure_doc(), "vm-7", T0) is None
    n = parse_azure_events(azure_doc(azure_event()), "VM-7", T0)  # names compare without case
    assert n is not None and (n.kind, n.deadline_unix) == (NoticeKind.PREEMPT, T0 + 30)
    assert n.key == "azure:602d9444-d2cd-49c7-8624-8643e7171297"
    assert parse_azure_events(azure_doc(azure_event(resources=("vm-8", "vm-9"))), "vm-7", T0) is None
    assert parse_azure_events(azure_doc(azure_event("Freeze")), "vm-7", T0) is None
    reboot = parse_azure_events(azure_doc(azure_event("Reboot")), "vm-7", T0)
    assert reboot is not None and reboot.kind is NoticeKind.STOP
    started = parse_azure_events(azure_doc(azure_event(not_before="")), "vm-7", T0)
    assert started is not None and started.deadline_unix == T0
    urgent = parse_azure_events(azure_doc(azure_event("Reboot", not_before="Sat, 16 Jan 2027 10:00:00 GMT",
                                                      event_id="a"), azure_event(event_id="b")), "vm-7", T0)
    assert urgent is not None and urgent.key == "azure:b"
    for bad, why in [(b"{", "not JSON"), (b'{"Events": {}}', "expected a list"),
                     (azure_doc(azure_event(not_before="tomorrow")), "HTTP date")]:
        with pytest.raises(MalformedNotice, match=why):
            parse_azure_events(bad, "vm-7", T0)


def test_azure_event_for_this_vm_and_not_for_another(md: FakeMetadata) -> None:
    md.routes[("GET", NAME_PATH)] = azure_route(b"vm-7")
    md.routes[("GET", EVENTS_PATH)] = azure_route(azure_doc())
    azure = AzureScheduledEvents(md.url)
    assert azure.poll(T0) is None and azure.vm_name == "vm-7"
    md.routes[("GET", EVENTS_PATH)] = azure_route(azure_doc(azure_event(resources=("vm-8",))))
    assert azure.poll(T0) is None  # the same availability set, another VM
    md.routes[("GET", EVENTS_PATH)] = azure_route(azure_doc(azure_event(resources=("vm-8", "vm-7"))))
    notice = azure.poll(T0)
    assert notice is not None and notice.kind is NoticeKind.PREEMPT and notice.deadline_unix == T0 + 30
    assert md.count("GET", NAME_PATH) == 1  # the name is asked once


def test_azure_configured_name_and_malformed_document(md: FakeMetadata) -> None:
    md.routes[("GET", EVENTS_PATH)] = azure_route(azure_doc(azure_event(resources=("train-3",))))
    notice = AzureScheduledEvents(md.url, vm_name="train-3").poll(T0)
    assert notice is not None and md.count("GET", NAME_PATH) == 0
    md.routes[("GET", EVENTS_PATH)] = azure_route(b'{"DocumentIncarnation": 3, "Events": [')
    with pytest.raises(MalformedNotice, match="not JSON"):
        AzureScheduledEvents(md.url, vm_name="train-3").poll(T0)


# ---- unreachable servers and auto-detection ----------------------------------------------------


def test_unreachable_is_no_notice_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    sources: list[NoticeSource] = [AwsImds(closed_url(), timeout_s=0.5), GceMetadata(closed_url(), timeout_s=0.5),
                                   AzureScheduledEvents(closed_url(), timeout_s=0.5, vm_name="vm-7")]
    for s in sources:
        with pytest.raises(SourceUnreachable):
            s.poll(T0)
    got: list[Notice] = []
    watcher = PreemptionWatcher(sources, got.append, log_every_s=60)
    with caplog.at_level(logging.INFO, logger="ftd.agent.preemption"):
        for i in range(3):
            assert watcher.poll_once(T0 + i) == []
    lines = [r.getMessage() for r in caplog.records]
    assert got == [] and len(lines) == 3  # one per source, not one per poll
    assert all("unreachable, taken as no notice" in line for line in lines)
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_a_hung_metadata_server_is_bounded_by_the_timeout(silent_port: int) -> None:
    started = time.monotonic()
    with pytest.raises(SourceUnreachable):
        AwsImds(f"http://127.0.0.1:{silent_port}", timeout_s=0.2).poll(T0)
    assert time.monotonic() - started < 3.0


def test_auto_detection_keeps_the_clouds_that_answer(md: FakeMetadata, silent_port: int) -> None:
    Imds(md)
    hung = f"http://127.0.0.1:{silent_port}"
    started = time.monotonic()
    found = detect_clouds([AwsImds(md.url), GceMetadata(hung), AzureScheduledEvents(closed_url())], 0.2)
    assert [s.name for s in found] == ["aws"]
    assert time.monotonic() - started < 3.0
    config = PreemptionConfig(sources=("auto",), aws_endpoint=md.url, gce_endpoint=hung, azure_endpoint=hung,
                              detect_timeout_s=0.2)
    assert [s.name for s in build_sources(config)] == ["aws"]
    assert build_sources(config, detect=False) == []


# ---- file and signal triggers ------------------------------------------------------------------


def test_trigger_file_formats() -> None:
    plain = parse_trigger_file(b"slurm says bye\n", T0, key="k")
    assert (plain.kind, plain.deadline_unix, plain.detail) == (NoticeKind.TERMINATE, None, "slurm says bye")
    assert parse_trigger_file(b"", T0, key="k").detail == "trigger file present"
    doc = parse_trigger_file(b'{"kind": "preempt", "deadline": 1800000090, "detail": "x"}', T0, key="k")
    assert (doc.kind, doc.deadline_unix, doc.detail) == (NoticeKind.PREEMPT, 1_800_000_090.0, "x")
    assert parse_trigger_file(b'{"deadline": "2027-01-15T08:02:00Z"}', T0, key="k").deadline_unix == AWS_DEADLINE
    assert parse_trigger_file(b'{"in_s": 90}', T0, key="k").deadline_unix == T0 + 90
    for bad, why in [(b'{"deadline": ', "not JSON"), (b'{"kind": "nap"}', "unknown kind"),
                     (b'{"deadline": [1]}', "deadline"), (b'{"in_s": "soon"}', "in_s")]:
        with pytest.raises(MalformedNotice, match=why):
            parse_trigger_file(bad, T0, key="k")


def test_file_trigger(tmp_path: Path) -> None:
    path = tmp_path / "preempt"
    trigger = FileTrigger(path)
    assert trigger.poll(T0) is None
    path.write_text(json.dumps({"kind": "preempt", "in_s": 60}))
    first = trigger.poll(T0)
    assert first is not None and first.kind is NoticeKind.PREEMPT and first.deadline_unix is not None
    assert abs(first.deadline_unix - (path.stat().st_mtime + 60)) < 1e-6
    assert trigger.poll(T0 + 1) == first  # the same file is the same notice
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    second = trigger.poll(T0 + 2)
    assert second is not None and second.key != first.key  # rewritten: a new notice
    path.unlink()
    assert trigger.poll(T0 + 3) is None


def test_signal_trigger_from_a_real_signal() -> None:
    trigger = SignalTrigger(signal.SIGUSR1, deadline_s=120)
    before = signal.getsignal(signal.SIGUSR1)
    trigger.install()
    try:
        assert trigger.poll(T0) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        notice = wait_for(lambda: trigger.poll(T0), 5, "the SIGUSR1 notice")
        assert notice.source == "signal" and notice.kind is NoticeKind.TERMINATE and "SIGUSR1" in notice.detail
        assert notice.deadline_unix is not None and 0 < notice.deadline_unix - time.time() <= 120
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal: still the same notice
        assert trigger.poll(T0) == notice
        trigger.clear()
        assert trigger.poll(T0) is None
        trigger.fire(T0)
        again = trigger.poll(T0)
        assert again is not None and again.key != notice.key and again.deadline_unix == T0 + 120
    finally:
        trigger.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_signal_names() -> None:
    assert signal_number("SIGUSR1") == signal_number("usr1") == signal.SIGUSR1
    assert signal_number(str(int(signal.SIGTERM))) == signal.SIGTERM
    with pytest.raises(ValueError, match="unknown signal"):
        signal_number("SIGNOPE")


# ---- the watcher -------------------------------------------------------------------------------


class Scripted:
    """A source answering from a list the test changes."""

    def __init__(self, name: str = "scripted") -> None:
        self.name = name
        self.current: Notice | None = None
        self.polls = 0

    def poll(self, now_unix: float) -> Notice | None:
        self.polls += 1
        return self.current


def test_watcher_calls_on_notice_once_per_distinct_notice(md: FakeMetadata) -> None:
    imds = Imds(md)
    got: list[Notice] = []
    watcher = PreemptionWatcher([AwsImds(md.url)], got.append, poll_interval_s=0.02, stop_after_final=False)
    watcher.start()
    try:
        wait_for(lambda: watcher.polls >= 3, 10, "three quiet polls")
        assert got == []
        imds.rebalance = b'{"noticeTime": "2027-01-15T07:59:00Z"}'
        wait_for(lambda: got, 10, "the rebalance notice")
        seen = watcher.polls
        wait_for(lambda: watcher.polls >= seen + 5, 10, "five more polls")
        assert [n.kind for n in got] == [NoticeKind.REBALANCE]
        imds.action = json.dumps({"action": "terminate", "time": AWS_TIME}).encode()
        wait_for(lambda: len(got) == 2, 10, "the interruption notice")
        seen = watcher.polls
        wait_for(lambda: watcher.polls >= seen + 5, 10, "five more polls")
        assert [n.kind for n in got] == [NoticeKind.REBALANCE, NoticeKind.TERMINATE]
        assert watcher.running  # stop_after_final=False: it goes on until stopped
    finally:
        assert watcher.stop(timeout_s=5)


def test_watcher_stops_by_itself_after_a_final_notice() -> None:
    source = Scripted()
    got: list[Notice] = []
    watcher = PreemptionWatcher([source], got.append, poll_interval_s=0.02)
    watcher.start()
    wait_for(lambda: source.polls >= 2, 10, "two polls")
    source.current = Notice("scripted", NoticeKind.REBALANCE, None, "risk")
    wait_for(lambda: got, 10, "the rebalance notice")
    assert watcher.running  # a recommendation is not the end
    source.current = Notice("scripted", NoticeKind.PREEMPT, time.time() + 30, "reclaimed")
    assert watcher.wait(10), "the watcher did not stop after the preemption notice"
    assert [n.kind for n in got] == [NoticeKind.REBALANCE, NoticeKind.PREEMPT]
    assert watcher.final is not None and watcher.final.kind is NoticeKind.PREEMPT
    polls = source.polls
    assert watcher.stop(1) and source.polls == polls


def test_a_far_deadline_is_not_final() -> None:
    reboot = Notice("azure", NoticeKind.STOP, T0 + 3 * 86400, "degraded hardware")
    assert not reboot.ends_node(T0, 900) and reboot.ends_node(T0 + 3 * 86400 - 600, 900)
    notice = Notice("file", NoticeKind.TERMINATE, None, "x")
    assert notice.ends_node(T0, 900) and notice.key == "file:terminate:None"
    assert notice.to_dict() == {"source": "file", "kind": "terminate", "deadline_unix": None, "detail": "x",
                                "key": "file:terminate:None"}
    assert reboot.describe(T0) == "azure stop (259200s left): degraded hardware"


def test_watcher_stop_is_bounded_by_the_request_timeout(silent_port: int) -> None:
    watcher = PreemptionWatcher([AwsImds(f"http://127.0.0.1:{silent_port}", timeout_s=0.2)], lambda n: None,
                                poll_interval_s=0.01)
    watcher.start()
    wait_for(lambda: watcher.polls >= 2, 10, "two polls of the hung server")
    started = time.monotonic()
    assert watcher.stop(timeout_s=5)
    assert time.monotonic() - started < 3.0


def test_a_failing_callback_or_source_does_not_stop_the_watcher(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        name = "broken"

        def poll(self, now_unix: float) -> Notice | None:
            raise KeyError("bug")

    good = Scripted()
    good.current = Notice("scripted", NoticeKind.REBALANCE, None, "risk")

    def explode(notice: Notice) -> None:
        raise RuntimeError("callback bug")

    watcher = PreemptionWatcher([Broken(), good], explode)
    with caplog.at_level(logging.ERROR, logger="ftd.agent.preemption"):
        assert len(watcher.poll_once(T0)) == 1
        assert watcher.poll_once(T0 + 1) == []  # delivered once even though the callback failed
    messages = [r.getMessage() for r in caplog.records]
    assert any("broken failed" in m for m in messages) and any("on_notice failed" in m for m in messages)


def test_watcher_from_config_with_file_and_signal(tmp_path: Path) -> None:
    trigger = tmp_path / "drain"
    config = PreemptionConfig(sources=("file", "signal"), file_path=trigger, poll_interval_s=0.02,
                              signal_name="USR2")
    got: list[Notice] = []
    watcher = PreemptionWatcher.from_config(config, got.append)
    assert [s.name for s in watcher.sources] == ["file", "signal"]
    before = signal.getsignal(signal.SIGUSR2)
    watcher.start()  # pytest runs tests in the main thread: the handler is installed
    try:
        wait_for(lambda: watcher.polls >= 2, 10, "two polls")
        (tmp_path / "drain.tmp").write_text("maintenance window")
        os.replace(tmp_path / "drain.tmp", trigger)  # atomically: a poll never sees it half written
        assert watcher.wait(10)
        assert [(n.source, n.detail) for n in got] == [("file", "maintenance window")]
    finally:
        watcher.stop()
    assert signal.getsignal(signal.SIGUSR2) == before


# ---- configuration -----------------------------------------------------------------------------


def test_config_defaults_and_validation(tmp_path: Path) -> None:
    c = PreemptionConfig()
    assert c.sources == ("auto",) and c.poll_interval_s == 5.0 and c.signum == signal.SIGUSR1
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sources": ("aws", "oracle")}, "sources"), ({"sources": ()}, "sources"),
        ({"sources": ("file",)}, "file_path"), ({"signal_name": "SIGNOPE"}, "signal_name"),
        ({"poll_interval_s": 0}, "poll_interval_s"), ({"aws_token_ttl_s": 21601}, "aws_token_ttl_s"),
        ({"gce_endpoint": "metadata.google.internal"}, "gce_endpoint"),
    ]
    for kwargs, field in cases:
        with pytest.raises(SettingsError) as err:
            PreemptionConfig(**kwargs)
        assert err.value.field == field
    loaded = load(PreemptionConfig, ["--sources", "aws,file", "--file-path", str(tmp_path / "t")],
                  {"FTD_PREEMPT_POLL_INTERVAL_S": "2"}, prog="t", env_prefix="FTD_PREEMPT_")
    assert loaded.sources == ("aws", "file") and loaded.poll_interval_s == 2.0 and loaded.file_path == tmp_path / "t"


def test_recovery_is_logged_and_an_empty_watcher_starts_no_thread(caplog: pytest.LogCaptureFixture) -> None:
    class Flaky:
        name = "flaky"
        up = False

        def poll(self, now_unix: float) -> Notice | None:
            if not self.up:
                raise SourceUnreachable("connection refused")
            return None

    flaky = Flaky()
    watcher = PreemptionWatcher([flaky], lambda n: None)
    with caplog.at_level(logging.INFO, logger="ftd.agent.preemption"):
        watcher.poll_once(T0)
        flaky.up = True
        watcher.poll_once(T0 + 1)
        watcher.poll_once(T0 + 2)
    assert [r.getMessage() for r in caplog.records] == [
        "preemption source flaky unreachable, taken as no notice: connection refused",
        "preemption source flaky answers again",
    ]
    empty = PreemptionWatcher([], lambda n: None)
    empty.start()
    assert not empty.running and empty.stop(1)
