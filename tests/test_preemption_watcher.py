"""Preemption notices from the node itself and the watcher: the file and signal triggers, the watcher
(once per notice, bounded, stops by itself, survives failing sources and callbacks) and its
configuration. The clouds' notices: test_preemption.py. Nothing sleeps: the clock is an argument, threads
are awaited with deadlines."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from cloud_metadata import AWS_DEADLINE, AWS_TIME, T0, FakeMetadata, Imds

from ftd.agent.preemption import PreemptionWatcher
from ftd.agent.preemption_notices import (
    MalformedNotice,
    Notice,
    NoticeKind,
    SourceUnreachable,
    parse_trigger_file,
)
from ftd.agent.preemption_sources import (
    AwsImds,
    FileTrigger,
    PreemptionConfig,
    SignalTrigger,
    signal_number,
)
from ftd.settings import SettingsError, load
from ftd.waiting import wait_for

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
