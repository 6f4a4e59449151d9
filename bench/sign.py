"""What a signed shard costs: signing and verifying a 1 GiB shard beside its save and restore.

    python bench/sign.py [--gib 1] [--dir /tmp] [--trials 3] [--json]

In one run, on the same bytes: ``torch.save`` of a state of ``--gib`` GiB (4 float32 tensors) into a
shard folder under ``--dir`` (fsync'd, as the save loop publishes), the signature a save adds
(:func:`ftd.checkpoints.signing.statement_for`: BLAKE3 of every file, then the node key's ECDSA P-256
signature over the statement, the key the CA in ``ftd.ca`` issues), the check a restore adds before
unpickling (:func:`~ftd.checkpoints.signing.verify_shard`: certificate chain, writer, signature,
BLAKE3 of every file), the CRC32C check the restore already ran, and ``torch.load`` of the shard
(every byte read: ``mmap=False``). The files are in the page cache when hashed (a save hashes what it
just wrote; a restore's CRC32C pass reads them first). The agent's ``SignShard`` round trip over its
Unix socket (one small message) is not included. Beside it, the digests of the first scheme (SHA-256,
``sha256_hash_s``: what a save and a restore hashed before BLAKE3) on the same bytes. Prints the
median of ``--trials`` per figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ftd import ca
from ftd.checkpoints.signing import (
    SCHEME_V1,
    SIGNATURE,
    SignedShard,
    hash_files,
    load_cas,
    sign_statement,
    statement_for,
    verify_shard,
)
from ftd.identity import load_identity
from ftd.storage_backends.base import crc32c_file

import _common


def one_trial(folder: Path, gib: float, material: Any) -> dict[str, float]:
    n = int(gib * (1 << 30) / 4 / 4)
    state = {f"t{i}": torch.randn(n) for i in range(4)}
    folder.mkdir(parents=True)
    out: dict[str, float] = {}
    began = time.perf_counter()
    torch.save(state, folder / "state.pt")
    with open(folder / "state.pt", "rb") as f:
        os.fsync(f.fileno())
    out["save_s"] = time.perf_counter() - began
    del state

    began = time.perf_counter()
    statement = statement_for(folder, job="bench", step=1, epoch=0, rank=0, world_size=1, fmt="torch",
                              now=time.time()).encode()
    hashed = time.perf_counter()
    signed = SignedShard(statement, sign_statement(statement, material.key_pem), material.cert_pem)
    (folder / SIGNATURE).write_bytes(signed.encode())
    out["sign_hash_s"] = hashed - began
    out["sign_s"] = time.perf_counter() - began
    began = time.perf_counter()
    hash_files(folder, ["state.pt"], scheme=SCHEME_V1)
    out["sha256_hash_s"] = time.perf_counter() - began

    expected = {p.name: (p.stat().st_size, "") for p in folder.iterdir()}
    began = time.perf_counter()
    for name in expected:
        crc32c_file(folder / name)
    out["crc32c_check_s"] = time.perf_counter() - began

    began = time.perf_counter()
    verify_shard(folder, cas=load_cas(material.ca_pem), writer="node-0", job="bench", step=1, rank=0,
                 expected=expected, cluster="bench")
    out["verify_s"] = time.perf_counter() - began

    began = time.perf_counter()
    loaded = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    out["load_s"] = time.perf_counter() - began
    out["bytes"] = float((folder / "state.pt").stat().st_size)
    del loaded
    shutil.rmtree(folder)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="the shard's size (GiB)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the shard is written (a tier's disk)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ftd-bench-sign-") as tmp:
        pki = Path(tmp) / "pki"
        ca.bootstrap(pki, "bench", nodes=["node-0"])
        material = load_identity(pki, "node", "node-0")
        trials = [one_trial(Path(tmp) / f"shard-{i}", args.gib, material) for i in range(args.trials)]
    med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
    gib = med["bytes"] / (1 << 30)
    result: dict[str, Any] = {
        "shard_gib": round(gib, 3), "trials": args.trials, "dir": args.dir,
        "save_torch_s": med["save_s"], "sign_s": med["sign_s"], "sign_hash_s": med["sign_hash_s"],
        "sign_over_save": med["sign_s"] / med["save_s"],
        "restore_torch_load_s": med["load_s"], "crc32c_check_s": med["crc32c_check_s"], "verify_s": med["verify_s"],
        "verify_over_load": med["verify_s"] / med["load_s"],
        "digest_gib_s": gib / med["sign_hash_s"], "sha256_hash_s": med["sha256_hash_s"],
        "sha256_gib_s": gib / med["sha256_hash_s"],
    }
    _common.emit(result, args.json)


if __name__ == "__main__":
    main()
