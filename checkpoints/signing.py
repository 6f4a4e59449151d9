"""Signed shards: who wrote a checkpoint's bytes, checked before a byte of them is unpickled.

The CRC32Cs of the manifest and the catalog catch accidents, not an adversary: whoever can write a
shard's files can write matching sums, and the catalog is only as honest as the coordinator and etcd.
So every shard carries :data:`SIGNATURE` (``SHARD.sig``), one of its own files (listed in its
manifest and its catalog record like ``state.pt``: every tiering hop, buddy replica, peer copy, HDD
and S3 upload moves it with the rest, unchanged). It holds

* a :class:`Statement`: the scheme (:data:`SCHEME`), job, step, epoch, rank, world size, format, the
  signing time, and every other file of the shard with its size and the BLAKE3 digest of each of its
  :data:`CHUNK` pieces, as canonical JSON (sorted keys, no spaces, ASCII). BLAKE3 (256-bit, the
  ``blake3`` package) because every snapshot is hashed twice, at its save beside the training and at
  its restore: 4.5 GB/s a core here against SHA-256's 1.7 with SHA-NI (0.06 against 0.15 CPU-s per
  256 MiB). Pieces, not one digest per file, so that a restore hashes them on several threads
  straight from the mapped file (the GIL released). Statements of the first scheme
  (:data:`SCHEME_V1`, SHA-256 pieces) are still verified: shards signed before stay restorable;
* the writing node's signature over those exact bytes, made with its mTLS key (the CA in ``ftd.ca``
  issues P-256 keys: ECDSA with SHA-256; an Ed25519 key would sign as Ed25519) by its agent
  (``Agent.SignShard``, Unix socket only: the key never leaves the agent);
* that node's certificate (PEM).

:func:`check_signed` (pure: tested with forged inputs) accepts a shard only when the certificate was
issued by the cluster's CA and valid when it signed, names exactly one ``spiffe://ftd/<cluster>/node/
<name>`` URI whose name is the catalog's ``writer`` of that shard (the node whose commit created the
record, which the coordinator allows only for the rank's holder at the job's epoch), the signature
verifies, the statement is about this job, step and rank, and its files are exactly the catalog's
(sizes equal). :func:`verify_shard` then hashes the files it is about to load and compares them with
the statement. Anything wrong is :class:`BadSignature`: the restore treats it as a corrupt copy.

A statement starts with ``{"scheme":"ftd-shard-sig-v`` (v2, or v1): the agent signs nothing else with
its TLS key, and no TLS handshake signs a message beginning so (TLS 1.3 prefixes 64 spaces and a
context).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import json
import mmap
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from .layout import MANIFEST, check_file_name

SIGNATURE = "SHARD.sig"
SCHEME = "ftd-shard-sig-v2"  # BLAKE3 pieces
SCHEME_V1 = "ftd-shard-sig-v1"  # SHA-256 pieces: verified, no longer written
DIGESTS = {SCHEME: "blake3", SCHEME_V1: "sha256"}  # scheme -> the JSON key and the hash of its pieces
_HEX256 = re.compile(r"[0-9a-f]{64}")
_NODE_URI = re.compile(r"spiffe://ftd/([A-Za-z0-9][A-Za-z0-9._-]{0,62})/node/([A-Za-z0-9._-]{1,128})")
_MAX_SIG_FILE = 16 << 20  # 1 MiB per 10 TiB of shard
CHUNK = 64 << 20  # bytes per hashed piece of a file
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
FileDigest = tuple[str, int, tuple[str, ...]]  # (name, size, hex digest of each CHUNK piece)
Expected = Mapping[str, tuple[int, str]]  # file name -> (size, crc32c): the catalog's record of the shard


class BadSignature(ValueError):
    """A shard's signature is missing, malformed, by the wrong node or CA, or does not cover its bytes."""


@dataclass(frozen=True)
class Statement:
    """What a node signs about one shard (see the module docstring)."""

    job: str
    step: int
    epoch: int
    rank: int
    world_size: int
    format: str
    files: tuple[FileDigest, ...]  # sorted by name
    signed_unix_s: float
    scheme: str = SCHEME  # which digest the pieces are (:data:`DIGESTS`)

    def encode(self) -> bytes:
        """The canonical bytes signed: the scheme first, then sorted keys, no whitespace."""
        digest = DIGESTS[self.scheme]
        body = {"job": self.job, "step": self.step, "epoch": self.epoch, "rank": self.rank,
                "world_size": self.world_size, "format": self.format, "signed_unix_s": self.signed_unix_s,
                "files": [{"name": n, "size": s, digest: list(h)} for n, s, h in sorted(self.files)]}
        rest = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return f'{{"scheme":"{self.scheme}",{rest[1:]}'.encode()

    @classmethod
    def decode(cls, raw: bytes) -> Statement:
        """The statement in ``raw``, which must be exactly its canonical form (nothing a signer did
        not mean can hide in spacing or duplicate keys)."""
        scheme = next((s for s in DIGESTS if raw.startswith(f'{{"scheme":"{s}",'.encode())), None)
        if scheme is None:
            raise BadSignature(f"not a {SCHEME} (or {SCHEME_V1}) statement")
        digest = DIGESTS[scheme]
        try:
            data = json.loads(raw)
            files = tuple((check_file_name(f["name"]), int(f["size"]), tuple(str(h) for h in f[digest]))
                          for f in data["files"])
            statement = cls(str(data["job"]), int(data["step"]), int(data["epoch"]), int(data["rank"]),
                            int(data["world_size"]), str(data["format"]), files, float(data["signed_unix_s"]),
                            scheme)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise BadSignature(f"the signed statement does not parse: {type(exc).__name__}: {exc}") from exc
        if statement.encode() != raw:
            raise BadSignature("the signed statement is not in canonical form")
        if any(n in (SIGNATURE, MANIFEST) or s < 0 or len(h) != _pieces(s) or not all(map(_HEX256.fullmatch, h))
               for n, s, h in files):
            raise BadSignature("the signed statement lists a bad file entry")
        return statement


@dataclass(frozen=True)
class SignedShard:
    """The contents of ``SHARD.sig``."""

    statement: bytes
    signature: bytes
    certificate_pem: bytes

    def encode(self) -> bytes:
        return json.dumps({"statement": base64.b64encode(self.statement).decode(),
                           "signature": base64.b64encode(self.signature).decode(),
                           "certificate": self.certificate_pem.decode()}, sort_keys=True, indent=1).encode()

    @classmethod
    def decode(cls, raw: bytes) -> SignedShard:
        try:
            data = json.loads(raw)
            return cls(base64.b64decode(data["statement"], validate=True),
                       base64.b64decode(data["signature"], validate=True), str(data["certificate"]).encode())
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise BadSignature(f"{SIGNATURE} does not parse: {type(exc).__name__}: {exc}") from exc


def _pieces(size: int) -> int:
    return max(1, -(-size // CHUNK))


def _hexdigest(scheme: str, data: memoryview) -> str:
    if DIGESTS[scheme] == "blake3":
        return str(blake3.blake3(data).hexdigest())
    return hashlib.sha256(data).hexdigest()


def hash_files(directory: Path, names: Iterable[str], threads: int = HASH_THREADS,
               scheme: str = SCHEME) -> tuple[FileDigest, ...]:
    """(name, size, digest of each :data:`CHUNK` piece, by ``scheme``) of each file of ``directory``
    named, sorted by name: the pieces of all the files hashed on ``threads`` threads from the mapped
    files (no copy)."""
    with contextlib.ExitStack() as stack:
        views: dict[str, memoryview] = {}
        for name in sorted(set(names)):
            f = stack.enter_context(open(directory / name, "rb"))
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                views[name] = memoryview(b"")
                continue
            mapped = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            views[name] = stack.enter_context(memoryview(mapped))
        jobs = [(name, start) for name, view in views.items() for start in range(0, max(len(view), 1), CHUNK)]
        with ThreadPoolExecutor(threads, thread_name_prefix="ftd-digest") as pool:
            sums = list(pool.map(lambda job: _hexdigest(scheme, views[job[0]][job[1]:job[1] + CHUNK]), jobs))
        pieces: dict[str, list[str]] = {name: [] for name in views}
        for (name, _), digest in zip(jobs, sums, strict=True):
            pieces[name].append(digest)
        return tuple((name, len(views[name]), tuple(pieces[name])) for name in views)


def statement_for(directory: Path, *, job: str, step: int, epoch: int, rank: int, world_size: int, fmt: str,
                  now: float, threads: int = HASH_THREADS) -> Statement:
    """The statement about the shard written into ``directory`` (every file but the manifest and the
    signature)."""
    names = sorted(p.name for p in directory.iterdir() if p.name not in (SIGNATURE, MANIFEST) and p.is_file())
    return Statement(job, step, epoch, rank, world_size, fmt, hash_files(directory, names, threads), now)


def sign_statement(statement: bytes, key_pem: bytes) -> bytes:
    """The node key's signature over a statement; refuses anything that is not one (the agent's TLS
    key signs shard statements only)."""
    Statement.decode(statement)
    key = serialization.load_pem_private_key(key_pem, password=None)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(statement, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(statement)
    raise BadSignature(f"a node key of type {type(key).__name__} cannot sign shards (expected EC or Ed25519)")


def load_cas(ca_pem: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(ca_pem)


def _node_name(cert: x509.Certificate) -> tuple[str, str]:
    """(cluster, node name) of a node certificate: exactly one URI SAN, a node's."""
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    if len(uris) != 1 or not (m := _NODE_URI.fullmatch(uris[0])):
        raise BadSignature(f"the signing certificate names no single node identity ({', '.join(uris) or 'no URI'})")
    return m.group(1), m.group(2)


def _verify_signature(cert: x509.Certificate, data: bytes, signature: bytes) -> None:
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            raise BadSignature(f"the signing certificate's {type(key).__name__} key cannot sign shards")
    except InvalidSignature as exc:
        raise BadSignature("the signature does not verify over the statement") from exc


def check_signed(signed: SignedShard, *, cas: Sequence[x509.Certificate], writer: str, job: str, step: int,
                 rank: int, expected: Expected, cluster: str = "") -> Statement:
    """The verified statement of ``signed`` (see the module docstring), or :class:`BadSignature`
    naming what is wrong. ``writer``: the catalog's writer of the shard; ``expected``: the catalog's
    files (the signature file among them); ``cluster``: the CA's cluster name when known."""
    if not writer:
        raise BadSignature("the catalog names no writer for this shard: nobody to check the signature against")
    try:
        cert = x509.load_pem_x509_certificate(signed.certificate_pem)
    except ValueError as exc:
        raise BadSignature(f"the signing certificate does not parse: {exc}") from exc
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            break
        except (ValueError, TypeError, InvalidSignature):
            continue
    else:
        raise BadSignature(f"the signing certificate ({cert.subject.rfc4514_string()}) was not issued by the "
                           "cluster's CA")
    signer_cluster, signer = _node_name(cert)
    if cluster and signer_cluster != cluster:
        raise BadSignature(f"signed by node {signer} of cluster {signer_cluster}, not of {cluster}")
    if signer != writer:
        raise BadSignature(f"signed by node {signer}, and the catalog says node {writer} wrote it")
    _verify_signature(cert, signed.statement, signed.signature)
    statement = Statement.decode(signed.statement)
    when = dt.datetime.fromtimestamp(statement.signed_unix_s, dt.timezone.utc)
    if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
        raise BadSignature(f"signed at {when:%Y-%m-%d %H:%M} UTC, outside its certificate's validity")
    if (statement.job, statement.step, statement.rank) != (job, step, rank):
        raise BadSignature(f"the signature is for job {statement.job} step {statement.step} rank {statement.rank}, "
                           f"not job {job} step {step} rank {rank}")
    signed_files = {n: s for n, s, _ in statement.files}
    catalog_files = {n: s for n, (s, _) in expected.items() if n != SIGNATURE}
    if signed_files != catalog_files:
        raise BadSignature(f"the signed files {sorted(signed_files.items())} are not the catalog's "
                           f"{sorted(catalog_files.items())}")
    return statement


def verify_shard(directory: Path, *, cas: Sequence[x509.Certificate], writer: str, job: str, step: int, rank: int,
                 expected: Expected, names: Collection[str] | None = None, cluster: str = "") -> Statement:
    """Checks the shard copy in ``directory`` before anything of it is unpickled: its ``SHARD.sig``
    (:func:`check_signed`), then the digest of each file in ``names`` (default: every signed file)
    against the statement."""
    path = directory / SIGNATURE
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_SIG_FILE + 1)
    except FileNotFoundError:
        raise BadSignature(f"{path}: the shard is not signed") from None
    if len(raw) > _MAX_SIG_FILE:
        raise BadSignature(f"{path}: over {_MAX_SIG_FILE} bytes")
    statement = check_signed(SignedShard.decode(raw), cas=cas, writer=writer, job=job, step=step, rank=rank,
                             expected=expected, cluster=cluster)
    sums = {n: h for n, _, h in statement.files}
    wanted = sorted(set(sums) if names is None else set(names) - {SIGNATURE})
    if missing := [n for n in wanted if n not in sums]:
        raise BadSignature(f"{directory / missing[0]}: not covered by the signature")
    for name, _, actual in hash_files(directory, wanted, scheme=statement.scheme):
        if actual != sums[name]:
            piece = next(i for i, (a, b) in enumerate(zip(actual, sums[name], strict=False)) if a != b) \
                if len(actual) == len(sums[name]) else -1
            raise BadSignature(f"{directory / name}: {DIGESTS[statement.scheme]} of piece {piece} is not the one "
                               "signed (the bytes were damaged or replaced)")
    return statement


__all__ = ["DIGESTS", "SCHEME", "SCHEME_V1", "SIGNATURE", "BadSignature", "SignedShard", "Statement", "check_signed",
           "hash_files", "load_cas", "sign_statement", "statement_for", "verify_shard"]
