"""``ftctl up --isolate`` / ``ftctl demo --isolate`` (ftctl/isolated.py): a local cluster with every
process in its own network namespace, driven through the real ``ftctl`` from the root namespace. Each
test proves that nothing is left behind: no namespace of the lab's prefix, no veth, no nft table, no
process. Needs root and ip/tc/nft (``netns``); the privilege check itself runs under ``setpriv``."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftctl import isolated
from ftd import netlab
from ftd.netlab.ledger import netns_list

pytestmark = [pytest.mark.netns, pytest.mark.slow]

_MISSING = netlab.missing_privileges()
needs_lab = pytest.mark.skipif(bool(_MISSING), reason=f"network namespaces need root and tools: missing "
                                                      f"{', '.join(_MISSING)}")
needs_etcd = pytest.mark.skipif(not (os.environ.get("FTD_ETCD_BINARY") or shutil.which("etcd")
                                     or Path("/usr/bin/etcd").exists()),
                                reason="etcd server binary not installed (apt-get install -y etcd-server)")


def ftctl(*argv: str, timeout_s: float = 120.0, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != isolated.ENV_INSIDE}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "ftd.ftctl.cli", *argv], capture_output=True,
                          text=True, timeout=timeout_s, env=env)


def assert_clean(prefix: str) -> None:
    assert netlab.leftovers(prefix) == []
    assert not [n for n in netns_list() if n.startswith(prefix)]


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A cluster workdir; whatever a failed test left there is torn down afterwards."""
    work = tmp_path / "cluster"
    yield work
    if (work / isolated.LAB_DIR / "netlab.json").exists():
        ftctl("down", "--workdir", str(work), timeout_s=60)


def test_isolate_without_privileges_names_what_is_missing(tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run ftctl without CAP_NET_ADMIN/CAP_SYS_ADMIN")
    drop = [setpriv, "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-all"]
    res = ftctl("up", "--isolate", "--workdir", str(tmp_path / "c"), prefix=drop, timeout_s=60)
    assert res.returncode == 2, res.stderr
    assert "ftctl: --isolate needs root" in res.stderr
    assert "missing CAP_NET_ADMIN, CAP_SYS_ADMIN" in res.stderr
    assert not (tmp_path / "c" / isolated.LAB_DIR / "netlab.json").exists()
    res = ftctl("demo", "--isolate", "--json", "--workdir", str(tmp_path / "d"), prefix=drop, timeout_s=60)
    assert res.returncode == 2 and "missing CAP_NET_ADMIN" in res.stderr and res.stdout == ""


@needs_lab
@needs_etcd
def test_up_isolated_is_reached_from_the_root_namespace_and_down_leaves_nothing(workdir: Path) -> None:
    res = ftctl("up", "--isolate", "--workdir", str(workdir), "--nodes", "2", "--spares", "1")
    assert res.returncode == 0, res.stderr + res.stdout
    lab = isolated.load(workdir)
    prefix, subnet = lab["prefix"], ipaddress.IPv4Network(lab["subnet"])
    assert sorted(lab["hosts"]) == ["coordinator-0", "ctl", "etcd-0", "node-0", "node-1", "node-2"]
    assert all(n.startswith(f"{prefix}-") for n in (h["netns"] for h in lab["hosts"].values()))

    status = ftctl("--workdir", str(workdir), "status", "--json")  # from the root namespace
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert len(data["world"]) == 2 and len(data["spares"]) == 1
    nodes = json.loads(ftctl("nodes", "--workdir", str(workdir), "--json").stdout)
    addresses = {n["node_id"]: n["host"] for n in nodes}
    assert len(set(addresses.values())) == 3
    assert all(ipaddress.IPv4Address(a) in subnet for a in addresses.values())
    assert all(n["agent_address"] == f"{n['host']}:{isolated.AGENT_PORT}" for n in nodes)
    assert addresses == {name: lab["hosts"][name]["address"] for name in addresses}
    # Each node its own SSD and HDD directory: nothing shared without --shared-hdd.
    cluster = json.loads((workdir / "cluster.json").read_text())
    assert cluster["shared_hdd"] is False and cluster["isolation"]["prefix"] == prefix
    tiers = [(d["tier"], d["path"]) for n in nodes for d in n["health"]["disks"]]
    assert len({p for _, p in tiers}) == len(tiers) == 6
    assert all(f"/nodes/{n['node_id']}/" in d["path"] for n in nodes for d in n["health"]["disks"])
    assert not (workdir / "shared").exists()
    # The root namespace has no route to the lab: the addresses live only on its bridge.
    route = subprocess.run(["ip", "-4", "route", "get", addresses["node-0"]], capture_output=True, text=True)
    assert str(subnet) not in route.stdout and "ftd" not in route.stdout

    down = ftctl("down", "--workdir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert f"removed network lab {prefix}" in down.stdout
    assert_clean(prefix)
    assert isolated.load(workdir) == {}


@needs_lab
@needs_etcd
def test_a_crashed_isolated_up_is_cleaned_by_the_next_up(workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != isolated.ENV_INSIDE}
    proc = subprocess.Popen([sys.executable, "-m", "ftd.ftctl.cli", "up", "--isolate", "--workdir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.monotonic() + 90
    while not (workdir / "run" / "coordinator-0.json").exists():  # mid-start: etcd and a coordinator run
        assert proc.poll() is None and time.monotonic() < deadline, "ftctl up exited before the coordinator ran"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # ftctl (both halves) dies; the lab and its daemons stay
    proc.wait()
    first = isolated.load(workdir)["prefix"]
    assert netlab.leftovers(first), "expected the crashed lab to be still there"

    again = ftctl("up", "--isolate", "--workdir", str(workdir))
    assert again.returncode == 0, again.stderr + again.stdout
    assert_clean(first)
    second = isolated.load(workdir)["prefix"]
    assert second != first
    assert ftctl("--workdir", str(workdir), "status").returncode == 0

    # A running isolated cluster that was never brought down: the next up replaces it too.
    third = ftctl("up", "--isolate", "--workdir", str(workdir))
    assert third.returncode == 0, third.stderr
    assert_clean(second)
    last = isolated.load(workdir)["prefix"]
    assert ftctl("down", "--workdir", str(workdir)).returncode == 0
    assert_clean(last)


@needs_lab
@needs_etcd
def test_demo_isolated_restores_without_a_shared_hdd_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    work = tmp_path / "demo"
    res = ftctl("demo", "--isolate", "--json", "--workdir", str(work), "--report", str(tmp_path / "r.html"),
                timeout_s=420)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["passed"] is True
    assert out["drill"]["resumed_step"] > 0
    cluster = json.loads((work / "cluster" / "cluster.json").read_text())
    assert cluster["shared_hdd"] is False and cluster["isolation"]
    assert not (work / "cluster" / "shared").exists()
    assert "removed" in res.stderr
    assert_clean(cluster["isolation"]["prefix"])
    assert isolated.load(work / "cluster") == {}


@needs_lab
@needs_etcd
def test_up_isolated_with_s3_three_etcd_members_and_two_coordinators(workdir: Path) -> None:
    res = ftctl("up", "--isolate", "--workdir", str(workdir), "--nodes", "2", "--spares", "1", "--s3",
                "--etcd-members", "3", "--coordinators", "2")
    assert res.returncode == 0, res.stderr + res.stdout
    lab = isolated.load(workdir)
    prefix, subnet = lab["prefix"], ipaddress.IPv4Network(lab["subnet"])
    assert {"s3", "etcd-0", "etcd-1", "etcd-2", "coordinator-0", "coordinator-1"} <= set(lab["hosts"])
    cluster = json.loads((workdir / "cluster.json").read_text())
    etcd = cluster["etcd_endpoints"].split(",")
    assert len(etcd) == 3 and all(ipaddress.IPv4Address(e.split(":")[0]) in subnet for e in etcd)
    assert [e.split(":")[0] for e in etcd] == [lab["hosts"][f"etcd-{i}"]["address"] for i in range(3)]
    assert cluster["s3_endpoint"] == f"http://{lab['hosts']['s3']['address']}:9000"
    assert cluster["s3"][0]["pid"] > 0
    status = json.loads(ftctl("--workdir", str(workdir), "status", "--json").stdout)
    assert len(status["world"]) == 2 and len(status["spares"]) == 1
    down = ftctl("down", "--workdir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert "etcd2" in down.stdout and "s3" in down.stdout and "coordinator-1" in down.stdout
    assert_clean(prefix)


def test_s3_with_an_endpoint_is_refused(tmp_path: Path) -> None:
    from ftctl import localcluster

    with pytest.raises(localcluster.ClusterError, match="cannot be combined with --s3-endpoint"):
        localcluster.up(tmp_path / "c", 1, 0, s3=True, s3_endpoint="http://127.0.0.1:1")
