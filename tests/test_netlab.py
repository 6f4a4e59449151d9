"""The network lab (netlab/lab.py): pure decisions first (no root needed), then real namespaces, where
every claim is shown with traffic: a TCP connect across namespaces succeeds or fails, datagrams arrive
or not, a measured round trip rises with the delay. Needs root and ip/tc/nft (``netns`` marker)."""

from __future__ import annotations

import ipaddress
import json
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftd.netlab import CommandError, Host, Lab, MissingPrivileges, NetlabError, leftovers, missing_privileges, purge
from ftd.netlab.plan import EVERYONE, Cut, host_address, parse_networks, pick_subnet, render_cut
from ftd.waiting import wait_for

# -- pure decisions -----------------------------------------------------------------------------------

ADDRS = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
4: eth0    inet 10.231.5.7/24 brd 10.231.5.255 scope global eth0\\       valid_lft forever preferred_lft forever
"""
ROUTES = """default via 192.0.2.1 dev eth0
10.231.6.0/23 via 192.0.2.1 dev eth0
local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1
broadcast 10.231.5.255 dev eth0 table local proto kernel scope link src 10.231.5.7
"""


def test_parse_networks_leaves_out_the_default_route() -> None:
    nets = parse_networks(ADDRS, ROUTES)
    assert ipaddress.IPv4Network("10.231.5.0/24") in nets
    assert ipaddress.IPv4Network("10.231.6.0/23") in nets
    assert ipaddress.IPv4Network("0.0.0.0/0") not in nets


def test_pick_subnet_skips_every_network_in_use() -> None:
    taken = parse_networks(ADDRS, ROUTES)
    assert pick_subnet(taken, start=5) == ipaddress.IPv4Network("10.231.8.0/24")  # 5, 6, 7 are taken
    assert pick_subnet(taken, start=255) == ipaddress.IPv4Network("10.231.255.0/24")
    with pytest.raises(NetlabError, match="overlaps"):
        pick_subnet([ipaddress.IPv4Network("10.0.0.0/8")], start=0)


def test_host_addresses_follow_creation_order_within_the_subnet() -> None:
    subnet = ipaddress.IPv4Network("10.231.9.0/24")
    assert [str(host_address(subnet, i)) for i in (0, 1, 253)] == ["10.231.9.1", "10.231.9.2", "10.231.9.254"]
    with pytest.raises(NetlabError):
        host_address(subnet, 254)  # the broadcast address


def test_render_cut_both_ways_from_everyone_keeps_arp() -> None:
    text = render_cut("ftd1234_cut", "ftd1234h0", Cut(frozenset({EVERYONE}), frozenset({EVERYONE})))
    assert text.startswith("table netdev ftd1234_cut {")
    assert 'type filter hook ingress device "ftd1234h0" priority 0; policy accept;' in text
    assert 'type filter hook egress device "ftd1234h0" priority 0; policy accept;' in text
    assert text.count("meta protocol != arp drop") == 2


def test_render_cut_from_given_peers_and_inbound_only() -> None:
    peers = Cut(frozenset({"10.231.9.3", "10.231.9.2"}), frozenset({"10.231.9.2"}))
    text = render_cut("t", "i", peers)
    assert "ip saddr { 10.231.9.2, 10.231.9.3 } drop" in text
    assert "ip daddr { 10.231.9.2 } drop" in text
    inbound = render_cut("t", "i", Cut(inbound=frozenset({EVERYONE})))
    assert inbound.count("drop") == 1
    assert inbound.index("drop") < inbound.index("hook egress")


def test_cuts_merge_and_heal_per_peer() -> None:
    cut = Cut(frozenset({"10.231.9.2"})).merge(Cut(outbound=frozenset({"10.231.9.3"})))
    assert cut.dumps() == {"inbound": ["10.231.9.2"], "outbound": ["10.231.9.3"]}
    assert Cut.loads(cut.dumps()) == cut
    assert cut.without("10.231.9.2").without("10.231.9.3").empty
    with pytest.raises(ValueError):
        Cut(frozenset({"10.231.9.2; flush ruleset"}))
    with pytest.raises(NetlabError):
        render_cut('t" ; flush ruleset', "i", cut)


def test_missing_privileges_names_capabilities_and_tools() -> None:
    assert missing_privileges("CapEff:\t0000000000201000\n", which=lambda t: "/x") == []
    missing = missing_privileges("CapEff:\t0000000000001000\n", which=lambda t: None if t == "nft" else "/x")
    assert missing == ["CAP_SYS_ADMIN", "nft"]
    assert "CAP_SYS_ADMIN, nft" in str(MissingPrivileges(missing))
    assert missing_privileges("CapEff:\t0\n", which=lambda t: None)[:2] == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]


# -- real namespaces ----------------------------------------------------------------------------------

MISSING = missing_privileges()
netns = [pytest.mark.netns, pytest.mark.skipif(bool(MISSING), reason=f"needs root and ip/tc/nft; missing: {MISSING}")]

# One stdlib-only script for every probe, run with `python -I` inside a host's namespace.
PROBE = r"""
import json, socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "echo-server":
    s = socket.create_server((addr, port), reuse_port=True)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        with c:
            while data := c.recv(4096):
                c.sendall(data)
elif mode == "tcp":
    timeout, rounds = float(sys.argv[4]), int(sys.argv[5])
    t = time.monotonic()
    try:
        c = socket.create_connection((addr, port), timeout=timeout)
    except OSError as exc:
        print(json.dumps({"error": repr(exc), "elapsed_s": time.monotonic() - t}))
        sys.exit(0)
    result = {"connect_s": time.monotonic() - t, "rtts": []}
    for _ in range(rounds):
        t = time.monotonic()
        c.sendall(b"ping")
        assert c.recv(4) == b"ping"
        result["rtts"].append(time.monotonic() - t)
    print(json.dumps(result))
elif mode == "udp-recv":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, port))
    s.settimeout(float(sys.argv[4]))
    print("ready", flush=True)
    try:
        print(s.recvfrom(100)[1][0])
    except TimeoutError:
        print("none")
elif mode == "udp-send":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(int(sys.argv[4])):
        s.sendto(b"hello", (addr, port))
        time.sleep(0.02)
"""
PORT = 7000


def _probe(host: Host, *args: object, timeout_s: float = 20.0) -> str:
    return host.run([sys.executable, "-I", "-c", PROBE, *map(str, args)], timeout_s=timeout_s).stdout.strip()


def _start(host: Host, *args: object) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, "-I", "-c", PROBE, *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert select.select([proc.stdout], [], [], 10.0)[0], f"{args[0]} in {host.name} did not start"
    assert proc.stdout.readline().strip() == "ready"
    return proc


def tcp(client: Host, server: Host, timeout_s: float = 0.5, rounds: int = 1) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(_probe(client, "tcp", server.address, PORT, timeout_s, rounds))
    return result


def reachable(client: Host, server: Host) -> bool:
    return "error" not in tcp(client, server)


def cut_off(client: Host, server: Host) -> bool:
    """A connect that fails, and within a bounded time (0.5 s connect timeout)."""
    result = tcp(client, server)
    return "error" in result and result["elapsed_s"] < 5.0


def udp_arrives(sender: Host, receiver: Host, wait_s: float) -> bool:
    """Whether a datagram from ``sender`` (one every 20 ms) reaches ``receiver`` within ``wait_s``."""
    recv = _start(receiver, "udp-recv", receiver.address, PORT + 1, wait_s)
    send = sender.popen([sys.executable, "-I", "-c", PROBE, "udp-send", receiver.address, str(PORT + 1),
                         str(int(wait_s / 0.02) + 1)])
    try:
        out, _ = recv.communicate(timeout=wait_s + 10)
    finally:
        send.kill()
        send.wait(timeout=5)
    return bool(out.strip() == sender.address)


def root_network_view() -> dict[str, str]:
    def show(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {"addr": show("ip", "-o", "addr"), "route": show("ip", "route", "show", "table", "all"),
            "link": show("ip", "-o", "link"), "nft": show("nft", "list", "ruleset"),
            "netns": show("ip", "netns", "list")}


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    lab = Lab(tmp_path / "lab").setup()
    prefix = lab.prefix
    try:
        for name in ("a", "b", "c"):
            _start(lab.add_host(name), "echo-server", "0.0.0.0", PORT)
        yield lab
    finally:
        lab.teardown()
    assert leftovers(prefix) == []


class TestLab:
    pytestmark = netns

    def test_hosts_reach_each_other_and_nothing_is_left_in_the_root_namespace(self, tmp_path: Path) -> None:
        before = root_network_view()
        lab = Lab(tmp_path / "lab").setup()
        prefix = lab.prefix
        try:
            a, b = lab.add_host("a"), lab.add_host("b")
            assert ipaddress.IPv4Address(a.address) in lab.subnet and a.address != b.address
            server = _start(b, "echo-server", b.address, PORT)
            assert reachable(a, b)
            assert "default" not in b.run(["ip", "route"]).stdout  # nothing routed beyond the bridge
            running = root_network_view()
            assert {k: running[k] for k in before if k != "netns"} == {k: before[k] for k in before if k != "netns"}
            assert leftovers(prefix)
        finally:
            lab.teardown()
        assert server.wait(timeout=5) is not None
        assert leftovers(prefix) == []
        assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert root_network_view() == before
        lab.teardown()  # idempotent

    def test_partition_both_ways_then_heal(self, lab: Lab) -> None:
        a, b, c = (lab.hosts[n] for n in "abc")
        assert reachable(a, b) and reachable(b, a)
        lab.partition(b)
        assert cut_off(a, b) and cut_off(b, a) and cut_off(c, b)
        assert reachable(a, c)
        lab.heal(b)
        wait_for(lambda: reachable(a, b) and reachable(b, c), 10.0, "b reachable after heal")

    def test_partition_from_some_peers_and_between_two(self, lab: Lab) -> None:
        a, b, c = (lab.hosts[n] for n in "abc")
        lab.partition(b, peers=[a])  # e.g. the leader cut off from etcd, still reachable by agents
        assert cut_off(a, b) and cut_off(b, a)
        assert reachable(c, b) and reachable(b, c)
        lab.heal_all()
        wait_for(lambda: reachable(a, b), 10.0, "a-b after heal_all")
        lab.partition_between(a, c)
        assert cut_off(a, c) and cut_off(c, a)
        assert reachable(a, b) and reachable(c, b)
        lab.heal(c)  # heals the cut a holds against c
        wait_for(lambda: reachable(a, c) and reachable(c, a), 10.0, "a-c after heal")

    def test_inbound_partition_sends_but_receives_nothing(self, lab: Lab) -> None:
        a, b = lab.hosts["a"], lab.hosts["b"]
        lab.partition_inbound(b)
        assert udp_arrives(b, a, wait_s=5.0)  # what b sends arrives ...
        assert not udp_arrives(a, b, wait_s=1.0)  # ... what is sent to b does not
        assert cut_off(a, b) and cut_off(b, a)  # TCP needs both ways: it fails both ways
        lab.heal(b)
        assert udp_arrives(a, b, wait_s=5.0)

    @pytest.mark.parametrize("backend", ["netem", "relay"])
    def test_delay_raises_the_measured_round_trip(self, lab: Lab, backend: str) -> None:
        a, b = lab.hosts["a"], lab.hosts["b"]
        base = tcp(a, b, rounds=10)["rtts"]
        try:
            assert lab.delay(b, 50, backend=backend) == backend
        except CommandError as exc:
            if "kind is unknown" in exc.stderr:
                pytest.skip(f"this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): {exc}")
            raise
        slow = tcp(a, b, timeout_s=5.0, rounds=10)
        lab.clear_delay(b)
        after = wait_for(lambda: tcp(a, b, rounds=10).get("rtts"), 10.0, "an echo after clearing the delay")
        print(f"\n{backend}: echo RTT median {sorted(base)[5] * 1e3:.2f} ms without, "
              f"{sorted(slow['rtts'])[5] * 1e3:.2f} ms (min {min(slow['rtts']) * 1e3:.2f}) with 50 ms, "
              f"{sorted(after)[5] * 1e3:.2f} ms after clear; connect {slow['connect_s'] * 1e3:.1f} ms")
        assert max(base) < 0.050
        assert min(slow["rtts"]) >= 0.050
        assert slow["connect_s"] >= 0.050
        assert sorted(after)[5] < 0.050

    def test_delay_and_partition_are_gone_after_teardown(self, lab: Lab) -> None:
        b = lab.hosts["b"]
        lab.partition(b)
        backend = lab.delay(b, 20)  # netem where the kernel has it, else the relay
        state = json.loads((lab.workdir / "netlab.json").read_text())
        assert {e["kind"] for e in state["created"]} == {"netns", "link", "table", "process"} | (
            {"qdisc"} if backend == "netem" else set())
        assert {e.get("role") for e in state["created"] if e["kind"] == "process"} >= (
            {"relay:b"} if backend == "relay" else set())
        # the fixture's teardown asserts that leftovers() is empty

    def test_down_from_a_fresh_object_after_the_creator_let_go(self, tmp_path: Path) -> None:
        """``ftctl up`` exits leaving the lab running; ``ftctl down`` (another object) removes it."""
        lab = Lab(tmp_path / "lab").setup()
        prefix = lab.prefix
        try:
            server = _start(lab.add_host("a"), "echo-server", "0.0.0.0", PORT)
            lab.add_host("b")
        finally:
            lab.close()
        attached = Lab(tmp_path / "lab").attach()
        assert reachable(attached.hosts["b"], attached.hosts["a"])
        attached.close()
        Lab(tmp_path / "lab").teardown()
        assert server.wait(timeout=5) is not None
        assert leftovers(prefix) == []
        assert not (tmp_path / "lab" / "netlab.json").exists()

    def test_purge_removes_a_lab_whose_workdir_is_lost(self, tmp_path: Path) -> None:
        lab = Lab(tmp_path / "lab").setup()
        prefix = lab.prefix
        try:
            sleeper = lab.add_host("a").popen(["sleep", "300"])
            lab.close()
            (tmp_path / "lab" / "netlab.json").unlink()
            purge(prefix)
            assert sleeper.wait(timeout=5) is not None
            assert leftovers(prefix) == []
        finally:
            Lab(tmp_path / "lab").teardown()
        with pytest.raises(NetlabError, match="not a lab prefix"):
            purge("ftd")

    def test_a_second_lab_on_the_same_workdir_is_refused(self, lab: Lab) -> None:
        with pytest.raises(NetlabError, match="another lab"):
            Lab(lab.workdir).setup()

    def test_a_subnet_overlapping_this_machine_is_refused(self, tmp_path: Path) -> None:
        before = root_network_view()
        with pytest.raises(NetlabError, match="overlaps"):
            Lab(tmp_path / "lab", subnet="127.0.0.0/24").setup()
        assert root_network_view() == before

    def test_a_crashed_run_is_cleaned_by_the_next_setup(self, tmp_path: Path) -> None:
        before = root_network_view()
        crashed = subprocess.Popen(
            [sys.executable, "-c", CRASHING, str(tmp_path / "lab")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        assert crashed.stdout is not None
        try:
            assert select.select([crashed.stdout], [], [], 30.0)[0], "the crashing lab did not start"
            record = json.loads(crashed.stdout.readline())
        finally:
            crashed.send_signal(signal.SIGKILL)
            crashed.wait(timeout=10)
        old = record["prefix"]
        assert any(item.startswith("netns") for item in leftovers(old))
        assert _alive(record["pid"])

        lab = Lab(tmp_path / "lab").setup()
        new = lab.prefix
        try:
            assert leftovers(old) == []
            assert not _alive(record["pid"])
            assert reachable_from_scratch(lab)
        finally:
            lab.teardown()
        assert leftovers(new) == []
        assert root_network_view() == before


# A lab left running by a process that is then SIGKILLed: hosts, a process in one, a cut and a relay.
CRASHING = """
import json, sys
from ftd.netlab import Lab
lab = Lab(sys.argv[1]).setup()
a, b = lab.add_host("a"), lab.add_host("b")
sleeper = b.popen(["sleep", "300"])
lab.partition(b)
lab.delay(a, 20, backend="relay")
print(json.dumps({"prefix": lab.prefix, "pid": sleeper.pid}), flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def reachable_from_scratch(lab: Lab) -> bool:
    a, b = lab.add_host("a"), lab.add_host("b")
    _start(b, "echo-server", b.address, PORT)
    return reachable(a, b)


def test_a_reused_pid_is_left_alone(tmp_path: Path) -> None:
    """A recorded pid that now belongs to another process (its start time differs) is not signalled."""
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        Lab(tmp_path / "lab").ledger.stop([{"pid": bystander.pid, "start": 1, "group": False}])
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=5)
