"""torch elastic's DynamicRendezvousHandler on etcd v3 (``--rdzv-backend=etcd-v3``): the backend's
``set_state`` contract case by case, the c10d store, and a real 2-node torchrun job, all against a
real etcd server."""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftd.etcd_client import make_client
from ftd.ftctl.etcd_server import EtcdCluster
from ftd.training.etcd_v3 import EtcdV3RendezvousBackend, EtcdV3Store

pytestmark = pytest.mark.etcd


@pytest.fixture
def client(etcd: EtcdCluster) -> Iterator[object]:
    c = make_client(etcd.endpoints)
    yield c
    c.close()  # type: ignore[attr-defined]


def test_get_state_is_none_when_there_is_no_state(client: object) -> None:
    assert EtcdV3RendezvousBackend(client, "run").get_state() is None


def test_token_none_sets_only_when_absent(client: object) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    state, token, ok = backend.set_state(b"first")  # type: ignore[misc]
    assert (state, ok) == (b"first", True) and backend.get_state() == (b"first", token)
    state2, token2, ok2 = backend.set_state(b"second")  # type: ignore[misc]
    assert (state2, token2, ok2) == (b"first", token, False), "an existing state is returned, not replaced"


def test_current_token_updates_and_returns_the_new_token(client: object) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    _, token, _ = backend.set_state(b"v1")  # type: ignore[misc]
    state, new_token, ok = backend.set_state(b"v2", token)  # type: ignore[misc]
    assert (state, ok) == (b"v2", True) and new_token != token
    assert backend.get_state() == (b"v2", new_token)


def test_stale_token_returns_the_current_state_and_writes_nothing(client: object) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    _, old, _ = backend.set_state(b"v1")  # type: ignore[misc]
    _, current, _ = backend.set_state(b"v2", old)  # type: ignore[misc]
    state, token, ok = backend.set_state(b"v3", old)  # type: ignore[misc]
    assert (state, token, ok) == (b"v2", current, False)
    assert backend.get_state() == (b"v2", current)


def test_a_token_that_is_no_revision_returns_the_current_state(client: object) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    _, token, _ = backend.set_state(b"v1")  # type: ignore[misc]
    assert backend.set_state(b"v2", "not-a-revision") == (b"v1", token, False)
    assert EtcdV3RendezvousBackend(client, "other").set_state(b"x", "junk") is None


def test_a_token_for_a_deleted_state_returns_none(client: object) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    _, token, _ = backend.set_state(b"v1")  # type: ignore[misc]
    client.delete("/torch/elastic/rendezvous/run")  # type: ignore[attr-defined]
    assert backend.set_state(b"v2", token) is None and backend.get_state() is None


def test_racing_writers_exactly_one_wins(client: object, etcd: EtcdCluster) -> None:
    backend = EtcdV3RendezvousBackend(client, "run")
    _, token, _ = backend.set_state(b"base")  # type: ignore[misc]
    results: list[bool] = []
    lock = threading.Lock()

    def write(i: int) -> None:
        other = make_client(etcd.endpoints)
        try:
            out = EtcdV3RendezvousBackend(other, "run").set_state(f"w{i}".encode(), token)
            with lock:
                results.append(bool(out and out[2]))
        finally:
            other.close()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [False] * 7 + [True]


def test_store_semantics(client: object) -> None:
    store = EtcdV3Store(client, "/store/test", timeout=datetime.timedelta(seconds=10))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "zz"])

    def late_set() -> None:
        store.set("late", "here")

    timer = threading.Timer(0.3, late_set)
    timer.start()
    assert store.get("late") == b"here"  # blocks until another writer sets it
    timer.join()
    counts: list[int] = []

    def adder() -> None:
        for _ in range(25):
            counts.append(store.add("n", 1))

    threads = [threading.Thread(target=adder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(counts) == list(range(1, 101)), "add must be atomic"
    assert store.compare_set("cs", "", "v1") == b"v1"
    assert store.compare_set("cs", "wrong", "v2") == b"v1"
    assert store.compare_set("cs", "v1", "v2") == b"v2"
    store.multi_set(["m1", "m2"], [b"x", b"y"])
    assert store.multi_get(["m1", "m2"]) == [b"x", b"y"]
    store.wait(["m1", "a"])
    assert store.delete_key("m1") and not store.check(["m1"])
    assert store.num_keys() == len(["a", "late", "n", "cs", "m2"])
    short = EtcdV3Store(client, "/store/test", timeout=datetime.timedelta(seconds=0.5))
    with pytest.raises(LookupError, match="never"):
        short.get("never")


JOB = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}"), "w").write(f"{dist.get_world_size()} {t.item()}")
dist.destroy_process_group()
"""


def test_a_two_node_torchrun_job_runs_on_etcd_v3(etcd: EtcdCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcd-v3",
            f"--rdzv-endpoint={etcd.endpoints}", "--rdzv-id=v3job", "--nnodes=2", "--nproc-per-node=1",
            "--local-addr=127.0.0.1", "--rdzv-conf=join_timeout=60,last_call_timeout=1", str(script), str(tmp_path)]
    nodes = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    assert sorted(p.read_text() for p in tmp_path.glob("rank-*")) == ["2 3.0", "2 3.0"]
