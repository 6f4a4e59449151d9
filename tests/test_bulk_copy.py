"""The fast peer copy path (agent.bulk_copy) byte for byte: records opened in place and landed by
a second thread, every file whole and under its name only once it matched; a byte altered on the
wire or a holder whose copy rotted never yields a file (the receiver checks every file). And the
spool: a pulled copy replaces the rank's earlier one, which is freed after the new one is in when
there is room, before it otherwise."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from doubles import flipping_proxy

from ftd.agent import bulk_copy
from ftd.agent.peer_copy import PeerFetcher, _remove_all
from ftd.checkpoints.layout import shard_prefix
from ftd.storage_backends.base import crc32c_hex

CHUNK = 4096


def holder_files(root: Path, contents: dict[str, bytes]) -> list[bulk_copy.OfferedFile]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for name, data in contents.items():
        (root / name).write_bytes(data)
        out.append(bulk_copy.OfferedFile(name, root / name, len(data), crc32c_hex(data)))
    return out


@pytest.fixture
def server() -> Iterator[bulk_copy.BulkServer]:
    srv = bulk_copy.BulkServer("127.0.0.1", chunk_bytes=CHUNK)
    try:
        yield srv
    finally:
        srv.close()


CONTENTS = {
    "a.bin": os.urandom(37 * CHUNK + 123),  # many records and a short last one
    "b.bin": os.urandom(3 * CHUNK),  # whole records only
    "empty": b"",  # one empty record
    "manifest.json": b'{"manifest": true}',
}


def test_every_file_arrives_whole_in_order_and_checked(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    files = holder_files(tmp_path / "holder", CONTENTS)
    port, offer = server.offer(files)
    listing = [(f.name, f.size, f.crc32c) for f in files]
    expected = {f.name: (f.size, f.crc32c) for f in files}
    got = bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "in", expected,
                            chunk=CHUNK)
    assert got == sum(len(v) for v in CONTENTS.values())
    assert {p.name: p.read_bytes() for p in (tmp_path / "in").iterdir()} == CONTENTS  # no .part left


def test_a_catalog_checksum_other_than_the_holders_is_checked_here(server: bulk_copy.BulkServer,
                                                                   tmp_path: Path) -> None:
    """The receiver checks what arrived against the catalog's sum when there is one (not the
    holder's): the right sum passes, a wrong one leaves no file."""
    files = holder_files(tmp_path / "holder", CONTENTS)
    listing = [(f.name, f.size, "") for f in files]  # a holder without a manifest sum
    port, offer = server.offer(files)
    bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "ok",
                      {"a.bin": (len(CONTENTS["a.bin"]), crc32c_hex(CONTENTS["a.bin"]))}, chunk=CHUNK)
    assert (tmp_path / "ok" / "a.bin").read_bytes() == CONTENTS["a.bin"]
    port, offer = server.offer(files)
    with pytest.raises(bulk_copy.BulkError, match="expected 12345678"):
        bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, listing, tmp_path / "bad",
                          {"a.bin": (len(CONTENTS["a.bin"]), "12345678")}, chunk=CHUNK)
    assert not (tmp_path / "bad" / "a.bin").exists() and not list((tmp_path / "bad").glob(".*.part"))


def test_a_byte_altered_on_the_wire_yields_no_file(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    files = holder_files(tmp_path / "holder", CONTENTS)
    port, offer = server.offer(files)
    listener, worker = flipping_proxy(port, flip_at=20 * (CHUNK + bulk_copy.TAG) + 7)  # inside a.bin's 21st record
    with listener:
        with pytest.raises(bulk_copy.BulkError, match=r"a\.bin: record 20 does not open"):
            bulk_copy.receive("127.0.0.1", listener.getsockname()[1], offer.transfer, offer.key,
                              [(f.name, f.size, f.crc32c) for f in files], tmp_path / "in", chunk=CHUNK, timeout_s=10)
        worker.join(10)
    assert not worker.is_alive()
    assert list((tmp_path / "in").iterdir()) == []  # neither a.bin nor its .part


def test_a_copy_rotten_at_the_holder_yields_no_file(server: bulk_copy.BulkServer, tmp_path: Path) -> None:
    """The holder does not hash what it sends; the receiver checks against the holder's manifest sum
    (no catalog here) and keeps only what matched before."""
    files = holder_files(tmp_path / "holder", CONTENTS)
    old = CONTENTS["b.bin"]
    (tmp_path / "holder" / "b.bin").write_bytes(bytes([old[0] ^ 0xFF]) + old[1:])  # the manifest sum is the old one
    port, offer = server.offer(files)
    with pytest.raises(bulk_copy.BulkError, match=r"b\.bin: crc32c [0-9a-f]{8} received, expected"):
        bulk_copy.receive("127.0.0.1", port, offer.transfer, offer.key, [(f.name, f.size, f.crc32c) for f in files],
                          tmp_path / "in", chunk=CHUNK, timeout_s=10)
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["a.bin"]  # only what matched before


def _fetcher(spool: Path) -> PeerFetcher:
    def no_channel(address: str) -> object:
        raise AssertionError("no channel in this test")

    return PeerFetcher(lambda node: "", no_channel, spool)  # type: ignore[arg-type]


def _old_copy(spool: Path, step: int) -> Path:
    old = spool / shard_prefix("job", step, 0)  # the spool is laid out as any tier
    old.mkdir(parents=True)
    (old / "state.pt").write_bytes(b"x" * 1000)
    return old


def test_an_earlier_copy_is_moved_aside_and_freed_after(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    old, other_rank = _old_copy(spool, 3), spool / shard_prefix("job", 3, 1)
    other_rank.mkdir()
    stale = _fetcher(spool)._forget("job", 0, incoming=1000)
    assert not old.exists() and other_rank.exists()
    assert len(stale) == 1 and (stale[0] / "state.pt").read_bytes() == b"x" * 1000  # still held: freed later
    _remove_all(stale)
    assert not any((spool / ".stale").glob("*"))


def test_without_room_an_earlier_copy_goes_first(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    old = _old_copy(spool, 3)
    assert _fetcher(spool)._forget("job", 0, incoming=1 << 62) == [] and not old.exists()
    old = _old_copy(spool, 4)
    assert _fetcher(spool)._forget("job", 0, incoming=None) == [] and not old.exists()  # size unknown


def test_what_a_crash_left_being_freed_goes_at_start(tmp_path: Path) -> None:
    leftover = tmp_path / "spool" / ".stale" / "rank-00000-abcd"
    leftover.mkdir(parents=True)
    _fetcher(tmp_path / "spool")
    assert not leftover.exists()
