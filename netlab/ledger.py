"""What a network lab created, and how to remove it: the lab's ``netlab.json`` ledger and the commands
that act on it. Kept apart from :mod:`ftd.netlab` so that crash cleanup is one small piece to review.

Every object is recorded before it is created (a process right after, by pid and kernel start time, so
a reused pid is never signalled), with an atomic replace of the file. Removal goes processes first: the
recorded ones, then any other process still inside a lab namespace (it can only descend from ours), then
the namespaces, which take their veths, bridge, nft tables and qdiscs with them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ftd.netlab.plan import NetlabError

STATE_FILE = "netlab.json"
Entry = dict[str, Any]
_GONE = ("Cannot find device", "No such file", "does not exist", "Cannot delete qdisc with handle of zero")


class CommandError(NetlabError):
    """A lab command failed: names the command and its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv, self.returncode, self.stderr = list(argv), returncode, stderr.strip()
        super().__init__(f"`{' '.join(self.argv)}` failed (exit {returncode}): {self.stderr}")


def tool(name: str) -> str | None:
    """``name``'s path, also in the sbin folders a non-login PATH may lack."""
    found = shutil.which(name)
    return found or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None)


def run(argv: Sequence[str], input: str | None = None, timeout_s: float = 15.0, ok: Sequence[str] = ()) -> str:
    """Runs a lab command; a failure whose stderr contains one of ``ok`` counts as done (idempotence)."""
    try:
        res = subprocess.run([tool(argv[0]) or argv[0], *argv[1:]], input=input, capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, -1, f"timed out after {timeout_s:g}s") from exc
    if res.returncode != 0 and not any(s in res.stderr for s in ok):
        raise CommandError(argv, res.returncode, res.stderr)
    return res.stdout


def netns_list() -> list[str]:
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    return [int(p) for p in run(["ip", "netns", "pids", ns]).split()]


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (tells a reused pid apart); None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def leftovers(prefix: str) -> list[str]:
    """Every namespace, process inside one, root-namespace link and nft table whose name carries
    ``prefix``: empty once that lab is torn down."""
    namespaces = [n for n in netns_list() if n.startswith(prefix)]
    found = [f"netns {n}" for n in namespaces]
    found += [f"process {pid} in {ns}" for ns in namespaces for pid in netns_pids(ns)]
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        if (name := line.split(":")[1].strip().split("@")[0]).startswith(prefix):
            found.append(f"link {name}")
    if tool("nft"):
        found += [f"nft {line}" for line in run(["nft", "list", "tables"]).splitlines() if prefix in line]
    return found


class Ledger:
    """The record of one lab, guarded by an exclusive lock on the workdir while held."""

    def __init__(self, workdir: Path, kill_grace_s: float = 3.0) -> None:
        self.workdir = workdir
        self.kill_grace_s = kill_grace_s
        self.state: dict[str, Any] = {}
        self.children: dict[int, subprocess.Popen[Any]] = {}  # ours to reap
        self._lock_file: IO[str] | None = None

    def lock(self) -> None:
        if self._lock_file is not None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        f = (self.workdir / "netlab.lock").open("w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise NetlabError(f"another lab holds {self.workdir}") from None
        self._lock_file = f

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def load(self) -> dict[str, Any]:
        path = self.workdir / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def save(self) -> None:
        """Atomic replace: a crash leaves the old or the new record (namespaces die with the machine, so
        no fsync)."""
        tmp = self.workdir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.workdir / STATE_FILE)

    def delete(self) -> None:
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        self.state = {}

    def record(self, entry: Entry) -> None:
        if entry not in self.state["created"]:
            self.state["created"].append(entry)
            self.save()

    def forget(self, entry: Entry) -> None:
        with contextlib.suppress(ValueError):
            self.state["created"].remove(entry)
        self.save()

    def adopt(self, proc: subprocess.Popen[Any], netns: str, group: bool, role: str) -> None:
        self.children[proc.pid] = proc
        self.record({"kind": "process", "pid": proc.pid, "start": start_time(proc.pid), "netns": netns,
                     "group": group, "role": role})

    def stop(self, entries: list[Entry]) -> None:
        """SIGTERM, a bounded grace, then SIGKILL; only pids whose start time matches the record."""
        live = [e for e in entries if e["start"] is not None and start_time(e["pid"]) == e["start"]]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for e in live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if e["group"] and os.getpgid(e["pid"]) == e["pid"]:
                        os.killpg(e["pid"], sig)
                    else:
                        os.kill(e["pid"], sig)
            if not (live := self._wait_gone(live)):
                return
        raise NetlabError(f"processes survived SIGKILL: {[e['pid'] for e in live]}")

    def _wait_gone(self, entries: list[Entry]) -> list[Entry]:
        deadline = time.monotonic() + self.kill_grace_s
        while True:
            for e in entries:
                if (child := self.children.get(e["pid"])) is not None and child.poll() is not None:
                    del self.children[e["pid"]]
            entries = [e for e in entries if start_time(e["pid"]) == e["start"]]
            if not entries or time.monotonic() >= deadline:
                return entries
            time.sleep(0.02)

    @staticmethod
    def destroy(entry: Entry) -> None:
        """Removes one recorded object; one already gone counts as removed."""
        if entry["kind"] == "netns":
            run(["ip", "netns", "del", entry["name"]], ok=_GONE)
            return
        ns = str(entry["netns"])
        if ns not in netns_list():
            return  # it went with its namespace
        if entry["kind"] == "link":
            run(["ip", "-n", ns, "link", "del", entry["name"]], ok=_GONE)
        elif entry["kind"] == "table":
            run(["ip", "netns", "exec", ns, "nft", "delete", "table", "netdev", entry["name"]], ok=_GONE)
        elif entry["kind"] == "qdisc":
            run(["tc", "-n", ns, "qdisc", "del", "dev", entry["dev"], "root"], ok=_GONE)

    def destroy_all(self, state: dict[str, Any]) -> None:
        """Everything ``state`` records; raises listing whatever is still there afterwards."""
        if not state:
            return
        created = state["created"]
        namespaces = {e["name"] for e in created if e["kind"] == "netns"}
        self.stop([e for e in created if e["kind"] == "process"])
        for _ in range(3):  # a stray may fork while we sweep; a few bounded rounds
            strays = [{"pid": pid, "start": start_time(pid), "group": False}
                      for ns in namespaces & set(netns_list()) for pid in netns_pids(ns)]
            if not strays:
                break
            self.stop(strays)
        for entry in reversed(created):
            if entry["kind"] != "process" and entry.get("netns") not in namespaces:
                self.destroy(entry)
        if left := leftovers(state["prefix"]):
            raise NetlabError(f"lab {state['prefix']} left behind: {left}")


def purge(prefix: str) -> None:
    """Removes a lab whose workdir, and so its record, is lost: the namespaces of exactly this prefix and
    every process inside them."""
    if not re.fullmatch(r"ftd[0-9a-f]{4}", prefix):
        raise NetlabError(f"not a lab prefix: {prefix!r}")
    created = [{"kind": "netns", "name": n} for n in netns_list() if n.startswith(f"{prefix}-")]
    Ledger(Path("/nonexistent")).destroy_all({"prefix": prefix, "created": created})
