"""Shard signatures from the training side: signed at save, checked at restore before unpickling.

The scheme is :mod:`ftd.checkpoints.signing`'s. At a save, once the shard's files are written into
the staging folder, :meth:`ShardSigner.sign` hashes them (SHA-256), has the node's agent sign the
statement with its mTLS key (``Agent.SignShard`` over the Unix socket: the key stays in the agent)
and writes ``SHARD.sig`` beside them, before the staging lists and CRC32Cs its files: the signature
is one of the shard's files, so every copy (memory, buddy replica, SSD, HDD, S3, peer) carries it.

At a restore, :meth:`ShardSigner.verify` checks a copy's signature against the cluster's CA and the
catalog's ``writer`` of that shard, then the SHA-256 of every file about to be loaded, and raises
:class:`~.corruption.CorruptCopy` on any failure: the copy is recorded corrupt and the next copy (or
step) is read, exactly like a CRC32C mismatch.

Without mTLS (an agent with no PKI: ``GetShardTrust`` answers no CA) nothing is signed or checked:
no identity exists to check against.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from functools import cached_property
from pathlib import Path

from cryptography import x509

from ftd.checkpoints.catalog import ShardRecord
from ftd.checkpoints.signing import SIGNATURE, BadSignature, SignedShard, load_cas, statement_for, verify_shard
from ftd.v1 import agent_pb2

from .agent_link import AgentLink
from .corruption import CorruptCopy

log = logging.getLogger("ftd.training.signing")


class ShardSigner:
    """Signs this rank's shards through its agent and checks any shard against the cluster's CA."""

    def __init__(self, agent: AgentLink, trust: agent_pb2.ShardTrust) -> None:
        self.agent = agent
        self.ca_pem = trust.ca_pem
        self.cluster = trust.cluster

    @classmethod
    def from_agent(cls, agent: AgentLink) -> ShardSigner | None:
        """The signer of a node with mTLS; ``None`` for an agent without (nothing to sign with)."""
        trust = agent.shard_trust()
        if not trust.ca_pem:
            log.warning("the node's agent runs without mTLS: shards are neither signed nor checked")
            return None
        return cls(agent, trust)

    @cached_property
    def cas(self) -> list[x509.Certificate]:
        return load_cas(self.ca_pem)

    def sign(self, directory: Path, *, job: str, step: int, epoch: int, rank: int, world_size: int, fmt: str) -> None:
        """Writes ``SHARD.sig`` for the shard just written into ``directory``. On one thread: the save
        runs beside the training, which owns the other cores (two threads slowed a 1 s step of
        single-threaded compute on this 2-core box by a further few per cent)."""
        statement = statement_for(directory, job=job, step=step, epoch=epoch, rank=rank, world_size=world_size,
                                  fmt=fmt, now=time.time(), threads=1).encode()
        signed = self.agent.sign_shard(statement)
        (directory / SIGNATURE).write_bytes(SignedShard(statement, signed.signature, signed.certificate_pem).encode())

    def verify(self, directory: Path, job: str, step: int, shard: ShardRecord,
               names: Collection[str] | None = None) -> None:
        """Checks the copy of ``shard`` in ``directory`` (``names``: the files about to be read, default
        all): :class:`CorruptCopy` naming what is wrong."""
        expected = {f.name: (f.size, f.crc32c) for f in shard.files}
        try:
            verify_shard(directory, cas=self.cas, writer=shard.writer, job=job, step=step, rank=shard.rank,
                         expected=expected, names=names, cluster=self.cluster)
        except BadSignature as exc:
            raise CorruptCopy(f"signature check failed: {exc}") from exc


__all__ = ["SIGNATURE", "ShardSigner"]
