"""The etcd client plumbing (ftd.etcd_client): endpoint parsing and the one pyetcd private attribute
ftd relies on, so a pyetcd release that renames it fails here instead of silently disabling failover."""

from __future__ import annotations

import pytest

from ftd.etcd_client import current_member, make_client, next_member, parse_endpoints


def test_parse_endpoints_accepts_lists_prefixes_and_ipv6() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://127.0.0.2:2380") == [("127.0.0.1", 2379), ("127.0.0.2", 2380)]
    assert parse_endpoints("[::1]:2379") == [("::1", 2379)]


@pytest.mark.parametrize("bad", ["", " , ", "127.0.0.1", "host:port", "host:99999"])
def test_parse_endpoints_rejects_naming_the_endpoint(bad: str) -> None:
    with pytest.raises(ValueError, match="etcd endpoint"):
        parse_endpoints(bad)


def test_next_member_rotates_through_pyetcd_private_label() -> None:
    # No server is needed: the client connects lazily. If pyetcd renames `_current_endpoint_label`,
    # current_member raises AttributeError here.
    client = make_client("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", timeout_s=0.5)
    labels = list(client.endpoints)
    assert len(labels) == 3
    seen = [current_member(client)]
    for _ in range(3):
        next_member(client)
        seen.append(current_member(client))
    assert set(seen) == set(labels)
    assert seen[0] == seen[3] and len(set(seen[:3])) == 3


def test_next_member_is_a_no_op_with_one_member() -> None:
    client = make_client("127.0.0.1:1", timeout_s=0.5)
    before = current_member(client)
    next_member(client)
    assert current_member(client) == before
