"""Chaos as a library (after etcd's robustness ``Failpoint``): each fault has a name, ``inject`` and
``recover``; :func:`injected` checks the system's health before and after, so a scenario cannot pass
on a system that was already broken or that never came back.

Every fault targets a process this test started, by pid; every loop is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ftd.ftctl.etcd_server import EtcdCluster


class Fault(Protocol):
    name: str

    def inject(self) -> None: ...

    def recover(self) -> None: ...


@dataclass
class KillProcess:
    """SIGKILL a process (and its process group when it leads one). Not recoverable by itself."""

    pid: int
    name: str = "kill"

    def inject(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def recover(self) -> None:
        pass


@dataclass
class PauseProcess:
    """SIGSTOP / SIGCONT: a hung process whose sockets stay open."""

    pid: int
    name: str = "pause"

    def inject(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def recover(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


@dataclass
class EtcdMemberKill:
    cluster: EtcdCluster
    index: int
    name: str = "etcd-member-kill"

    def inject(self) -> None:
        self.cluster.kill(self.index)

    def recover(self) -> None:
        self.cluster.restart(self.index)


@dataclass
class EtcdOutage:
    """Every etcd member stopped (SIGSTOP would keep sockets open; this kills and restarts them on
    their data dirs, like a power cycle of the etcd hosts)."""

    cluster: EtcdCluster
    name: str = "etcd-outage"

    def inject(self) -> None:
        for i in range(len(self.cluster.members)):
            self.cluster.kill(i)

    def recover(self) -> None:
        for i in range(len(self.cluster.members)):
            if not self.cluster.members[i].running():
                self.cluster._spawn(self.cluster.members[i], "existing")
        if not self.cluster.wait_healthy(30.0):
            raise RuntimeError("etcd did not come back after the outage")


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Sends ``sig`` to each of ``pids`` (processes the test started); one already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Running and not a zombie (a killed child stays one until its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def still_running(pids: Iterable[int], timeout_s: float) -> list[int]:
    """The pids still running after waiting up to ``timeout_s`` for them all to go (empty: all gone)."""
    pids = list(pids)
    end = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < end:
        time.sleep(0.1)
    return left


_BURN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


@dataclass
class CpuStress:
    """``workers`` busy-looping processes for at most ``seconds`` (they stop by themselves)."""

    workers: int = 4
    seconds: float = 60.0
    name: str = "cpu-stress"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def inject(self) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", _BURN.format(s=self.seconds)])
                      for _ in range(self.workers)]

    def recover(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=10)


@contextlib.contextmanager
def injected(fault: Fault, healthy: Callable[[], None] | None = None) -> Iterator[Fault]:
    """Checks health, injects, yields, recovers (always), checks health again."""
    if healthy is not None:
        healthy()
    fault.inject()
    try:
        yield fault
    finally:
        fault.recover()
    if healthy is not None:
        healthy()
