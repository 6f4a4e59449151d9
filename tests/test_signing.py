"""Shard signatures (ftd.checkpoints.signing), pure: a good shard verifies; tampered bytes, a tampered
statement, no signature, another node's valid signature, a foreign CA's certificate, a writer the
catalog does not name, and a statement replayed at another step are each refused, naming why. The
restore refusing such a copy on real processes: tests/test_signed_shards.py."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from ftd import ca
from ftd.checkpoints import signing
from ftd.checkpoints.signing import (
    SIGNATURE,
    BadSignature,
    SignedShard,
    Statement,
    load_cas,
    sign_statement,
    statement_for,
    verify_shard,
)
from ftd.identity import load_identity

JOB, STEP, RANK = "job", 7, 1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The cluster's PKI (node-0, node-1) and a foreign cluster's (whose node is also called node-0)."""
    ours, theirs = tmp_path_factory.mktemp("pki"), tmp_path_factory.mktemp("foreign")
    ca.bootstrap(ours, "local", nodes=["node-0", "node-1"])
    ca.bootstrap(theirs, "local", nodes=["node-0"])
    return ours, theirs


def write_shard(folder: Path, pki_dir: Path, node: str, step: int = STEP) -> dict[str, tuple[int, str]]:
    """A shard signed by ``node``'s key from ``pki_dir``; returns what the catalog would list."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "state.pt").write_bytes(b"weights" * 1000)
    (folder / "rank_state.pt").write_bytes(b"rng")
    statement = statement_for(folder, job=JOB, step=step, epoch=3, rank=RANK, world_size=2, fmt="torch",
                              now=time.time()).encode()
    material = load_identity(pki_dir, "node", node)
    signed = SignedShard(statement, sign_statement(statement, material.key_pem), material.cert_pem)
    (folder / SIGNATURE).write_bytes(signed.encode())
    return {p.name: (p.stat().st_size, "00000000") for p in folder.iterdir()}


def verify(folder: Path, pki_dir: Path, expected: dict[str, tuple[int, str]], writer: str = "node-0",
           step: int = STEP) -> Statement:
    cas = load_cas((pki_dir / "ca.crt").read_bytes())
    return verify_shard(folder, cas=cas, writer=writer, job=JOB, step=step, rank=RANK, expected=expected,
                        cluster="local")


def test_a_shard_signed_by_the_writer_verifies(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    statement = verify(tmp_path, pki[0], expected)
    assert {n for n, _, _ in statement.files} == {"state.pt", "rank_state.pt"}
    assert (statement.job, statement.step, statement.rank, statement.epoch) == (JOB, STEP, RANK, 3)


def test_tampered_bytes_are_refused_even_with_the_size_kept(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    (tmp_path / "state.pt").write_bytes(b"WEIGHTS" * 1000)
    with pytest.raises(BadSignature, match=r"state\.pt: blake3"):
        verify(tmp_path, pki[0], expected)


def test_a_large_file_is_hashed_in_pieces_and_the_tampered_piece_named(pki: tuple[Path, Path], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signing, "CHUNK", 1024)  # 7000 bytes: 7 pieces, hashed on several threads
    expected = write_shard(tmp_path, pki[0], "node-0")
    statement = verify(tmp_path, pki[0], expected)
    assert [len(h) for n, _, h in statement.files if n == "state.pt"] == [7]
    data = bytearray((tmp_path / "state.pt").read_bytes())
    data[3 * 1024 + 5] ^= 1
    (tmp_path / "state.pt").write_bytes(bytes(data))
    with pytest.raises(BadSignature, match="blake3 of piece 3 is not the one signed"):
        verify(tmp_path, pki[0], expected)


def test_a_tampered_statement_breaks_the_signature(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    (tmp_path / "state.pt").write_bytes(b"evil" * 1750)  # same size, and the statement rewritten to match
    signed = SignedShard.decode((tmp_path / SIGNATURE).read_bytes())
    forged = statement_for(tmp_path, job=JOB, step=STEP, epoch=3, rank=RANK, world_size=2, fmt="torch",
                           now=json.loads(signed.statement)["signed_unix_s"]).encode()
    assert forged != signed.statement
    (tmp_path / SIGNATURE).write_bytes(SignedShard(forged, signed.signature, signed.certificate_pem).encode())
    with pytest.raises(BadSignature, match="does not verify"):
        verify(tmp_path, pki[0], expected)


def test_files_the_catalog_lists_beyond_the_signed_ones_are_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    with pytest.raises(BadSignature, match="not the catalog's"):
        verify(tmp_path, pki[0], {**expected, "extra.bin": (1, "00000000")})


def test_a_shard_without_a_signature_is_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    (tmp_path / SIGNATURE).unlink()
    with pytest.raises(BadSignature, match="not signed"):
        verify(tmp_path, pki[0], expected)
    (tmp_path / SIGNATURE).write_bytes(b"{}")
    with pytest.raises(BadSignature, match="does not parse"):
        verify(tmp_path, pki[0], expected)


def test_another_nodes_valid_signature_is_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-1")  # a compromised node-1 writes rank 1's shard
    assert verify(tmp_path, pki[0], expected, writer="node-1").rank == RANK  # valid for node-1 itself
    with pytest.raises(BadSignature, match="signed by node node-1, and the catalog says node node-0"):
        verify(tmp_path, pki[0], expected, writer="node-0")


def test_a_certificate_from_a_foreign_ca_is_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[1], "node-0")  # same name, same cluster name, another CA
    with pytest.raises(BadSignature, match="not issued by the cluster's CA"):
        verify(tmp_path, pki[0], expected)


def test_a_shard_the_catalog_names_no_writer_for_is_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0")
    with pytest.raises(BadSignature, match="names no writer"):
        verify(tmp_path, pki[0], expected, writer="")


def test_a_signed_shard_replayed_at_another_step_is_refused(pki: tuple[Path, Path], tmp_path: Path) -> None:
    expected = write_shard(tmp_path, pki[0], "node-0", step=3)  # the writer's own old shard, copied forward
    with pytest.raises(BadSignature, match="for job job step 3 rank 1, not job job step 7"):
        verify(tmp_path, pki[0], expected)


def test_the_node_key_signs_shard_statements_only(pki: tuple[Path, Path]) -> None:
    key = load_identity(pki[0], "node", "node-0").key_pem
    with pytest.raises(BadSignature, match=r"not a ftd-shard-sig-v2 \(or ftd-shard-sig-v1\) statement"):
        sign_statement(b" " * 64 + b"TLS 1.3, server CertificateVerify\x00" + b"x" * 32, key)
    good = Statement(JOB, STEP, 0, RANK, 2, "torch", (("state.pt", 1, ("0" * 64,)),), 1.0).encode()
    with pytest.raises(BadSignature, match="canonical"):
        sign_statement(good.replace(b'"epoch":0', b'"epoch": 0'), key)
    assert sign_statement(good, key)


def test_a_shard_signed_under_the_first_scheme_still_verifies_and_its_tampering_is_named(
        pki: tuple[Path, Path], tmp_path: Path) -> None:
    """Shards signed before BLAKE3 (SHA-256 pieces, scheme v1) stay restorable; the scheme is part of
    the signed bytes, so nobody can relabel a statement's digests."""
    folder = tmp_path / "v1"
    expected = write_shard(folder, pki[0], "node-0")
    signed = SignedShard.decode((folder / SIGNATURE).read_bytes())
    current = Statement.decode(signed.statement)
    assert current.scheme == signing.SCHEME and b'"blake3":[' in signed.statement
    names = [n for n, _, _ in current.files]
    old = dataclasses.replace(current, scheme=signing.SCHEME_V1,
                              files=signing.hash_files(folder, names, scheme=signing.SCHEME_V1))
    raw = old.encode()
    assert raw.startswith(b'{"scheme":"ftd-shard-sig-v1",') and b'"sha256":[' in raw
    material = load_identity(pki[0], "node", "node-0")
    genuine = SignedShard(raw, sign_statement(raw, material.key_pem), material.cert_pem).encode()
    (folder / SIGNATURE).write_bytes(genuine)
    assert verify(folder, pki[0], expected).scheme == signing.SCHEME_V1
    relabelled = raw.replace(b"ftd-shard-sig-v1", b"ftd-shard-sig-v2").replace(b'"sha256":', b'"blake3":')
    (folder / SIGNATURE).write_bytes(SignedShard(relabelled, sign_statement(raw, material.key_pem),
                                                 material.cert_pem).encode())
    with pytest.raises(BadSignature, match="does not verify"):
        verify(folder, pki[0], expected)
    (folder / SIGNATURE).write_bytes(genuine)
    (folder / "state.pt").write_bytes(b"WEIGHTS" * 1000)
    with pytest.raises(BadSignature, match=r"state\.pt: sha256 of piece 0"):
        verify(folder, pki[0], expected)
