"""The emergency flush: on SIGTERM (and optional extra signals), or when a preemption-notice file
appears, the latest save is persisted before the process goes.

A signal handler flushes (waits for the in-flight save and its SSD copy), then hands the signal on:
to the handler installed before it, or to the default action (the process ends with that signal).
A preemption file is watched by a background thread that flushes once it appears; the process goes
on (whoever wrote the notice stops it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from .save_loop import SaveResult

log = logging.getLogger("ftd.training.checkpoint")
PREEMPTION_POLL_S = 1.0


class EmergencyFlush:
    """Installs the signal handlers (only in the main thread, and only with ``install``) and the
    preemption watcher; :meth:`close` puts the previous handlers back and stops the watcher."""

    def __init__(self, flush: Callable[[], SaveResult | None], signals: Sequence[int] = (signal.SIGTERM,),
                 preemption_file: str | Path | None = None, install: bool = True) -> None:
        self.flush = flush
        self._previous: dict[int, Any] = {}
        self._closed = threading.Event()
        if install and threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if preemption_file:
            threading.Thread(target=self._watch, args=(Path(preemption_file),), daemon=True,
                             name="ftd-ckpt-preemption").start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: flushing the latest snapshot before exiting", signum)
        try:
            result = self.flush()
            if result is not None:
                log.warning("emergency flush: step %d %s", result.step, "persisted" if result.ok else result.error)
        finally:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    def _watch(self, path: Path) -> None:
        while not path.exists():
            if self._closed.wait(PREEMPTION_POLL_S):
                return
        log.warning("preemption notice %s: flushing the latest snapshot", path)
        self.flush()

    def close(self) -> None:
        self._closed.set()
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, handler)


__all__ = ["EmergencyFlush"]
