"""``GetTiers``' answer: this node's tier specs in agent.proto's wire form, for the training process
to open the very same tiers (it reads them back with :func:`ftd.training.agent_link.tiers_from_proto`).

The specs themselves (:mod:`ftd.storage_backends.tiers`) know nothing of the wire: its form belongs
to the two edges that speak it, the agent that answers and the training side that asks.
"""

from __future__ import annotations

from collections.abc import Iterable

from ftd.storage_backends.tiers import S3Spec, TierSpec
from ftd.v1 import agent_pb2


def spec_to_proto(spec: TierSpec) -> agent_pb2.TierSpec:
    msg = agent_pb2.TierSpec(name=spec.name, location=spec.location)
    s = spec.storage
    if isinstance(s, S3Spec):
        msg.s3.CopyFrom(agent_pb2.S3Tier(
            endpoint=s.endpoint, bucket=s.bucket, prefix=s.prefix, region=s.region,
            connect_timeout_s=s.connect_timeout_s, read_timeout_s=s.read_timeout_s, max_attempts=s.max_attempts,
            state_dir=str(s.state_dir) if s.state_dir is not None else "", part_size=s.part_size,
            concurrency=s.concurrency, backoff_s=s.backoff_s, max_backoff_s=s.max_backoff_s,
            part_checksum=s.part_checksum, spool_dir=str(s.spool_dir) if s.spool_dir is not None else ""))
    else:  # a directory
        msg.local.path = str(s.path)
        msg.local.capacity_bytes = s.capacity_bytes
    return msg


def tiers_to_proto(node_id: str, specs: Iterable[TierSpec]) -> agent_pb2.Tiers:
    return agent_pb2.Tiers(node_id=node_id, tiers=[spec_to_proto(s) for s in specs])


__all__ = ["spec_to_proto", "tiers_to_proto"]
