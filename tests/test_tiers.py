"""The one tier factory and its spec: what the agent's settings build is what travels to the training
process over GetTiers, and every S3 setting reaches the backend that either side opens."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ftd.agent.settings import AgentSettings
from ftd.agent.tiers_wire import tiers_to_proto
from ftd.storage_backends.local import LocalBackend
from ftd.storage_backends.memory import MemoryTier
from ftd.storage_backends.tiers import LocalSpec, S3Spec, TierSpec, open_backend, open_tier
from ftd.training.agent_link import tiers_from_proto
from ftd.v1 import agent_pb2

S3 = S3Spec(endpoint="http://127.0.0.1:9", bucket="ckpt", prefix="team/a", region="eu-west-2",
            connect_timeout_s=1.5, read_timeout_s=7.0, max_attempts=3, state_dir=Path("/var/lib/ftd/s3-uploads"),
            part_size=16 << 20, concurrency=2, backoff_s=0.1, max_backoff_s=2.0, part_checksum="md5",
            spool_dir=Path("/mnt/ssd/ftd"))


def test_specs_survive_the_wire_unchanged() -> None:
    specs = [TierSpec("ssd", "node-1", LocalSpec(Path("/mnt/ssd"))),
             TierSpec("hdd", "shared", LocalSpec(Path("/mnt/nfs"))),
             TierSpec("s3", "s3", S3)]
    wire = agent_pb2.Tiers.FromString(tiers_to_proto("node-1", specs).SerializeToString())
    assert wire.node_id == "node-1"
    assert tiers_from_proto(wire) == specs
    assert [s.shared for s in specs] == [False, True, True]


def test_the_agents_settings_build_every_s3_setting(tmp_path: Path) -> None:
    settings = AgentSettings(node_id="n1", workdir=tmp_path, hdd_shared=True, s3_endpoint="http://s3.local:9000",
                             s3_bucket="b", s3_prefix="p", s3_region="ap-south-1", s3_timeout_s=4.0,
                             s3_max_attempts=7)
    mem, ssd, hdd, s3 = settings.tier_specs
    assert mem.name == "mem" and mem.location == "n1" and mem.storage.path == Path("/dev/shm/ftd/n1")  # type: ignore[union-attr]
    assert mem.storage.capacity_bytes > 0  # type: ignore[union-attr]  # a quarter of the node's memory
    assert ssd == TierSpec("ssd", "n1", LocalSpec(tmp_path / "ssd"))
    assert hdd == TierSpec("hdd", "shared", LocalSpec(tmp_path / "hdd"))
    assert s3 == TierSpec("s3", "s3", S3Spec(endpoint="http://s3.local:9000", bucket="b", prefix="p",
                                             region="ap-south-1", read_timeout_s=4.0, max_attempts=7,
                                             state_dir=tmp_path / "s3-uploads", spool_dir=tmp_path / "ssd"))
    assert tiers_from_proto(tiers_to_proto("n1", settings.tier_specs)) == settings.tier_specs
    assert [s.name for s in AgentSettings(node_id="n1", workdir=tmp_path).tier_specs] == ["mem", "ssd", "hdd"]
    assert [s.name for s in AgentSettings(node_id="n1", workdir=tmp_path, mem_tier=False).tier_specs] == ["ssd", "hdd"]


def test_the_factory_applies_every_s3_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    backend = open_backend(TierSpec("s3", "s3", S3))
    client = backend.client  # type: ignore[attr-defined]
    assert backend.name == "s3://ckpt/team/a/"
    assert client.meta.region_name == "eu-west-2"
    assert client.meta.endpoint_url == "http://127.0.0.1:9"
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (1.5, 7.0)
    b = backend
    assert (b.max_attempts, b.state_dir, b.part_size, b.concurrency, b.backoff_s, b.max_backoff_s,  # type: ignore[attr-defined]
            b.part_checksum, b.spool_dir) == (  # type: ignore[attr-defined]
        3, Path("/var/lib/ftd/s3-uploads"), 16 << 20, 2, 0.1, 2.0, "md5", Path("/mnt/ssd/ftd"))


def test_a_local_tier_opens_on_its_directory(tmp_path: Path) -> None:
    tier = open_tier(TierSpec("ssd", "n1", LocalSpec(tmp_path / "ssd")))
    assert (tier.name, tier.location, tier.shared) == ("ssd", "n1", False)
    tier.backend.put_stream("a/b", io.BytesIO(b"x"))
    assert (tmp_path / "ssd" / "a" / "b").read_bytes() == b"x"
    assert type(tier.backend) is LocalBackend and tier.memory is None


def test_the_memory_tier_opens_with_its_budget(tmp_path: Path) -> None:
    tier = open_tier(TierSpec("mem", "n1", LocalSpec(tmp_path / "mem", 1 << 20)))
    assert isinstance(tier.memory, MemoryTier) and tier.memory is tier.backend
    assert tier.memory.capacity_bytes == 1 << 20 and tier.memory.folder_path("j/s") == tmp_path / "mem" / "j" / "s"


def test_malformed_specs_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="max_attempts=0"):
        S3Spec(endpoint="", bucket="b", max_attempts=0)
    with pytest.raises(ValueError, match="part_size"):
        S3Spec(endpoint="", bucket="b", part_size=1 << 20)
    with pytest.raises(ValueError, match="names no storage"):
        tiers_from_proto(agent_pb2.Tiers(node_id="n", tiers=[agent_pb2.TierSpec(name="ssd", location="n")]))
    with pytest.raises(ValueError, match="no tiers"):
        tiers_from_proto(agent_pb2.Tiers(node_id="n"))
    old_agent = agent_pb2.TierSpec(name="s3", location="s3", s3=agent_pb2.S3Tier(endpoint="http://x", bucket="b"))
    with pytest.raises(ValueError, match="invalid S3 tier settings"):  # zeros where settings should be
        tiers_from_proto(agent_pb2.Tiers(node_id="n", tiers=[old_agent]))
