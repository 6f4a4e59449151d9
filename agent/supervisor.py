"""Supervision of the node's local processes (the training workers), each in its own process group
so that one signal reaches a worker and everything it spawned."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger("ftd.agent.supervisor")


class Supervisor:
    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
              log_path: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else None, cwd=cwd,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if log_path:
                out.close()  # type: ignore[union-attr]
        with self._lock:
            self._procs[proc.pid] = proc
        log.info("started pid %d: %s", proc.pid, " ".join(argv))
        return proc

    def pids(self) -> list[int]:
        with self._lock:
            return [pid for pid, p in self._procs.items() if p.poll() is None]

    def signal_all(self, sig: int) -> list[int]:
        """Signals every live supervised process group; returns the pids signalled."""
        hit = []
        with self._lock:
            for pid, proc in self._procs.items():
                if proc.poll() is None:
                    try:
                        os.killpg(pid, sig)
                        hit.append(pid)
                    except ProcessLookupError:
                        pass
        return hit

    def kill_all(self) -> list[int]:
        return self.signal_all(signal.SIGKILL)

    def reap(self) -> None:
        with self._lock:
            for pid in [pid for pid, p in self._procs.items() if p.poll() is not None]:
                del self._procs[pid]
