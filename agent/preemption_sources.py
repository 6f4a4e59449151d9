"""Where preemption notices come from: the clouds' metadata servers (AWS IMDSv2, GCE, Azure
Scheduled Events), a trigger file and a trigger signal, each a :class:`NoticeSource` whose
``poll(now)`` returns a :class:`~.preemption_notices.Notice` or ``None``; and the configuration that
picks them (``auto`` probes which cloud's metadata server answers).

Every request has a timeout and never goes through a proxy (the servers are link-local); a server
that does not answer raises :class:`~.preemption_notices.SourceUnreachable` ("no notice"), an answer
that does not parse :class:`~.preemption_notices.MalformedNotice`. The formats are in
:mod:`.preemption_notices`.

File and signal triggers serve every other environment: a file that appears (a batch scheduler's
prolog, a spot handler of another cloud, an operator), or a signal such as Slurm's
``--signal=USR1@120``.
"""

from __future__ import annotations

import http.client
import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ftd.settings import SettingsError, require, setting

from .preemption_notices import (
    Notice,
    NoticeKind,
    SourceUnreachable,
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_azure_events,
    parse_gce_preempted,
    parse_trigger_file,
)

log = logging.getLogger("ftd.agent.preemption")

CLOUDS = ("aws", "gce", "azure")
SOURCE_NAMES = ("auto", *CLOUDS, "file", "signal")
AWS_MAX_TOKEN_TTL_S = 21600
_MAX_BODY = 1 << 20  # a metadata answer is a few hundred bytes; anything this large is not one
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # link-local: never via a proxy


# ---- sources ----------------------------------------------------------------------------------


@runtime_checkable
class NoticeSource(Protocol):
    """Anything that can say whether a notice is out. ``poll`` must return within a bounded time
    and raise only :class:`~.preemption_notices.PreemptionError` (anything else is logged as a bug)."""

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
    """A notice while ``path`` exists (content: :func:`~.preemption_notices.parse_trigger_file`).
    Rewriting the file makes a new notice; the same file is the same notice. A writer with content
    should write another file and rename it onto ``path``, or a poll may see it empty (``touch``
    alone is a valid notice)."""

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
    False). A signal trigger is returned uninstalled: :meth:`.preemption.PreemptionWatcher.start` installs it."""
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


__all__ = [
    "AWS_MAX_TOKEN_TTL_S", "CLOUDS", "SOURCE_NAMES", "AwsImds", "AzureScheduledEvents", "FileTrigger", "GceMetadata",
    "NoticeSource", "PreemptionConfig", "SignalTrigger", "build_sources", "cloud_source", "detect_clouds",
    "signal_number",
]
