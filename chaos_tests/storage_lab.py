"""What the storage scenarios (:mod:`chaos_tests.scenarios_storage`) do to an isolated cluster's
etcd members, its agents' metrics and a node's SSD tier, from the lab's ``ctl`` namespace.

etcd members: the raft leader found through each member's Maintenance/Status (TLS with the member's
own certificate), a member SIGKILLed by pid and started again with the command line it ran, in its
lab host (``ip netns exec``), on its data dir with ``--initial-cluster-state existing``. Metrics:
an agent's ``/metrics`` read over HTTP at the address of its ready file. Disks: a tmpfs filled up to
its last byte (a ballast file) and given room again by a remount. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ftd.ftctl import isolated
from ftd.ftctl.etcd_server import EtcdMember
from ftd.identity import IdentityFiles
from ftd.rpc import client_credentials
from ftd.waiting import wait_for

from .faults import alive
from .scenario import Context


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


# -- etcd members -------------------------------------------------------------------------------


@dataclass
class EtcdStatus:
    member_id: int
    leader_id: int
    raft_index: int
    raft_term: int


class LabEtcdMembers:
    """The etcd members of ``ctx``'s cluster (member i ``etcd{i}`` in lab host ``etcd-i``), as the
    cluster file recorded them."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.pki_dir = Path(ctx.cluster.pki_dir)
        self.argv: dict[int, list[str]] = {}  # the command line of each member, read before a kill
        self.procs: list[subprocess.Popen[bytes]] = []  # the members this object restarted

    def __len__(self) -> int:
        return len(self.ctx.cluster.etcd)

    def member(self, i: int) -> EtcdMember:
        proc = self.ctx.cluster.etcd[i]
        url = urllib.parse.urlsplit(str(proc.info["client_url"]))
        data_dir = Path(str(proc.info["data_dir"]))
        return EtcdMember(proc.name, int(url.port or 2379), 2380, data_dir, data_dir.with_suffix(".log"),
                          pki_dir=self.pki_dir, host=str(url.hostname))

    def pid(self, i: int) -> int:
        return int(self.ctx.cluster.etcd[i].pid)

    def status(self, i: int, timeout_s: float = 1.0) -> EtcdStatus | None:
        """Member i's view of raft (Maintenance/Status), or None when it does not answer."""
        from pyetcd.etcdrpc import rpc_pb2, rpc_pb2_grpc

        m = self.member(i)
        files = IdentityFiles(self.pki_dir, "etcd", m.name)
        try:
            with grpc.secure_channel(f"{m.host}:{m.client_port}", client_credentials(files)) as ch:
                resp = rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return None
        return EtcdStatus(int(resp.header.member_id), int(resp.leader), int(resp.raftIndex), int(resp.raftTerm))

    def leader(self, among: list[int] | None = None, timeout_s: float = 10.0) -> int:
        """The index of the raft leader, as a member of ``among`` (default: all) sees it."""
        among = list(range(len(self))) if among is None else among

        def find() -> list[int]:  # [index] once a leader is known (a list: index 0 is falsy)
            ids: dict[int, int] = {}
            leader_id = 0
            for i in among:
                st = self.status(i)
                if st is not None:
                    ids[st.member_id] = i
                    leader_id = leader_id or st.leader_id
            return [ids[leader_id]] if leader_id in ids else []

        return wait_for(find, timeout_s, "an etcd raft leader", interval_s=0.2)[0]

    def healthy(self, i: int) -> bool:
        return bool(self.member(i).healthy())

    def kill(self, i: int, timeout_s: float = 10.0) -> int:
        """SIGKILLs member i (its command line remembered for :meth:`restart`); returns its pid."""
        pid = self.pid(i)
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        argv = [a.decode() for a in raw.split(b"\0") if a]
        if not argv or "--data-dir" not in argv:
            raise RuntimeError(f"pid {pid} is not etcd member {i}: {argv[:3]}")
        self.argv[i] = argv
        os.kill(pid, signal.SIGKILL)
        def gone() -> bool:
            _reap(pid)
            return not alive(pid)

        wait_for(gone, timeout_s, f"etcd member {i} (pid {pid}) gone",
                 interval_s=0.05)
        return pid

    def restart(self, i: int) -> int:
        """Starts member i again with the command line it had, on its data dir, as a member of the
        existing cluster, in its lab host; the cluster file records the new pid (``ftctl down``)."""
        argv = list(self.argv[i])
        at = argv.index("--initial-cluster-state")
        argv[at + 1] = "existing"
        m = self.member(i)
        with open(m.log_path, "ab") as log:
            proc = subprocess.Popen(isolated.wrap(self.ctx.cluster.isolation, f"etcd-{i}", argv), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        self.ctx.cluster.etcd[i].pid = proc.pid
        self.ctx.cluster.save()
        return proc.pid

    def wait_healthy(self, members: list[int], timeout_s: float) -> None:
        wait_for(lambda: all(self.healthy(i) for i in members), timeout_s,
                 f"etcd member(s) {members} healthy", interval_s=0.2)


# -- agents' metrics ----------------------------------------------------------------------------


def metric(ctx: Context, node: str, name: str, labels: Mapping[str, str] | None = None,
           timeout_s: float = 2.0) -> float:
    """The sum of ``node``'s agent's samples ``name`` whose labels include ``labels`` (0 if none)."""
    address = ctx.agent(node).info["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    want = dict(labels or {})
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                total += float(sample.value)
    return total


def log_lines(ctx: Context, node: str, needle: str) -> list[str]:
    """The lines of ``node``'s agent log that contain ``needle``."""
    path = Path(ctx.cluster.workdir) / "logs" / f"{node}.log"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if needle in line]


# -- a node's disk ------------------------------------------------------------------------------


def mount_tmpfs(directory: Path, size: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(directory)], check=True,
                   capture_output=True, timeout=30)


def remount(directory: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(directory)], check=True, capture_output=True,
                   timeout=30)


def fill(directory: Path, name: str = "ballast") -> int:
    """Writes ``directory/name`` until the filesystem has no byte left (ENOSPC), in smaller and
    smaller chunks; returns the bytes the ballast holds. Bounded: at most 100,000 writes."""
    chunk = 64 << 10
    fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    written = 0
    try:
        for _ in range(100_000):
            try:
                n = os.write(fd, b"\0" * chunk)
                written += n
                if n < chunk:
                    chunk = max(1, chunk // 2)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if chunk == 1:
                    break
                chunk = max(1, chunk // 4)
    finally:
        os.close(fd)
    return written


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
