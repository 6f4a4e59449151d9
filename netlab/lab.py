"""A network lab on one machine: every host (etcd member, coordinator replica, agent node) in its own
Linux network namespace with its own address, plus the network faults of the chaos matrix.

Design: the bridge lives in a dedicated "switch" namespace, and each host's veth pair is created
between the switch and the host's namespace directly, so nothing is ever created, addressed or routed
in the root namespace: the machine's interfaces, routes and firewall stay untouched. Hosts get one
address each on a private /24 that overlaps nothing on this machine, with only the connected route (no
default route, no NAT, no forwarding), so lab traffic cannot leave the bridge. A consequence: the root
namespace cannot reach lab addresses either; a client (``ftctl``, a test) runs in a lab host.

Crash safety (:mod:`ftd.netlab.ledger`): everything is recorded in ``WORKDIR/netlab.json`` before it is
created; ``teardown()`` and the next ``setup()`` on the same workdir remove what it lists. Names carry a
per-lab prefix ``ftd<4 hex>``, so :func:`leftovers` can prove that nothing is left behind.

Faults: partitions are nftables ``netdev`` tables on the host's own interface (ingress and egress hooks,
rendered by :mod:`ftd.netlab.plan`), so a sender sees a silent loss like a cut cable, not a local EPERM,
and healing is deleting the table. Delay is ``tc netem`` on the host's interface; on a kernel without
``sch_netem`` a userspace relay (:mod:`ftd.netlab.relay`) stands in the host's switch port.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import select
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftd.netlab.ledger import CommandError, Ledger, leftovers, purge, run, tool
from ftd.netlab.plan import EVERYONE, Cut, NetlabError, host_address, parse_networks, pick_subnet, render_cut

__all__ = ["EVERYONE", "CommandError", "Cut", "Host", "Lab", "MissingPrivileges", "NetlabError",
           "check_privileges", "host_address", "leftovers", "missing_privileges", "pick_subnet", "purge",
           "render_cut"]

_CAPS = {12: "CAP_NET_ADMIN", 21: "CAP_SYS_ADMIN"}
_TOOLS = ("ip", "tc", "nft")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")
_RELAY = Path(__file__).with_name("relay.py")


class MissingPrivileges(NetlabError):
    """The lab cannot run here; ``missing`` lists capabilities and tools (the CLI exits 2)."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__("network isolation needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN and the tools "
                         f"ip, tc, nft (apt-get install iproute2 nftables); missing: {', '.join(missing)}")


def missing_privileges(status: str | None = None, which: Callable[[str], str | None] = tool) -> list[str]:
    """What this process lacks to run a lab: capability names (from ``/proc/self/status``), then tool
    names; empty when it can."""
    status = Path("/proc/self/status").read_text() if status is None else status
    found = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)
    eff = int(found.group(1), 16) if found else 0
    return [name for bit, name in _CAPS.items() if not eff >> bit & 1] + [t for t in _TOOLS if which(t) is None]


def check_privileges() -> None:
    if missing := missing_privileges():
        raise MissingPrivileges(missing)


@dataclass(frozen=True)
class Host:
    """A lab host: namespace ``netns``, ``address`` on interface ``iface``, switch-side veth ``port``."""

    name: str
    index: int
    netns: str
    address: str
    iface: str
    port: str
    lab: Lab = field(repr=False, compare=False)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (it execs: the pid is the command's own)."""
        return [tool("ip") or "ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` in this host (env and cwd as given or inherited); recorded for teardown."""
        return self.lab._spawn(self, argv, kw)

    def run(self, argv: Sequence[str], timeout_s: float = 30.0, check: bool = True,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(self.wrap(argv), capture_output=True, text=True, timeout=timeout_s, **kw)
        if check and res.returncode != 0:
            raise CommandError(self.wrap(argv), res.returncode, res.stderr)
        return res


class Lab:
    """One lab per workdir (an exclusive lock guards it while this object is set up or attached)."""

    def __init__(self, workdir: Path | str, subnet: str | None = None, kill_grace_s: float = 3.0) -> None:
        self.workdir = Path(workdir)
        self.requested_subnet = subnet
        self.hosts: dict[str, Host] = {}
        self.ledger = Ledger(self.workdir, kill_grace_s)

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return str(self.ledger.state["prefix"])

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.ledger.state["subnet"])

    @property
    def switch(self) -> str:
        return f"{self.prefix}-switch"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def setup(self) -> Lab:
        """Removes a crashed run's leftovers in this workdir, then creates the switch and its bridge (on
        any failure, removes what it made)."""
        check_privileges()
        self.ledger.lock()
        try:
            self.ledger.destroy_all(self.ledger.load())
            self.ledger.delete()
            subnet, prefix = self._choose_subnet(), self._choose_prefix()
            self.ledger.state = {"prefix": prefix, "subnet": str(subnet), "created": [], "hosts": [], "cuts": {},
                                 "delays": {}}
            self.ledger.save()
            self._netns_add(self.switch)
            self.ledger.record({"kind": "link", "netns": self.switch, "name": self.bridge})
            run(["ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge"])
            run(["ip", "-n", self.switch, "link", "set", self.bridge, "up"])
        except BaseException:
            self.teardown()
            raise
        return self

    def _choose_subnet(self) -> ipaddress.IPv4Network:
        taken = parse_networks(run(["ip", "-o", "-4", "addr", "show"]),
                               run(["ip", "-4", "route", "show", "table", "all"]))
        if self.requested_subnet is None:
            return pick_subnet(taken, secrets.randbelow(256))
        subnet = ipaddress.IPv4Network(self.requested_subnet)
        if not subnet.is_private or any(subnet.overlaps(t) for t in taken):
            raise NetlabError(f"subnet {subnet} is not private or overlaps this machine's {taken}")
        return subnet

    @staticmethod
    def _choose_prefix() -> str:
        for _ in range(20):
            if not leftovers(prefix := f"ftd{secrets.token_hex(2)}"):
                return prefix
        raise NetlabError("no unused lab prefix found")

    def attach(self) -> Lab:
        """Takes over a running lab of this workdir (e.g. ``ftctl down`` after ``ftctl up`` exited)."""
        self.ledger.lock()
        if not (state := self.ledger.load()):
            self.close()
            raise NetlabError(f"no lab recorded in {self.workdir}")
        self.ledger.state = state
        self.hosts = {h["name"]: Host(lab=self, **h) for h in state["hosts"]}
        return self

    def teardown(self) -> None:
        """Kills the lab's processes and deletes everything it recorded; idempotent."""
        self.ledger.lock()
        try:
            self.ledger.destroy_all(self.ledger.state or self.ledger.load())
            self.ledger.delete()
            self.hosts = {}
        finally:
            self.close()

    def close(self) -> None:
        """Releases the workdir without tearing down (the lab keeps running for a later ``attach``)."""
        self.ledger.unlock()

    def __enter__(self) -> Lab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # -- hosts ------------------------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        """A namespace with ``lo`` up and one address on the lab subnet, wired into the bridge."""
        if not _NAME.fullmatch(name) or name == "switch" or name in self.hosts:
            raise NetlabError(f"bad or duplicate host name {name!r}")
        index = len(self.ledger.state["hosts"])
        host = Host(name, index, f"{self.prefix}-{name}", str(host_address(self.subnet, index)),
                    f"{self.prefix}h{index}", f"{self.prefix}p{index}", self)
        self._netns_add(host.netns)
        run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        self.ledger.record({"kind": "link", "netns": self.switch, "name": host.port})
        run(["ip", "-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", host.iface,
             "netns", host.netns])
        run(["ip", "-n", self.switch, "link", "set", host.port, "master", self.bridge, "up"])
        run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.iface])
        run(["ip", "-n", host.netns, "link", "set", host.iface, "up"])
        self.hosts[name] = host
        fields = ("name", "index", "netns", "address", "iface", "port")
        self.ledger.state["hosts"].append({k: getattr(host, k) for k in fields})
        self.ledger.save()
        return host

    def _spawn(self, host: Host | None, argv: Sequence[str], kw: dict[str, Any],
               role: str = "") -> subprocess.Popen[Any]:
        kw.setdefault("start_new_session", True)
        netns = host.netns if host else self.switch
        proc = subprocess.Popen([tool("ip") or "ip", "netns", "exec", netns, *argv], **kw)
        self.ledger.adopt(proc, netns, bool(kw["start_new_session"]), role)
        return proc

    # -- faults -----------------------------------------------------------------------------------

    def partition(self, host: Host, peers: Iterable[Host] | None = None) -> None:
        """Cuts ``host`` off both ways: from every lab peer, or only from ``peers``."""
        addrs = frozenset({EVERYONE}) if peers is None else frozenset(p.address for p in peers)
        self._add_cut(host, Cut(inbound=addrs, outbound=addrs))

    def partition_inbound(self, host: Host, peers: Iterable[Host] | None = None) -> None:
        """``host`` sends but receives nothing (ARP excepted, so it still knows where to send). TCP then
        fails both ways (no SYN-ACK or ACK gets in); UDP shows the asymmetry."""
        addrs = frozenset({EVERYONE}) if peers is None else frozenset(p.address for p in peers)
        self._add_cut(host, Cut(inbound=addrs))

    def block_udp(self, host: Host, peers: Iterable[Host]) -> None:
        """``host``'s UDP datagrams to ``peers`` are lost (its TCP flows on): a blocked beacon path."""
        self._add_cut(host, Cut(udp_outbound=frozenset(p.address for p in peers)))

    def partition_between(self, a: Host, b: Host) -> None:
        """``a`` and ``b`` cannot talk to each other; both still talk to everyone else."""
        self._add_cut(a, Cut(inbound=frozenset({b.address}), outbound=frozenset({b.address})))

    def heal(self, host: Host) -> None:
        """Removes every cut on ``host`` and every cut against it on other hosts."""
        cuts = self.ledger.state["cuts"]
        for other in list(self.hosts.values()):
            if other.name == host.name:
                cuts.pop(host.name, None)
            elif other.name in cuts:
                cuts[other.name] = Cut.loads(cuts[other.name]).without(host.address).dumps()
            else:
                continue
            self._apply_cut(other)

    def heal_all(self) -> None:
        for host in list(self.hosts.values()):
            self.ledger.state["cuts"].pop(host.name, None)
            self._apply_cut(host)

    def _add_cut(self, host: Host, cut: Cut) -> None:
        cuts = self.ledger.state["cuts"]
        cuts[host.name] = Cut.loads(cuts.get(host.name, {})).merge(cut).dumps()
        self._apply_cut(host)

    def _apply_cut(self, host: Host) -> None:
        cut = Cut.loads(self.ledger.state["cuts"].get(host.name, {}))
        table = f"{self.prefix}_cut"
        entry = {"kind": "table", "netns": host.netns, "name": table}
        if cut.empty:
            self.ledger.state["cuts"].pop(host.name, None)
            if entry in self.ledger.state["created"]:
                self.ledger.destroy(entry)
                self.ledger.forget(entry)
                if table in run(["ip", "netns", "exec", host.netns, "nft", "list", "tables"]):
                    raise NetlabError(f"nft table {table} still in {host.netns} after heal")
            self.ledger.save()
            return
        self.ledger.record(entry)
        script = render_cut(table, host.iface, cut)
        run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"],
            input=f"add table netdev {table}\ndelete table netdev {table}\n{script}")
        listed = run(["ip", "netns", "exec", host.netns, "nft", "list", "table", "netdev", table])
        if listed.count(" drop") != script.count(" drop"):
            raise NetlabError(f"nft table {table} in {host.netns} does not hold the cut:\n{listed}")

    def delay(self, host: Host, ms: float, jitter_ms: float = 0.0, backend: str = "auto") -> str:
        """Adds ``ms`` (± ``jitter_ms``) to every packet ``host`` sends, so to every round trip with it.
        ``backend``: "netem", "relay" (userspace, :mod:`ftd.netlab.relay`) or "auto" (netem where the
        kernel has it). Returns the backend used."""
        self.clear_delay(host)
        if backend in ("auto", "netem"):
            entry = {"kind": "qdisc", "netns": host.netns, "dev": host.iface}
            self.ledger.record(entry)
            spec = ["delay", f"{ms:g}ms"] + ([f"{jitter_ms:g}ms"] if jitter_ms else [])
            try:
                run(["tc", "-n", host.netns, "qdisc", "add", "dev", host.iface, "root", "netem", *spec])
            except CommandError as exc:
                self.ledger.forget(entry)
                if backend == "netem" or "kind is unknown" not in exc.stderr:
                    raise
            else:
                if "netem" not in run(["tc", "-n", host.netns, "qdisc", "show", "dev", host.iface]):
                    raise NetlabError(f"netem qdisc missing on {host.iface} in {host.netns}")
                self.ledger.state["delays"][host.name] = "netem"
                self.ledger.save()
                return "netem"
        elif backend != "relay":
            raise ValueError(f"unknown delay backend {backend!r}")
        self._start_relay(host, ms, jitter_ms)
        return "relay"

    def _relay_link(self, host: Host) -> dict[str, Any]:
        return {"kind": "link", "netns": self.switch, "name": f"{self.prefix}r{host.index}a"}

    def _start_relay(self, host: Host, ms: float, jitter_ms: float) -> None:
        near, far = f"{self.prefix}r{host.index}a", f"{self.prefix}r{host.index}b"
        self.ledger.record(self._relay_link(host))
        run(["ip", "-n", self.switch, "link", "add", near, "type", "veth", "peer", "name", far])
        run(["ip", "-n", self.switch, "link", "set", far, "master", self.bridge, "up"])
        run(["ip", "-n", self.switch, "link", "set", near, "up"])
        run(["ip", "-n", self.switch, "link", "set", host.port, "nomaster"])
        self.ledger.state["delays"][host.name] = "relay"
        log = (self.workdir / f"relay-{host.name}.log").open("ab")
        with log:
            proc = self._spawn(None, [sys.executable, "-I", str(_RELAY), host.port, near, f"{ms:g}", f"{jitter_ms:g}"],
                               {"stdout": subprocess.PIPE, "stderr": log, "stdin": subprocess.DEVNULL, "text": True},
                               role=f"relay:{host.name}")
        assert proc.stdout is not None
        with proc.stdout:
            ready = select.select([proc.stdout], [], [], 10.0)[0] and proc.stdout.readline().strip() == "ready"
        if not ready:
            raise NetlabError(f"delay relay for {host.name} did not start (see {log.name})")

    def clear_delay(self, host: Host) -> None:
        backend = self.ledger.state["delays"].pop(host.name, None)
        if backend == "netem":
            entry = {"kind": "qdisc", "netns": host.netns, "dev": host.iface}
            self.ledger.destroy(entry)
            self.ledger.forget(entry)
        elif backend == "relay":
            relays = [e for e in self.ledger.state["created"] if e.get("role") == f"relay:{host.name}"]
            self.ledger.stop(relays)
            for e in relays:
                self.ledger.forget(e)
            self.ledger.destroy(self._relay_link(host))
            self.ledger.forget(self._relay_link(host))
            run(["ip", "-n", self.switch, "link", "set", host.port, "master", self.bridge])
            if f"master {self.bridge}" not in run(["ip", "-n", self.switch, "-o", "link", "show", host.port]):
                raise NetlabError(f"{host.port} did not rejoin {self.bridge}")
        self.ledger.save()

    def _netns_add(self, name: str) -> None:
        self.ledger.record({"kind": "netns", "name": name})
        run(["ip", "netns", "add", name])
