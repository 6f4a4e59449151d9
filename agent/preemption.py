"""Preemption notices: the cloud (or a scheduler, or an operator) says this node goes away soon.

A node that knows it is about to disappear can checkpoint, drain and hand its rank over on its own
terms instead of being declared dead by silence. The agent only *hears* the notice here: each source
(:mod:`.preemption_sources`: the clouds' metadata servers, a trigger file, a signal) is a
:class:`~.preemption_sources.NoticeSource` whose ``poll(now)`` returns a
:class:`~.preemption_notices.Notice` or ``None`` (the pure parsers of :mod:`.preemption_notices`,
which also records each cloud's documented format), and one :class:`PreemptionWatcher` thread polls
them on a bounded cadence and calls ``on_notice`` once per distinct notice. What to do about it is
the agent daemon's business.

An unreachable metadata server is "no notice", logged at most once per ``log_every_s``; an answer
that does not parse is logged as an error and is not a notice either. Every request has a timeout,
every loop ends, and the watcher stops by itself once a notice says the node goes away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ftd.throttle import LogThrottle

from .preemption_notices import MalformedNotice, Notice, SourceUnreachable
from .preemption_sources import NoticeSource, PreemptionConfig, SignalTrigger, build_sources

log = logging.getLogger("ftd.agent.preemption")


# ---- the watcher ------------------------------------------------------------------------------


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
        self.throttle = LogThrottle(log, log_every_s)
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

    def _quiet(self, source: str, problem: str, now: float, level: int, message: str, *args: object) -> None:
        self._failing.add(source)
        self.throttle.log(level, f"{source}:{problem}", message, *args, now=now)

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
                self._quiet(source.name, "unreachable", now, logging.WARNING,
                            "preemption source %s unreachable, taken as no notice: %s", source.name, exc)
                continue
            except MalformedNotice as exc:
                self._quiet(source.name, "malformed", now, logging.ERROR,
                            "preemption source %s gave an answer that does not parse, ignored: %s", source.name, exc)
                continue
            except Exception:
                self._failing.add(source.name)
                self.throttle.log(logging.ERROR, f"{source.name}:bug", "preemption source %s failed", source.name,
                                  now=now, exc_info=True)
                continue
            if source.name in self._failing:
                self._failing.discard(source.name)
                self.throttle.log(logging.INFO, f"{source.name}:recovered", "preemption source %s answers again",
                                  source.name, now=now)
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
