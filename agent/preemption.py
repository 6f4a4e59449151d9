"""Preemption notices: the cloud (or a scheduler, or an operator) says this node goes away soon.

A node that knows it is about to disappear can checkpoint, drain and hand its rank over on its own
terms instead of being declared dead by silence. This module only *hears* the notice: each source is
a :class:`NoticeSource` whose ``poll(now)`` returns a :class:`Notice` or ``None``, and one
:class:`PreemptionWatcher` thread polls them on a bounded cadence and calls ``on_notice`` once per
distinct notice. What to do about it is the agent daemon's business.

Formats, as the clouds document them (parsed by pure functions over the raw response bytes):

* **AWS, IMDSv2.** ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (1 s to
  6 h) returns a session token, sent back as ``X-aws-ec2-metadata-token``; an expired or invalid
  token gets ``401 Unauthorized`` and a new ``PUT`` is needed.
  ``GET /latest/meta-data/spot/instance-action`` is ``404`` until EC2 decides to interrupt, then
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}``, two minutes
  ahead (hibernation starts at once). ``GET /latest/meta-data/events/recommendations/rebalance`` is
  ``404`` or ``{"noticeTime": "2020-10-27T08:22:00Z"}``: elevated risk, no deadline. AWS advises
  polling every 5 s.
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
* **GCE.** ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` answers
  ``TRUE`` or ``FALSE`` (the server answers with the same header, which tells it from other clouds).
  ``?wait_for_change=true`` would long-poll; a plain bounded GET keeps one thread for every source.
  Spot/preemptible VMs get 30 s between the notice (ACPI G2 soft off) and the hard stop, so the
  deadline is *estimated* as first sighting + ``gce_notice_s``.
  https://cloud.google.com/compute/docs/instances/preemptible
  https://cloud.google.com/compute/docs/storing-retrieving-metadata
* **Azure Scheduled Events.** ``GET /metadata/scheduledevents?api-version=2020-07-01`` with
  ``Metadata: true`` returns ``{"DocumentIncarnation": N, "Events": [{"EventId", "EventType":
  "Preempt"|"Terminate"|"Reboot"|"Redeploy"|"Freeze", "ResourceType": "VirtualMachine",
  "Resources": [VM names], "EventStatus": "Scheduled"|"Started", "NotBefore": "Mon, 19 Sep 2016
  18:29:47 GMT" (empty once started), "Description", "EventSource", "DurationInSeconds"}]}``.
  Events go to every VM of an availability set or scale-set placement group, so only those naming
  this VM count (the configured name, else ``/metadata/instance/compute/name``). Preempt comes at
  least 30 s ahead; Reboot/Redeploy (10-15 min) are reported as ``stop``; Freeze (a pause of
  seconds) is ignored. The first request after 24 h without one may take up to two minutes.
  https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
* **File and signal triggers** for every other environment: a file that appears (a batch
  scheduler's prolog, a spot handler of another cloud, an operator), or a signal such as Slurm's
  ``--signal=USR1@120``.

An unreachable metadata server is "no notice", logged at most once per ``log_every_s``; an answer
that does not parse is logged as an error and is not a notice either. Every request has a timeout,
every loop ends, and the watcher stops by itself once a notice says the node goes away.
"""

from __future__ import annotations

import email.utils
import enum
import http.client
import json
import logging
import math
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ftd.settings import SettingsError, require, setting

log = logging.getLogger("ftd.agent.preemption")

CLOUDS = ("aws", "gce", "azure")
SOURCE_NAMES = ("auto", *CLOUDS, "file", "signal")
AWS_MAX_TOKEN_TTL_S = 21600
_MAX_BODY = 1 << 20  # a metadata answer is a few hundred bytes; anything this large is not one
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # link-local: never via a proxy


# ---- the record and the errors of this boundary -----------------------------------------------


class NoticeKind(str, enum.Enum):
    TERMINATE = "terminate"  # the instance is deleted
    STOP = "stop"            # stopped, hibernated, rebooted or redeployed: gone for a while
    REBALANCE = "rebalance"  # elevated risk of interruption; no deadline
    PREEMPT = "preempt"      # a spot/preemptible VM is reclaimed


@dataclass(frozen=True)
class Notice:
    """One notice. ``key`` identifies it across polls (the same notice is seen on every poll until
    the node goes away), so the watcher delivers it once; by default it is derived from the rest."""

    source: str
    kind: NoticeKind
    deadline_unix: float | None  # when the node goes away (wall clock), None when unknown
    detail: str
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", f"{self.source}:{self.kind.value}:{self.deadline_unix}")

    def seconds_left(self, now_unix: float) -> float | None:
        return None if self.deadline_unix is None else self.deadline_unix - now_unix

    def ends_node(self, now_unix: float, horizon_s: float) -> bool:
        """The node goes away soon: anything but a rebalance recommendation, with no deadline or one
        within ``horizon_s`` (an Azure reboot planned days ahead for degraded hardware is not final)."""
        if self.kind is NoticeKind.REBALANCE:
            return False
        left = self.seconds_left(now_unix)
        return left is None or left <= horizon_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, e.g. for the agent's status or an event to the coordinator."""
        return {"source": self.source, "kind": self.kind.value, "deadline_unix": self.deadline_unix,
                "detail": self.detail, "key": self.key}

    def describe(self, now_unix: float) -> str:
        left = self.seconds_left(now_unix)
        when = "no deadline" if left is None else f"{left:.0f}s left"
        return f"{self.source} {self.kind.value} ({when}): {self.detail}"


class PreemptionError(Exception):
    """Base of the errors of this boundary."""


class MalformedNotice(PreemptionError):
    """An answer that does not parse: a bug or a format change. Logged as an error, not a notice."""


class SourceUnreachable(PreemptionError):
    """The source did not answer (refused, timed out, unexpected status): "no notice", logged
    rate-limited. Not an error of the node."""


# ---- pure parsers -----------------------------------------------------------------------------


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedNotice(f"{what}: not JSON ({exc}): {body[:120]!r}") from exc
    if not isinstance(doc, dict):
        raise MalformedNotice(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def parse_iso_time(text: str, what: str) -> float:
    """ISO 8601 as EC2 writes it (``2017-09-18T08:22:00Z``; no zone means UTC) → unix seconds."""
    value = text.strip()
    if value[-1:] in ("Z", "z"):
        value = value[:-1] + "+00:00"
    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise MalformedNotice(f"{what}: not an ISO 8601 time: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def parse_http_date(text: str, what: str) -> float:
    """An RFC 1123 date as Azure writes it (``Mon, 19 Sep 2016 18:29:47 GMT``) → unix seconds."""
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError) as exc:
        raise MalformedNotice(f"{what}: not an HTTP date: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


_AWS_ACTIONS = {"terminate": NoticeKind.TERMINATE, "stop": NoticeKind.STOP, "hibernate": NoticeKind.STOP}


def parse_aws_instance_action(body: bytes) -> Notice:
    """The body of a ``200`` to ``spot/instance-action``."""
    doc = _json_object(body, "spot/instance-action")
    action, when = doc.get("action"), doc.get("time")
    if not isinstance(action, str) or action not in _AWS_ACTIONS:
        raise MalformedNotice(f"spot/instance-action: unknown action {action!r}")
    if not isinstance(when, str):
        raise MalformedNotice(f"spot/instance-action: time is {when!r}, expected a string")
    deadline = parse_iso_time(when, "spot/instance-action time")
    extra = " (hibernation starts at once)" if action == "hibernate" else ""
    return Notice("aws", _AWS_ACTIONS[action], deadline, f"EC2 spot interruption: {action} at {when}{extra}",
                  key=f"aws:instance-action:{action}:{when}")


def parse_aws_rebalance(body: bytes) -> Notice:
    """The body of a ``200`` to ``events/recommendations/rebalance``."""
    doc = _json_object(body, "events/recommendations/rebalance")
    when = doc.get("noticeTime")
    if not isinstance(when, str):
        raise MalformedNotice(f"events/recommendations/rebalance: noticeTime is {when!r}, expected a string")
    parse_iso_time(when, "events/recommendations/rebalance noticeTime")
    return Notice("aws", NoticeKind.REBALANCE, None,
                  f"EC2 rebalance recommendation at {when}: elevated risk of interruption",
                  key=f"aws:rebalance:{when}")


def parse_gce_preempted(body: bytes, seen_unix: float, notice_s: float) -> Notice | None:
    """The body of ``instance/preempted``; ``seen_unix`` is when TRUE was first seen."""
    text = body.decode("ascii", "replace").strip().upper()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice("gce", NoticeKind.PREEMPT, seen_unix + notice_s,
                      f"GCE preempted the VM; it stops about {notice_s:g}s after the notice (estimated)",
                      key="gce:preempted")
    raise MalformedNotice(f"instance/preempted: expected TRUE or FALSE, got {body[:64]!r}")


_AZURE_KINDS = {"Preempt": NoticeKind.PREEMPT, "Terminate": NoticeKind.TERMINATE,
                "Reboot": NoticeKind.STOP, "Redeploy": NoticeKind.STOP}


def parse_azure_events(body: bytes, vm_name: str, now_unix: float) -> Notice | None:
    """The Scheduled Events document → the most urgent event naming ``vm_name`` (compared without
    case: Azure resource names are case-insensitive), or ``None``. A started event (no NotBefore)
    is due now."""
    doc = _json_object(body, "scheduledevents")
    events = doc.get("Events")
    if not isinstance(events, list):
        raise MalformedNotice(f"scheduledevents: Events is {type(events).__name__}, expected a list")
    me = vm_name.casefold()
    best: Notice | None = None
    for event in events:
        if not isinstance(event, dict):
            raise MalformedNotice(f"scheduledevents: an event is {type(event).__name__}, expected an object")
        kind = _AZURE_KINDS.get(str(event.get("EventType")))
        if kind is None or event.get("ResourceType", "VirtualMachine") != "VirtualMachine":
            continue
        resources = event.get("Resources")
        if not isinstance(resources, list):
            raise MalformedNotice(f"scheduledevents: Resources of {event.get('EventId')!r} is not a list")
        if me not in (str(r).casefold() for r in resources):
            continue
        event_id, not_before = event.get("EventId"), event.get("NotBefore", "")
        if not isinstance(event_id, str) or not event_id:
            raise MalformedNotice(f"scheduledevents: EventId is {event_id!r}")
        if not isinstance(not_before, str):
            raise MalformedNotice(f"scheduledevents: NotBefore of {event_id} is {not_before!r}")
        deadline = parse_http_date(not_before, f"NotBefore of {event_id}") if not_before.strip() else now_unix
        detail = (f"Azure {event['EventType']} {event_id} ({event.get('EventStatus', '?')}), not before "
                  f"{not_before or 'now'}")
        if event.get("Description"):
            detail += f": {event['Description']}"
        notice = Notice("azure", kind, deadline, detail, key=f"azure:{event_id}")
        if best is None or deadline < (math.inf if best.deadline_unix is None else best.deadline_unix):
            best = notice
    return best


def parse_trigger_file(data: bytes, written_unix: float, key: str, source: str = "file") -> Notice:
    """A trigger file's content. Empty or plain text: a ``terminate`` notice without deadline, the
    text being its detail. A JSON object may say ``{"kind": "preempt", "deadline": 1767261600 or
    "2026-01-01T10:00:00Z", "in_s": 90, "detail": "..."}``; ``in_s`` counts from the file's mtime."""
    text = data.decode("utf-8", "replace").strip()
    if not text.startswith("{"):
        return Notice(source, NoticeKind.TERMINATE, None, text[:500] or "trigger file present", key=key)
    doc = _json_object(data, "trigger file")
    raw_kind = doc.get("kind", NoticeKind.TERMINATE.value)
    try:
        kind = NoticeKind(raw_kind)
    except ValueError as exc:
        raise MalformedNotice(f"trigger file: unknown kind {raw_kind!r} "
                              f"(one of {', '.join(k.value for k in NoticeKind)})") from exc
    deadline: float | None = None
    raw_deadline, raw_in = doc.get("deadline"), doc.get("in_s")
    if isinstance(raw_deadline, (int, float)) and not isinstance(raw_deadline, bool):
        deadline = float(raw_deadline)
    elif isinstance(raw_deadline, str):
        deadline = parse_iso_time(raw_deadline, "trigger file deadline")
    elif raw_deadline is not None:
        raise MalformedNotice(f"trigger file: deadline is {raw_deadline!r}, expected unix seconds or ISO 8601")
    elif isinstance(raw_in, (int, float)) and not isinstance(raw_in, bool):
        deadline = written_unix + float(raw_in)
    elif raw_in is not None:
        raise MalformedNotice(f"trigger file: in_s is {raw_in!r}, expected seconds")
    detail = doc.get("detail", "trigger file present")
    return Notice(source, kind, deadline, str(detail)[:500], key=key)


# ---- sources ----------------------------------------------------------------------------------


@runtime_checkable
class NoticeSource(Protocol):
    """Anything that can say whether a notice is out. ``poll`` must return within a bounded time
    and raise only :class:`PreemptionError` (anything else is logged as a bug)."""

    name: str

    def poll(self, now_unix: float) -> Notice | None: ...


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    headers: Mapping[str, str]


def _request(method: str, url: str, headers: Mapping[str, str], timeout_s: float) -> _Response:
    """One HTTP request, never through a proxy. Any status comes back; no answer at all raises
    :class:`SourceUnreachable`."""
    req = urllib.request.Request(url, method=method, headers=dict(headers), data=b"" if method == "PUT" else None)
    try:
        with _NO_PROXY.open(req, timeout=timeout_s) as resp:
            return _Response(resp.status, resp.read(_MAX_BODY), {k.lower(): v for k, v in resp.headers.items()})
    except urllib.error.HTTPError as exc:
        try:
            body = exc.read(_MAX_BODY)
        except (OSError, http.client.HTTPException):
            body = b""
        finally:
            exc.close()
        return _Response(exc.code, body, {k.lower(): v for k, v in (exc.headers or {}).items()})
    except urllib.error.URLError as exc:
        raise SourceUnreachable(f"{method} {url}: {exc.reason}") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise SourceUnreachable(f"{method} {url}: {exc or type(exc).__name__}") from exc


class AwsImds:
    """EC2 spot interruption and rebalance notices through IMDSv2. The session token is renewed a
    little before its TTL runs out and whenever IMDS refuses it (401: expired, or the wall clock
    jumped), with one retry per request."""

    def __init__(self, endpoint: str = "http://169.254.169.254", timeout_s: float = 1.0,
                 token_ttl_s: int = AWS_MAX_TOKEN_TTL_S) -> None:
        self.name = "aws"
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_until = 0.0

    def _new_token(self, now_unix: float, timeout_s: float) -> str:
        resp = _request("PUT", f"{self.endpoint}/latest/api/token",
                        {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)}, timeout_s)
        token = resp.body.decode("ascii", "replace").strip()
        if resp.status != 200 or not token:
            raise SourceUnreachable(f"IMDSv2 token request: HTTP {resp.status}")
        self._token = token
        self._token_until = now_unix + self.token_ttl_s - min(60.0, self.token_ttl_s / 10)
        return token

    def _get(self, path: str, now_unix: float) -> _Response:
        resp = _Response(0, b"", {})
        for attempt in range(2):
            token = self._token if self._token and now_unix < self._token_until else None
            token = token or self._new_token(now_unix, self.timeout_s)
            resp = _request("GET", f"{self.endpoint}{path}", {"X-aws-ec2-metadata-token": token}, self.timeout_s)
            if resp.status != 401:
                return resp
            self._token = None
            if attempt == 0:
                log.info("IMDSv2 refused the session token (401): requesting a new one")
        return resp

    def poll(self, now_unix: float) -> Notice | None:
        resp = self._get("/latest/meta-data/spot/instance-action", now_unix)
        if resp.status == 200:
            return parse_aws_instance_action(resp.body)
        if resp.status != 404:
            raise SourceUnreachable(f"spot/instance-action: HTTP {resp.status}")
        resp = self._get("/latest/meta-data/events/recommendations/rebalance", now_unix)
        if resp.status == 200:
            return parse_aws_rebalance(resp.body)
        if resp.status != 404:
            raise SourceUnreachable(f"events/recommendations/rebalance: HTTP {resp.status}")
        return None

    def probe(self, timeout_s: float) -> bool:
        """On EC2: the token request succeeds (and the token is kept)."""
        try:
            self._new_token(time.time(), timeout_s)
        except SourceUnreachable:
            return False
        return True


class GceMetadata:
    """GCE's ``instance/preempted``. The deadline is estimated from the first TRUE seen, and stays
    the same on later polls."""

    def __init__(self, endpoint: str = "http://metadata.google.internal", timeout_s: float = 1.0,
                 notice_s: float = 30.0) -> None:
        self.name = "gce"
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.notice_s = notice_s
        self._seen_unix: float | None = None

    def _get(self, timeout_s: float) -> _Response:
        return _request("GET", f"{self.endpoint}/computeMetadata/v1/instance/preempted",
                        {"Metadata-Flavor": "Google"}, timeout_s)

    def poll(self, now_unix: float) -> Notice | None:
        resp = self._get(self.timeout_s)
        if resp.status != 200:
            raise SourceUnreachable(f"instance/preempted: HTTP {resp.status}")
        notice = parse_gce_preempted(resp.body, self._seen_unix or now_unix, self.notice_s)
        if notice is not None and self._seen_unix is None:
            self._seen_unix = now_unix
        return notice

    def probe(self, timeout_s: float) -> bool:
        """On GCE: a 200 carrying ``Metadata-Flavor: Google`` (AWS and Azure share the address)."""
        try:
            resp = self._get(timeout_s)
        except SourceUnreachable:
            return False
        return resp.status == 200 and resp.headers.get("metadata-flavor") == "Google"


class AzureScheduledEvents:
    """Azure Scheduled Events for this VM: ``vm_name`` or, when empty, the name the instance
    metadata gives (asked once, then kept)."""

    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, endpoint: str = "http://169.254.169.254", timeout_s: float = 1.0, vm_name: str = "",
                 api_version: str = "2020-07-01") -> None:
        self.name = "azure"
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.vm_name = vm_name
        self.api_version = api_version

    def _learn_name(self, timeout_s: float) -> str:
        resp = _request("GET", f"{self.endpoint}{self.NAME_PATH}", {"Metadata": "true"}, timeout_s)
        name = resp.body.decode("utf-8", "replace").strip()
        if resp.status != 200 or not name:
            raise SourceUnreachable(f"instance/compute/name: HTTP {resp.status}; set azure_vm_name")
        self.vm_name = name
        return name

    def poll(self, now_unix: float) -> Notice | None:
        vm = self.vm_name or self._learn_name(self.timeout_s)
        resp = _request("GET", f"{self.endpoint}/metadata/scheduledevents?api-version={self.api_version}",
                        {"Metadata": "true"}, self.timeout_s)
        if resp.status != 200:
            raise SourceUnreachable(f"scheduledevents: HTTP {resp.status}")
        return parse_azure_events(resp.body, vm, now_unix)

    def probe(self, timeout_s: float) -> bool:
        """On Azure: the instance metadata names this VM (the quick endpoint: the first Scheduled
        Events request may take minutes)."""
        try:
            self._learn_name(timeout_s)
        except SourceUnreachable:
            return False
        return True


class FileTrigger:
    """A notice while ``path`` exists (content: :func:`parse_trigger_file`). Rewriting the file makes
    a new notice; the same file is the same notice. A writer with content should write another file
    and rename it onto ``path``, or a poll may see it empty (``touch`` alone is a valid notice)."""

    def __init__(self, path: Path, max_bytes: int = 65536) -> None:
        self.name = "file"
        self.path = Path(path)
        self.max_bytes = max_bytes

    def poll(self, now_unix: float) -> Notice | None:
        try:
            st = self.path.stat()
            with self.path.open("rb") as f:
                data = f.read(self.max_bytes)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SourceUnreachable(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        return parse_trigger_file(data, st.st_mtime, key=f"file:{self.path}:{st.st_mtime_ns}:{st.st_size}")


class SignalTrigger:
    """A notice once ``signum`` arrived (the handler only records the time: nothing else is safe in
    a signal handler). ``deadline_s`` > 0 gives the notice a deadline that long after the signal, as
    with Slurm's ``--signal=USR1@120``. :meth:`clear` re-arms it for a new, distinct notice."""

    def __init__(self, signum: int = signal.SIGUSR1, kind: NoticeKind = NoticeKind.TERMINATE,
                 deadline_s: float = 0.0) -> None:
        self.name = "signal"
        self.signum = signal.Signals(signum)
        self.kind = kind
        self.deadline_s = deadline_s
        self._fired_unix: float | None = None
        self._generation = 0
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Must run in the main thread (Python's rule for signal handlers)."""
        if not self._installed:
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.fire()

    def fire(self, at_unix: float | None = None) -> None:
        """What the handler does; also a way to trigger it from code."""
        if self._fired_unix is None:
            self._fired_unix = time.time() if at_unix is None else at_unix

    def clear(self) -> None:
        self._fired_unix = None
        self._generation += 1

    def poll(self, now_unix: float) -> Notice | None:
        fired = self._fired_unix
        if fired is None:
            return None
        deadline = fired + self.deadline_s if self.deadline_s > 0 else None
        return Notice("signal", self.kind, deadline, f"received {self.signum.name}",
                      key=f"signal:{self.signum.name}:{self._generation}")


# ---- configuration ----------------------------------------------------------------------------


def signal_number(name: str) -> int:
    """``SIGUSR1``, ``USR1`` or ``10`` → the signal number; ValueError otherwise."""
    text = name.strip().upper()
    if text.isdigit():
        return int(signal.Signals(int(text)))
    try:
        return int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except KeyError:
        raise ValueError(f"unknown signal {name!r}") from None


@dataclass(frozen=True)
class PreemptionConfig:
    """The watcher's settings; field names are meant to be embedded in the agent's settings with a
    ``preempt_`` prefix."""

    sources: tuple[str, ...] = setting(
        ("auto",), "notice sources: auto (the clouds whose metadata server answers at start), aws, gce, azure, "
                   "file, signal")
    poll_interval_s: float = setting(5.0, "period of polling every source (AWS advises 5 s)", "s")
    request_timeout_s: float = setting(1.0, "timeout of one metadata request", "s")
    detect_timeout_s: float = setting(0.2, "how long auto-detection waits for each cloud's metadata server", "s")
    aws_endpoint: str = setting("http://169.254.169.254", "EC2 instance metadata service (IMDSv2) base URL")
    aws_token_ttl_s: int = setting(AWS_MAX_TOKEN_TTL_S, "lifetime asked for IMDSv2 session tokens (1..21600)", "s")
    gce_endpoint: str = setting("http://metadata.google.internal", "GCE metadata server base URL")
    gce_notice_s: float = setting(30.0, "time from GCE's preempted=TRUE to the hard stop (the estimated deadline)",
                                  "s")
    azure_endpoint: str = setting("http://169.254.169.254", "Azure instance metadata service base URL")
    azure_api_version: str = setting("2020-07-01", "Azure Scheduled Events api-version")
    azure_vm_name: str = setting("", "this VM's name in Azure events (empty: asked from the instance metadata)")
    file_path: Path | None = setting(None, "trigger file of the 'file' source: its appearance is a notice")
    signal_name: str = setting("SIGUSR1", "trigger signal of the 'signal' source, e.g. for Slurm --signal=USR1@120")
    signal_deadline_s: float = setting(0.0, "deadline of a signal notice after the signal (0: none)", "s")
    log_every_s: float = setting(60.0, "at most one log line per source and problem in this period", "s")
    stop_after_final: bool = setting(True, "stop watching after a notice that the node goes away")
    final_horizon_s: float = setting(900.0, "a notice whose deadline is further away than this is not final", "s")

    def __post_init__(self) -> None:
        require(bool(self.sources), "sources", "must name at least one source")
        unknown = [s for s in self.sources if s not in SOURCE_NAMES]
        require(not unknown, "sources", f"unknown {', '.join(map(repr, unknown))} (one of {', '.join(SOURCE_NAMES)})")
        require("file" not in self.sources or self.file_path is not None, "file_path",
                "the 'file' source needs a file_path")
        try:
            signal_number(self.signal_name)
        except ValueError as exc:
            require(False, "signal_name", str(exc))
        for name in ("poll_interval_s", "request_timeout_s", "detect_timeout_s", "log_every_s", "final_horizon_s"):
            value = getattr(self, name)
            require(value > 0, name, f"must be > 0 (got {value})")
        require(self.gce_notice_s >= 0, "gce_notice_s", f"must be >= 0 (got {self.gce_notice_s})")
        require(self.signal_deadline_s >= 0, "signal_deadline_s", f"must be >= 0 (got {self.signal_deadline_s})")
        require(1 <= self.aws_token_ttl_s <= AWS_MAX_TOKEN_TTL_S, "aws_token_ttl_s",
                f"must be in [1, {AWS_MAX_TOKEN_TTL_S}] (got {self.aws_token_ttl_s})")
        for name in ("aws_endpoint", "gce_endpoint", "azure_endpoint"):
            value = getattr(self, name)
            require(value.startswith(("http://", "https://")), name, f"must be an http(s):// URL, got {value!r}")

    @property
    def signum(self) -> int:
        return signal_number(self.signal_name)


def cloud_source(name: str, config: PreemptionConfig) -> AwsImds | GceMetadata | AzureScheduledEvents:
    c = config
    if name == "aws":
        return AwsImds(c.aws_endpoint, c.request_timeout_s, c.aws_token_ttl_s)
    if name == "gce":
        return GceMetadata(c.gce_endpoint, c.request_timeout_s, c.gce_notice_s)
    if name == "azure":
        return AzureScheduledEvents(c.azure_endpoint, c.request_timeout_s, c.azure_vm_name, c.azure_api_version)
    raise SettingsError("sources", f"{name!r} is not a cloud")


def detect_clouds(candidates: Sequence[AwsImds | GceMetadata | AzureScheduledEvents],
                  timeout_s: float) -> list[NoticeSource]:
    """The candidates whose metadata server answers within ``timeout_s``. Probed in parallel
    threads and abandoned at the deadline: even a name lookup that hangs (metadata.google.internal
    off GCE) cannot hold the agent's start."""
    answered: dict[str, bool] = {}

    def probe(source: AwsImds | GceMetadata | AzureScheduledEvents) -> None:
        answered[source.name] = source.probe(timeout_s)

    threads = [threading.Thread(target=probe, args=(s,), name=f"ftd-detect-{s.name}", daemon=True)
               for s in candidates]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 0.3  # thread start-up and the reply's parsing
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    found: list[NoticeSource] = [s for s in candidates if answered.get(s.name)]
    if candidates:
        log.info("preemption: %s", f"detected {', '.join(s.name for s in found)}" if found else
                 f"no cloud metadata server answered within {timeout_s:g}s")
    return found


def build_sources(config: PreemptionConfig, detect: bool = True) -> list[NoticeSource]:
    """The sources ``config`` names; ``auto`` adds the detected clouds (none when ``detect`` is
    False). A signal trigger is returned uninstalled: :meth:`PreemptionWatcher.start` installs it."""
    named = [c for c in CLOUDS if c in config.sources]
    sources: list[NoticeSource] = [cloud_source(c, config) for c in named]
    if "auto" in config.sources and detect:
        sources += detect_clouds([cloud_source(c, config) for c in CLOUDS if c not in named],
                                 config.detect_timeout_s)
    if "file" in config.sources and config.file_path is not None:
        sources.append(FileTrigger(config.file_path))
    if "signal" in config.sources:
        sources.append(SignalTrigger(config.signum, deadline_s=config.signal_deadline_s))
    return sources


# ---- the watcher ------------------------------------------------------------------------------


class LogThrottle:
    """At most one line per key and period; the next line says how many were swallowed."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._swallowed: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """``None``: stay quiet; otherwise the number of lines swallowed since the last one."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._swallowed[key] = self._swallowed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._swallowed.pop(key, 0)


class PreemptionWatcher:
    """Polls ``sources`` every ``poll_interval_s`` in one daemon thread and calls ``on_notice`` once
    per distinct notice (by :attr:`Notice.key`). After a notice that ends the node (see
    :meth:`Notice.ends_node`) it stops by itself when ``stop_after_final``. One poll lasts at most
    the sources' request timeouts, so :meth:`stop` is bounded too."""

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        on_notice: Callable[[Notice], None],
        *,
        poll_interval_s: float = 5.0,
        log_every_s: float = 60.0,
        stop_after_final: bool = True,
        final_horizon_s: float = 900.0,
        clock: Callable[[], float] = time.time,
        max_remembered: int = 256,
    ) -> None:
        self.sources = list(sources)
        self.on_notice = on_notice
        self.poll_interval_s = poll_interval_s
        self.stop_after_final = stop_after_final
        self.final_horizon_s = final_horizon_s
        self.clock = clock
        self.max_remembered = max_remembered
        self.throttle = LogThrottle(log_every_s)
        self.final: Notice | None = None
        self.polls = 0
        self._seen: OrderedDict[str, Notice] = OrderedDict()
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: PreemptionConfig, on_notice: Callable[[Notice], None],
                    detect: bool = True) -> PreemptionWatcher:
        return cls(build_sources(config, detect), on_notice, poll_interval_s=config.poll_interval_s,
                   log_every_s=config.log_every_s, stop_after_final=config.stop_after_final,
                   final_horizon_s=config.final_horizon_s)

    @property
    def notices(self) -> list[Notice]:
        """The notices delivered so far (the latest ``max_remembered``)."""
        return list(self._seen.values())

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _quiet(self, source: str, problem: str, level: int, message: str, *args: object) -> None:
        self._failing.add(source)
        swallowed = self.throttle.allow(f"{source}:{problem}")
        if swallowed is None:
            return
        if swallowed:
            message += " (%d similar lines suppressed)"
            args = (*args, swallowed)
        log.log(level, message, *args)

    def poll_once(self, now_unix: float | None = None) -> list[Notice]:
        """Polls every source once and delivers what is new; returns the new notices. The thread
        calls it; call it directly only when no thread runs (tests, a caller with its own loop)."""
        now = self.clock() if now_unix is None else now_unix
        self.polls += 1
        fresh: list[Notice] = []
        for source in self.sources:
            try:
                notice = source.poll(now)
            except SourceUnreachable as exc:
                self._quiet(source.name, "unreachable", logging.WARNING,
                            "preemption source %s unreachable, taken as no notice: %s", source.name, exc)
                continue
            except MalformedNotice as exc:
                self._quiet(source.name, "malformed", logging.ERROR,
                            "preemption source %s gave an answer that does not parse, ignored: %s", source.name, exc)
                continue
            except Exception:
                self._failing.add(source.name)
                if self.throttle.allow(f"{source.name}:bug") is not None:
                    log.exception("preemption source %s failed", source.name)
                continue
            if source.name in self._failing:
                self._failing.discard(source.name)
                if self.throttle.allow(f"{source.name}:recovered") is not None:
                    log.info("preemption source %s answers again", source.name)
            if notice is None or notice.key in self._seen:
                continue
            self._seen[notice.key] = notice
            while len(self._seen) > self.max_remembered:
                self._seen.popitem(last=False)
            fresh.append(notice)
            log.warning("preemption notice: %s", notice.describe(now))
            try:
                self.on_notice(notice)
            except Exception:
                log.exception("on_notice failed for %s", notice.key)
            if self.final is None and notice.ends_node(now, self.final_horizon_s):
                self.final = notice
        return fresh

    def start(self) -> None:
        """Installs the signal triggers (when called from the main thread) and starts polling."""
        if self._thread is not None:
            raise RuntimeError("the watcher was already started")
        if not self.sources:
            log.info("preemption watcher: no source to watch")
            return
        for source in self.sources:
            if isinstance(source, SignalTrigger):
                try:
                    source.install()
                except ValueError as exc:  # not the main thread
                    log.warning("signal trigger %s not installed: %s", source.signum.name, exc)
        self._thread = threading.Thread(target=self._run, name="ftd-preemption", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            if self.stop_after_final and self.final is not None:
                log.info("preemption watcher done: the node goes away (%s)", self.final.key)
                return
            self._stop.wait(self.poll_interval_s)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stops polling and restores signal handlers; True when the thread ended within the timeout."""
        self._stop.set()
        for source in self.sources:
            if isinstance(source, SignalTrigger):
                try:
                    source.uninstall()
                except ValueError as exc:
                    log.warning("signal trigger %s not uninstalled: %s", source.signum.name, exc)
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Waits for the thread to end by itself; True when it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

