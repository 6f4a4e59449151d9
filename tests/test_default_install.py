"""A plain install (``./install.sh``, i.e. ``pip install -e .`` without extras) brings what the cold tier
and GPU health need: boto3 and nvidia-ml-py are core dependencies, and the S3 tier round-trips against
moto's S3 server in a fresh interpreter that may import nothing installed only for the dev extra.

The extras ``s3`` and ``gpu`` stay as aliases, so that existing ``pip install 'ftd[s3]'`` lines work.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from storage_fixtures import MotoServer

from ftd.agent.health_measure import GpuSampler
from ftd.agent.health_monitor import health_proto
from ftd.agent.health_rules import Measurements

ROOT = Path(__file__).resolve().parents[1]
CORE = {"boto3": "s3", "nvidia-ml-py": "gpu"}  # now core -> the extra kept as its alias


def _installed() -> importlib.metadata.Distribution:
    """The distribution pip installed (its .dist-info in site-packages), not a stale ``ftd.egg-info`` a build
    may have left in the source tree, which is on sys.path when the tests run from it."""
    found = list(importlib.metadata.distributions(name="ftd", path=[*site.getsitepackages(),
                                                                       site.getusersitepackages()]))
    assert found, "ftd is not installed: run ./install.sh (pip install -e .)"
    return found[0]


def _requirements(dist: importlib.metadata.Distribution) -> list[Requirement]:
    return [Requirement(r) for r in dist.requires or []]


def _unconditional(req: Requirement) -> bool:
    """Required by a plain install: no marker, or one that holds without any extra."""
    return req.marker is None or req.marker.evaluate({"extra": ""})


# ---- metadata ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CORE))
def test_the_installed_distribution_requires_it_without_an_extra(name: str) -> None:
    reqs = [r for r in _requirements(_installed()) if canonicalize_name(r.name) == name]
    core = [r for r in reqs if _unconditional(r)]
    assert core, (f"the installed ftd requires {name} only as {[str(r) for r in reqs]}: stale install? "
                  "re-run ./install.sh (pip install -e .)")
    assert all("extra" not in str(r.marker or "") for r in core)
    # The old extra still names it, so `pip install 'ftd[...]'` keeps working.
    alias = CORE[name]
    assert any(r.marker is not None and r.marker.evaluate({"extra": alias}) for r in reqs), alias


def test_pyproject_declares_them_as_core_dependencies_with_alias_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    assert set(CORE) <= core
    extras = project["optional-dependencies"]
    for name, alias in CORE.items():
        assert [canonicalize_name(Requirement(r).name) for r in extras[alias]] == [name]
    dev = {canonicalize_name(Requirement(r).name) for r in extras["dev"]}
    assert not dev & set(CORE), "a core dependency listed again in dev hides a missing core entry"


def test_marker_evaluation_tells_core_from_extra() -> None:
    assert _unconditional(Requirement("boto3>=1.34"))
    assert _unconditional(Requirement('tomli>=2; python_version < "99"'))
    assert not _unconditional(Requirement('boto3>=1.34; extra == "s3"'))
    assert Marker('extra == "s3"').evaluate({"extra": "s3"})


# ---- what a plain install can import ------------------------------------------------------------------


def _closure(dist: importlib.metadata.Distribution, extras: frozenset[str] = frozenset()) -> set[str]:
    """The installed distributions a plain install of ``dist`` pulls in, recursively (canonical names)."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        current, wanted = todo.pop()
        for req in _requirements(current):
            env_extras = wanted or frozenset({""})
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            name = canonicalize_name(req.name)
            if name in seen:
                continue
            try:
                todo.append((importlib.metadata.distribution(req.name), frozenset(req.extras)))
            except importlib.metadata.PackageNotFoundError:
                continue  # an optional dependency of a dependency that is not installed
            seen.add(name)
    return seen


def _modules_of(dists: set[str]) -> set[str]:
    by_module = importlib.metadata.packages_distributions()
    return {m for m, owners in by_module.items() if {canonicalize_name(o) for o in owners} & dists}


@pytest.fixture
def moto(tmp_path: Path) -> Iterator[MotoServer]:
    server = MotoServer(tmp_path / "moto.log").start()
    try:
        yield server
    finally:
        server.stop()


CHILD = r"""
import importlib.abc, json, os, sys
from pathlib import Path

# What the interpreter loaded before the code under test (site's .pth hooks, such as setuptools').
startup = {m.partition(".")[0] for m in sys.modules}

cfg = json.loads(sys.argv[1])
blocked = set(cfg["blocked"])


class DevExtraBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is installed only for the dev extra")
        return None


sys.meta_path.insert(0, DevExtraBlocker())

from ftd.storage_backends.s3 import S3Backend

tmp = Path(cfg["tmp"])
backend = S3Backend(cfg["bucket"], "plain-install", endpoint_url=cfg["endpoint"], state_dir=tmp / "state",
                    aws_access_key_id="testing", aws_secret_access_key="testing")
src = tmp / "state.pt"
src.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
staging = backend.stage("job/step-00000001/rank-00000")
staging.put_file("state.pt", src)
staging.publish("MANIFEST.json", b"{}")
dst = tmp / "restored.pt"
info = backend.get_file("job/step-00000001/rank-00000/state.pt", dst)
print(json.dumps({
    "published": backend.is_published("job/step-00000001/rank-00000", "MANIFEST.json"),
    "same": dst.read_bytes() == src.read_bytes(),
    "crc32c": info.crc32c,
    "keys": sorted(o.key for o in backend.list("job/")),
    "modules": sorted({m.partition(".")[0] for m in sys.modules} - startup),
}))
"""


@pytest.mark.s3
def test_s3_tier_round_trip_with_only_core_dependencies(moto: MotoServer, tmp_path: Path) -> None:
    dist = _installed()
    core = _closure(dist) | {"ftd"}
    dev_only = _closure(dist, frozenset({"dev"})) - core
    assert {"moto", "pytest"} <= dev_only  # the blocker below really has something to block
    blocked = _modules_of(dev_only) - _modules_of(core)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHONPATH"))}
    cfg = {"bucket": moto.new_bucket(), "endpoint": moto.endpoint, "tmp": str(tmp_path), "blocked": sorted(blocked)}
    # A fresh interpreter outside the source tree: it imports ftd as installed.
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["published"] and result["same"] and len(result["crc32c"]) == 8
    assert "job/step-00000001/rank-00000/state.pt" in result["keys"]
    loaded = set(result["modules"])
    assert "boto3" in loaded and not loaded & blocked
    # Every third-party module the round trip loaded belongs to the plain install.
    third_party = {m for m in loaded - set(sys.stdlib_module_names) if not m.startswith("_")}
    known = _modules_of(core) | {"ftd"}
    assert third_party <= known, f"imported outside the plain install: {sorted(third_party - known)}"


# ---- NVML: core, and a no-op without a GPU --------------------------------------------------------------


def test_nvml_bindings_import_and_the_probe_is_a_no_op_without_a_driver() -> None:
    import pynvml  # nvidia-ml-py, a core dependency

    assert hasattr(pynvml, "nvmlInit")
    probe = GpuSampler()
    sample = health_proto(Measurements(gpus=probe.measure()), None)
    if probe.available:  # a GPU node: one value per device
        assert sample.gpu.count >= 1 and len(sample.gpu.utilization_pct) == sample.gpu.count
    else:  # no driver here: nothing reported, not "zero GPUs"
        assert not sample.HasField("gpu")


class FakeNvml:
    """NVML as pynvml exposes it, with eight GPUs, one of them idle."""

    class _Rates:
        def __init__(self, gpu: int) -> None:
            self.gpu = gpu

    class _Memory:
        used = 1 << 30

    def nvmlInit(self) -> None:  # NVML's names
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 8

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._Rates(10 if handle == 3 else 90)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._Memory()


def test_the_probe_reports_every_gpu_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    probe = GpuSampler()
    assert probe.available
    sample = health_proto(Measurements(gpus=probe.measure()), None).gpu
    assert sample.count == 8
    assert list(sample.utilization_pct) == [90, 90, 90, 10, 90, 90, 90, 90]  # GPU 3 is not averaged away
