"""Liveness beacons: the wire format of the UDP datagrams an agent sends the leader instead of a gRPC
heartbeat (docs/architecture.md, "Failure detection").

A gRPC message costs the leader ~400-800 µs (with mTLS); a beacon ~10-20 µs. Its authenticity comes from
the heartbeat stream: the leader gives each stream a fresh random key over mTLS (``BeaconTarget``), so a
beacon whose MAC verifies under that key speaks for the same identity the stream's certificate proved.
``seq`` only grows per key, so a recorded beacon cannot be replayed.

Layout (big-endian): ``magic`` (1 byte, the version), ``key_id`` (u32), ``seq`` (u64), the node id's
length (1 byte) and the node id (utf-8), then the first 16 bytes of HMAC-SHA256(key, everything before).
Pure functions, importable without torch or gRPC: a simulated agent speaks it in a few lines.

**Echoes** go the other way: every few beacons the leader answers one with an echo datagram to the
address it came from, ``ECHO_MAGIC``, ``key_id`` (u32), ``seen`` (u64: the newest seq it accepted under
the key), then the first 16 bytes of HMAC-SHA256(key, everything before). An echo tells the agent that
the leader lives and holds its stream's key without a gRPC answer (a stream message each way costs the
leader ~100 µs or more; an echo a few µs): the stream then carries news only, both ways. ``seen`` only
grows, so a recorded echo cannot be replayed, and its own magic byte keeps an echo from passing for a
beacon or the other way round.
"""

from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass

MAGIC = 0xB1  # version 1 of the format
HEADER = struct.Struct("!BIQB")  # magic, key_id, seq, node id length
MAC_BYTES = 16  # truncated HMAC-SHA256: 128 bits, far beyond what a flood can guess
KEY_BYTES = 32
MAX_NODE_ID_BYTES = 128  # ftd.node_ids: at most 128 characters of [A-Za-z0-9._-]
MAX_DATAGRAM = HEADER.size + MAX_NODE_ID_BYTES + MAC_BYTES
MAX_SEQ = 2**64 - 1
MAX_KEY_ID = 2**32 - 1
ECHO_MAGIC = 0xB2  # version 1 of the echo
ECHO_HEADER = struct.Struct("!BIQ")  # magic, key_id, seen
ECHO_BYTES = ECHO_HEADER.size + MAC_BYTES


@dataclass(frozen=True, slots=True)
class Beacon:
    """A decoded, not yet verified beacon: ``signed`` is what the MAC covers."""

    key_id: int
    seq: int
    node_id: str
    signed: bytes
    mac: bytes


def new_key() -> bytes:
    """A fresh random key for one heartbeat stream."""
    return os.urandom(KEY_BYTES)


def _mac(key: bytes, signed: bytes) -> bytes:
    return hmac.digest(key, signed, "sha256")[:MAC_BYTES]


def encode(node_id: str, key_id: int, seq: int, key: bytes) -> bytes:
    """One beacon datagram. Raises ``ValueError`` on arguments no leader could accept (a bug of the
    sender, never of the network)."""
    name = node_id.encode()
    if not 0 < len(name) <= MAX_NODE_ID_BYTES:
        raise ValueError(f"node id of {len(name)} bytes (1..{MAX_NODE_ID_BYTES})")
    if not 0 <= key_id <= MAX_KEY_ID or not 0 < seq <= MAX_SEQ:
        raise ValueError(f"key_id {key_id} or seq {seq} out of range")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes, want {KEY_BYTES}")
    signed = HEADER.pack(MAGIC, key_id, seq, len(name)) + name
    return signed + _mac(key, signed)


def decode(datagram: bytes) -> Beacon | str:
    """The beacon in a datagram, or why it is none (a short reason; never raises): anything may
    arrive on the port."""
    if len(datagram) > MAX_DATAGRAM:
        return f"{len(datagram)} bytes, more than a beacon's {MAX_DATAGRAM}"
    if len(datagram) < HEADER.size + 1 + MAC_BYTES:
        return f"{len(datagram)} bytes, too short for a beacon"
    magic, key_id, seq, length = HEADER.unpack_from(datagram)
    if magic != MAGIC:
        return f"unknown magic/version byte 0x{magic:02x}"
    end = HEADER.size + length
    if length == 0 or end + MAC_BYTES != len(datagram):
        return f"node id length {length} does not match the datagram's {len(datagram)} bytes"
    try:
        node_id = datagram[HEADER.size:end].decode()
    except UnicodeDecodeError:
        return "node id is not utf-8"
    if seq == 0:
        return "seq 0 (seqs start at 1)"
    return Beacon(key_id, seq, node_id, bytes(datagram[:end]), bytes(datagram[end:]))


def verify(beacon: Beacon, key: bytes) -> bool:
    """Whether ``key`` made the beacon's MAC (in constant time)."""
    return hmac.compare_digest(_mac(key, beacon.signed), beacon.mac)


def encode_echo(key_id: int, seen: int, key: bytes) -> bytes:
    """The leader's echo: it accepted beacons up to ``seen`` under the key ``key_id`` names."""
    signed = ECHO_HEADER.pack(ECHO_MAGIC, key_id, seen)
    return signed + _mac(key, signed)


def decode_echo(datagram: bytes, key_id: int, key: bytes) -> int | str:
    """The ``seen`` of an echo for the key ``key_id`` names, verified under ``key``, or why it is not one
    (never raises: anything may arrive on the agent's socket)."""
    if len(datagram) != ECHO_BYTES:
        return f"{len(datagram)} bytes, an echo has {ECHO_BYTES}"
    magic, got_id, seen = ECHO_HEADER.unpack_from(datagram)
    seen = int(seen)
    if magic != ECHO_MAGIC:
        return f"unknown magic/version byte 0x{magic:02x}"
    if got_id != key_id:
        return f"key id {got_id}, not this stream's {key_id}"
    signed = datagram[:ECHO_HEADER.size]
    if not hmac.compare_digest(_mac(key, signed), datagram[ECHO_HEADER.size:]):
        return "bad MAC"
    return seen
