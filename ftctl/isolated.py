"""``ftctl up --isolate`` / ``ftctl demo --isolate``: a local cluster whose every process has a network
of its own, built on the network lab (:mod:`ftd.netlab`).

Each etcd member, coordinator replica and node is a lab host: its own Linux network namespace with one
address on a bridge the lab creates in a "switch" namespace, no route beyond that bridge. A further
host, ``ctl``, is the operator's side. The processes bind their host's address on fixed ports (etcd
2379/2380, coordinator 7400/9401, agent 7410/9402), and their certificates carry that address.

How the operator side reaches the cluster: the root namespace has no address on the lab (by design),
so ftctl re-executes itself inside the ``ctl`` namespace (``ip netns exec <ctl> python -m
ftd.ftctl.cli ARGV``) with :data:`ENV_INSIDE` set to that namespace; the re-executed ftctl sees the
marker and runs the command as usual. Chosen over ``setns`` in a helper thread because gRPC dials from
threads of its own, which would stay in the root namespace.

Who does what: the root-namespace ftctl creates the lab and its hosts (``ip netns add`` must run in the
root mount namespace; a crashed lab of the same workdir is removed first: :meth:`ftd.netlab.Lab.setup`),
then runs ``up`` (or ``demo``) inside ``ctl``, which starts every process through ``ip netns exec
<host>``. ``down`` stops the processes and removes the lab from its ledger (``DIR/net/netlab.json``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftd import netlab
from ftd.netlab.ledger import STATE_FILE, Ledger, tool

from .etcd_server import EtcdCluster, EtcdMember

ENV_INSIDE = "FTD_ISOLATED_NETNS"  # inside a cluster's ctl namespace: its name
LAB_DIR = "net"  # the lab's workdir under the cluster's workdir
CTL = "ctl"
COORDINATOR_PORT, COORDINATOR_METRICS_PORT = 7400, 9401
AGENT_PORT, AGENT_METRICS_PORT = 7410, 9402


def host_names(nodes: int, spares: int, coordinators: int = 1, etcd: int = 1, s3: bool = False) -> list[str]:
    """The lab hosts of a cluster: the operator's ``ctl`` first, then etcd, coordinators, nodes, and
    ``s3`` (moto's S3 server) when asked."""
    return [CTL, *(f"etcd-{i}" for i in range(etcd)), *(f"coordinator-{i}" for i in range(coordinators)),
            *(f"node-{i}" for i in range(nodes + spares)), *(["s3"] if s3 else [])]


def check() -> None:
    """Raises :class:`ftd.netlab.MissingPrivileges` naming what this process lacks."""
    netlab.check_privileges()


def prepare(workdir: Path, names: Sequence[str]) -> dict[str, Any]:
    """Creates the lab of ``workdir`` (removing a crashed one of the same workdir first) with one host
    per name; returns the isolation record (:func:`load`). The lab is left running, unlocked."""
    lab = netlab.Lab(workdir / LAB_DIR)
    lab.setup()
    try:
        for name in names:
            lab.add_host(name)
    except BaseException:
        lab.teardown()
        raise
    lab.close()
    return load(workdir)


def load(workdir: Path) -> dict[str, Any]:
    """The isolation record of ``workdir``'s lab, read from its ledger: ``{"lab_dir", "prefix",
    "subnet", "ctl", "hosts": {name: {"netns", "address", "iface"}}}``; ``{}`` when there is no lab."""
    state = Ledger(workdir / LAB_DIR).load()
    if not state:
        return {}
    hosts = {h["name"]: {"netns": h["netns"], "address": h["address"], "iface": h["iface"]} for h in state["hosts"]}
    return {"lab_dir": str(workdir / LAB_DIR), "prefix": state["prefix"], "subnet": state["subnet"],
            "ctl": hosts[CTL]["netns"] if CTL in hosts else "", "hosts": hosts}


def address(isolation: dict[str, Any], host: str) -> str:
    try:
        return str(isolation["hosts"][host]["address"])
    except KeyError:
        raise netlab.NetlabError(f"the lab in {isolation.get('lab_dir')} has no host {host!r}") from None


def wrap(isolation: dict[str, Any], host: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run in ``host``'s namespace (``ip netns exec`` execs: the pid is the command's own)."""
    address(isolation, host)
    return [tool("ip") or "ip", "netns", "exec", isolation["hosts"][host]["netns"], *argv]


def node_env(isolation: dict[str, Any], host: str) -> dict[str, str]:
    """What a node's training processes need in its namespace: gloo (and NCCL) take the address of the
    host's lab interface, not the one its host name resolves to (loopback here)."""
    address(isolation, host)
    iface = str(isolation["hosts"][host]["iface"])
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface}


def inside(isolation: dict[str, Any]) -> bool:
    """True in a process that already runs in the cluster's ctl namespace (the re-executed ftctl)."""
    return bool(isolation.get("ctl")) and os.environ.get(ENV_INSIDE) == isolation["ctl"]


def reexec(isolation: dict[str, Any], argv: Sequence[str]) -> int:
    """Runs ``ftctl ARGV`` inside the ctl namespace (stdin/stdout/stderr shared); returns its exit code."""
    if not isolation.get("ctl"):
        raise netlab.NetlabError(f"the lab in {isolation.get('lab_dir')} has no {CTL} host")
    env = {**os.environ, ENV_INSIDE: isolation["ctl"]}
    rc = subprocess.run(wrap(isolation, CTL, [sys.executable, "-m", "ftd.ftctl.cli", *argv]), env=env).returncode
    return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's 128 + N


def teardown(workdir: Path) -> str | None:
    """Stops whatever still runs in ``workdir``'s lab and removes every namespace, veth, bridge and rule
    it made; returns the lab's prefix (``None``: there was no lab). Raises when anything is left."""
    lab_dir = workdir / LAB_DIR
    if not (lab_dir / STATE_FILE).exists():
        return None
    lab = netlab.Lab(lab_dir).attach()
    prefix = lab.prefix
    lab.teardown()
    return prefix


class LabEtcd(EtcdCluster):
    """The embedded etcd with member i in lab host ``etcd-i`` (bound to its address: ``hosts``)."""

    isolation: dict[str, Any]

    def _spawn(self, m: EtcdMember, state: str) -> None:
        host = f"etcd-{self.members.index(m)}"
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(wrap(self.isolation, host, self._command(m, self._initial_cluster(), state)),
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=self.detach)
