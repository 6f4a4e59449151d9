"""ftctl end to end through ``main(argv)``: up, status, nodes, drill, down, and its error paths."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ftd.ftctl.cli import main
from ftd.ftctl.etcd_server import free_port
from ftd.ftctl.localcluster import ClusterFile

pytestmark = pytest.mark.etcd


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def test_up_status_nodes_drill_down(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTD_COORDINATOR", raising=False)
    monkeypatch.delenv("FTD_DRILL_TOKEN", raising=False)
    monkeypatch.delenv("FTD_PKI_DIR", raising=False)
    work = tmp_path / "demo"
    rc, out, err = run(capsys, "up", "--workdir", str(work), "--nodes", "2", "--spares", "1")
    assert rc == 0, err
    cluster = ClusterFile.load(work.resolve())
    assert cluster.coordinator_endpoints in out
    pids = [p.pid for p in cluster.all_procs()]
    assert len(pids) == 5 and all(alive(p) for p in pids)  # etcd, coordinator, 3 agents
    try:
        rc, out, _ = run(capsys, "status", "--json", "--workdir", str(work))
        status = json.loads(out)
        assert rc == 0 and {"leader", "epoch", "world", "spares", "dead"} <= set(status)
        assert sorted(status["world"]) == ["node-0", "node-1"] and status["spares"] == ["node-2"]
        # Both actives may be admitted in one commit or in two: the contract is an epoch >= 1.
        assert status["dead"] == [] and status["epoch"] >= 1
        epoch = status["epoch"]

        rc, out, _ = run(capsys, "nodes", "--json", "--workdir", str(work))
        nodes = {n["node_id"]: n for n in json.loads(out)}
        for n in nodes.values():
            assert {"node_id", "host", "pid", "role", "state", "rank", "epoch", "last_heartbeat_age_s"} <= set(n)
            assert n["state"] == "alive" and n["pid"] in pids and 0 <= n["last_heartbeat_age_s"] < 2
        assert nodes["node-2"]["role"] == "spare" and nodes["node-2"]["rank"] == -1
        victim_rank = nodes["node-0"]["rank"]

        rc, out, _ = run(capsys, "status", "--workdir", str(work))
        assert rc == 0 and re.search(rf"epoch:\s+{epoch}\b", out) and "spares:   node-2" in out

        rc, out, err = run(capsys, "drill", "--kill-node", "node-0", "--json", "--workdir", str(work))
        result = json.loads(out)
        assert rc == 0, (out, err)
        assert {"node", "detected_s", "replacement", "epoch_before", "epoch_after", "verdict"} <= set(result)
        assert result["node"] == "node-0" and result["replacement"] == "node-2"
        assert result["epoch_after"] == result["epoch_before"] + 1 and 0 < result["detected_s"] <= 3.0
        assert result["verdict"].startswith("pass")
        assert not alive(nodes["node-0"]["pid"]), "the drill must really kill the node"
        rc, out, _ = run(capsys, "status", "--json", "--workdir", str(work))
        after = json.loads(out)
        assert after["world"][victim_rank] == "node-2" and after["dead"] == ["node-0"]

        rc, _, err = run(capsys, "drill", "--kill-node", "nope", "--workdir", str(work))
        assert rc == 1 and "'nope' is not registered" in err
        rc, _, err = run(capsys, "drill", "--kill-node", "node-0", "--workdir", str(work))
        assert rc == 1 and "already" in err

        rc, out, _ = run(capsys, "events", "--json", "--workdir", str(work))
        kinds = [e["kind"] for e in json.loads(out)]
        assert "node_dead" in kinds and "spare_promoted" in kinds
    finally:
        rc, out, _ = run(capsys, "down", "--workdir", str(work))
    assert rc == 0 and "coordinator-0" in out
    assert not any(alive(p) for p in pids)


def test_errors_are_clear(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FTD_DRILL_TOKEN", raising=False)
    monkeypatch.delenv("FTD_PKI_DIR", raising=False)
    dead = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("FTD_COORDINATOR", dead)
    rc, _, err = run(capsys, "--timeout", "0.3", "status")
    assert rc == 3 and dead in err and "ftd-coordinator" in err
    assert "--pki-dir" in err, "a plaintext client is told how to use mTLS"
    rc, _, err = run(capsys, "--coordinator", "127.0.0.1:1", "status")
    assert rc == 2 and "conflicts with FTD_COORDINATOR" in err
    rc, _, err = run(capsys, "drill", "--kill-node", "n", "--token-file", str(tmp_path / "missing"))
    assert rc == 2 and "--token-file" in err and "missing" in err
    monkeypatch.setenv("FTD_PKI_DIR", str(tmp_path / "a"))
    rc, _, err = run(capsys, "--pki-dir", str(tmp_path / "b"), "status")
    assert rc == 2 and "conflicts with FTD_PKI_DIR" in err
    rc, _, err = run(capsys, "status")
    assert rc == 1 and str(tmp_path / "a" / "ca.crt") in err, "a missing PKI is named"
    monkeypatch.delenv("FTD_PKI_DIR")
    rc, _, err = run(capsys, "down", "--workdir", str(tmp_path / "nothing"))
    assert rc == 1 and "cluster.json does not exist" in err
    monkeypatch.delenv("FTD_COORDINATOR")
    rc, _, err = run(capsys, "--coordinator", "not-an-endpoint", "status")
    assert rc == 2 and "HOST:PORT" in err


def test_certs_through_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pki_dir = tmp_path / "pki"
    rc, out, err = run(capsys, "certs", "--pki-dir", str(pki_dir), "init", "--cluster", "c1")
    assert rc == 0, err
    rc, out, err = run(capsys, "certs", "--pki-dir", str(pki_dir), "issue", "node", "node-1")
    assert rc == 0 and "node/node-1" in out, err
    assert (pki_dir / "nodes" / "node-1.key").stat().st_mode & 0o777 == 0o600
    rc, out, _ = run(capsys, "certs", "--pki-dir", str(pki_dir), "rotate", "node", "node-1")
    assert rc == 0 and "rotated" in out
    rc, _, err = run(capsys, "certs", "--pki-dir", str(pki_dir), "rotate", "node", "nobody")
    assert rc == 1 and "nobody" in err
