"""Preemption notices as data: the :class:`Notice` record, the errors of this boundary, and pure
parsers from each source's raw answer to a notice (no I/O: :mod:`.preemption_sources` fetches the
bytes, :mod:`.preemption` watches).

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
* **Trigger files** (:func:`parse_trigger_file`): empty or plain text is a ``terminate`` notice; a
  JSON object may give the kind and a deadline.
"""

from __future__ import annotations

import email.utils
import enum
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

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


__all__ = [
    "MalformedNotice", "Notice", "NoticeKind", "PreemptionError", "SourceUnreachable", "parse_aws_instance_action",
    "parse_aws_rebalance", "parse_azure_events", "parse_gce_preempted", "parse_http_date", "parse_iso_time",
    "parse_trigger_file",
]
