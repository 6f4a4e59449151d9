"""Preemption notices from the clouds: each cloud's format (AWS, GCE, Azure) against a fake metadata
server on 127.0.0.1, unreachable and hung servers, and auto-detection. The file and signal triggers, the
watcher and the configuration: test_preemption_watcher.py; the fake servers: cloud_metadata.py. Nothing
sleeps: the clock is an argument, threads are awaited with deadlines."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from cloud_metadata import ACTION_PATH, AWS_DEADLINE, AWS_TIME, T0, TOKEN_PATH, FakeMetadata, Imds, Request, closed_url

from ftd.agent.preemption import PreemptionWatcher
from ftd.agent.preemption_notices import (
    MalformedNotice,
    Notice,
    NoticeKind,
    SourceUnreachable,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gce_preempted,
)
from ftd.agent.preemption_sources import (
    AwsImds,
    AzureScheduledEvents,
    GceMetadata,
    NoticeSource,
    PreemptionConfig,
    build_sources,
    detect_clouds,
)

# ---- AWS ---------------------------------------------------------------------------------------


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
