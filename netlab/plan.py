"""The network lab's decisions as pure functions (no root needed to test them): which private subnet a
lab takes, which address a host gets, and the nftables ruleset that realises a partition."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Lab subnets are /24s of this private /16; nothing in it is routed anywhere.
POOL = ipaddress.IPv4Network("10.231.0.0/16")
# In a cut's address set: every packet on the host's lab link, whatever the peer.
EVERYONE = "*"
_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole",
                "nat", "anycast"}
_NFT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")


class NetlabError(RuntimeError):
    pass


def parse_networks(addr_text: str, route_text: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine already uses, from ``ip -o -4 addr show`` and
    ``ip -4 route show table all`` (the default route covers everything and is left out)."""
    nets = []
    for line in addr_text.splitlines():
        words = line.split()
        if "inet" in words:
            nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
    for line in route_text.splitlines():
        words = line.split()
        if words and words[0] in _ROUTE_TYPES:
            words = words[1:]
        if words and words[0] != "default":
            nets.append(ipaddress.IPv4Network(words[0], strict=False))
    return nets


def pick_subnet(taken: Sequence[ipaddress.IPv4Network], start: int,
                pool: ipaddress.IPv4Network = POOL) -> ipaddress.IPv4Network:
    """The first /24 of ``pool`` from index ``start`` on (wrapping) that overlaps nothing ``taken``."""
    candidates = list(pool.subnets(new_prefix=24))
    for i in range(len(candidates)):
        subnet = candidates[(start + i) % len(candidates)]
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetlabError(f"every /24 of {pool} overlaps a network of this machine")


def host_address(subnet: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Address:
    """Host ``index`` (0-based, in order of creation) gets the subnet's ``index + 1``-th address."""
    if not 0 <= index < subnet.num_addresses - 2:
        raise NetlabError(f"{subnet} has no address for host #{index}")
    return subnet.network_address + index + 1


@dataclass(frozen=True)
class Cut:
    """What one host's firewall drops on its lab link: packets from the ``inbound`` addresses and to the
    ``outbound`` ones; :data:`EVERYONE` in a set means every packet that way (ARP excepted)."""

    inbound: frozenset[str] = field(default_factory=frozenset)
    outbound: frozenset[str] = field(default_factory=frozenset)
    udp_outbound: frozenset[str] = field(default_factory=frozenset)  # UDP only (liveness beacons), TCP flows

    def __post_init__(self) -> None:
        for a in self.inbound | self.outbound | self.udp_outbound:
            if a != EVERYONE:
                ipaddress.IPv4Address(a)

    @property
    def empty(self) -> bool:
        return not self.inbound and not self.outbound and not self.udp_outbound

    def merge(self, other: Cut) -> Cut:
        return Cut(self.inbound | other.inbound, self.outbound | other.outbound, self.udp_outbound | other.udp_outbound)

    def without(self, address: str) -> Cut:
        return Cut(self.inbound - {address}, self.outbound - {address}, self.udp_outbound - {address})

    def dumps(self) -> dict[str, list[str]]:
        out = {"inbound": sorted(self.inbound), "outbound": sorted(self.outbound)}
        return {**out, "udp_outbound": sorted(self.udp_outbound)} if self.udp_outbound else out

    @classmethod
    def loads(cls, data: dict[str, Any]) -> Cut:
        return cls(frozenset(data.get("inbound", ())), frozenset(data.get("outbound", ())),
                   frozenset(data.get("udp_outbound", ())))


def _rules(addrs: Iterable[str], match: str, only: str = "") -> list[str]:
    addrs = set(addrs)
    if EVERYONE in addrs:
        # ARP passes: a host cut one way still learns its peers' MACs, so the other way keeps working.
        return [f"meta protocol != arp {only}drop"]
    return [f"ip {match} {{ {', '.join(sorted(addrs, key=ipaddress.IPv4Address))} }} {only}drop"] if addrs else []


def render_cut(table: str, iface: str, cut: Cut) -> str:
    """The nft script defining ``table`` (family netdev) that realises ``cut`` on ``iface``: ingress
    drops what comes in, egress what goes out, both before the IP stack, so a sender sees a silent loss
    (a cut cable) and not a local EPERM."""
    if not _NFT_NAME.fullmatch(table) or not _NFT_NAME.fullmatch(iface):
        raise NetlabError(f"bad nft table or interface name: {table!r}, {iface!r}")
    lines = [f"table netdev {table} {{"]
    for chain, hook, rules in (("inbound", "ingress", _rules(cut.inbound, "saddr")),
                               ("outbound", "egress", _rules(cut.outbound, "daddr")
                                + _rules(cut.udp_outbound, "daddr", "ip protocol udp "))):
        lines += [f"\tchain {chain} {{",
                  f'\t\ttype filter hook {hook} device "{iface}" priority 0; policy accept;',
                  *(f"\t\t{r}" for r in rules), "\t}"]
    return "\n".join([*lines, "}"]) + "\n"
