"""The settings machinery: file + env + flags, validation naming the field, conflicts, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ftd.agent.settings import ENV_PREFIX as AGENT_ENV
from ftd.agent.settings import AgentSettings
from ftd.coordinator.settings import ENV_PREFIX, CoordinatorSettings
from ftd.settings import SettingsError, describe, load, load_or_exit


def co(argv: list[str], env: dict[str, str] | None = None) -> CoordinatorSettings:
    return load(CoordinatorSettings, argv, env or {}, prog="ftd-coordinator", env_prefix=ENV_PREFIX)


def test_defaults_are_valid_and_detect_within_three_seconds() -> None:
    s = co([])
    assert s.dead_after_s < 3.0 and s.disconnect_dead_after_s < 3.0
    assert s.tick_s <= 0.1


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('dead_after_s = 4.0\nsuspect_after_s = 2.0\ncluster = "from-file"\n')
    s = co(["--config", str(cfg)])
    assert (s.dead_after_s, s.cluster) == (4.0, "from-file")
    s = co(["--config", str(cfg)], {f"{ENV_PREFIX}CLUSTER": "from-env"})
    assert s.cluster == "from-env"
    s = co(["--config", str(cfg), "--cluster", "from-flag"])
    assert s.cluster == "from-flag"


def test_yaml_file_and_config_from_env(tmp_path: Path) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text("role: spare\nlabels:\n  rack: r7\nheartbeat-interval-s: 0.25\n")
    s = load(AgentSettings, [], {f"{AGENT_ENV}CONFIG": str(cfg)}, prog="ftd-agent", env_prefix=AGENT_ENV)
    assert (s.role, s.labels, s.heartbeat_interval_s) == ("spare", {"rack": "r7"}, 0.25)


def test_env_and_flag_that_disagree_are_an_error_naming_the_field() -> None:
    with pytest.raises(SettingsError) as err:
        co(["--dead-after-s", "2.5"], {f"{ENV_PREFIX}DEAD_AFTER_S": "3.0"})
    assert err.value.field == "dead_after_s"
    assert "FTD_COORDINATOR_DEAD_AFTER_S" in str(err.value) and "--dead-after-s" in str(err.value)
    # Equal values are not a conflict.
    assert co(["--dead-after-s", "2.5"], {f"{ENV_PREFIX}DEAD_AFTER_S": "2.50"}).dead_after_s == 2.5


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--dead-after-s", "-1"], "dead_after_s"),
        (["--dead-after-s", "soon"], "dead_after_s"),
        (["--suspect-after-s", "3", "--dead-after-s", "2.5"], "dead_after_s"),
        (["--listen", "nowhere"], "listen"),
        (["--etcd-endpoints", "127.0.0.1"], "etcd_endpoints"),
        (["--leader-ttl-s", "1"], "leader_ttl_s"),
        (["--leader-ttl-s", "2.5"], "leader_ttl_s"),
        (["--log-level", "LOUD"], "log_level"),
        (["--cluster", "a/b"], "cluster"),
        (["--quiet-answer-interval-s", "0.5"], "quiet_answer_interval_s"),  # below heartbeat_ack_interval_s
        (["--quiet-answer-interval-s", "61"], "quiet_answer_interval_s"),
    ],
)
def test_bad_values_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(SettingsError) as err:
        co(argv)
    assert err.value.field == field


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("dead_after = 3\n")
    with pytest.raises(SettingsError) as err:
        co(["--config", str(cfg)])
    assert err.value.field == "dead_after"


def test_unparseable_file_is_a_named_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("dead_after_s = = 3\n")
    with pytest.raises(SettingsError) as err:
        co(["--config", str(cfg)])
    assert err.value.field == "config" and str(cfg) in str(err.value)


def test_agent_validation() -> None:
    def agent(argv: list[str]) -> AgentSettings:
        return load(AgentSettings, argv, {}, prog="ftd-agent", env_prefix=AGENT_ENV)

    with pytest.raises(SettingsError, match="role"):
        agent(["--role", "boss"])
    with pytest.raises(SettingsError, match="node_id"):
        agent(["--node-id", "../etc"])
    with pytest.raises(SettingsError, match="labels"):
        agent(["--labels", "rack"])
    with pytest.raises(SettingsError, match="landing_reserve_mb"):
        agent(["--landing-reserve-mb", "-2"])
    assert agent([]).landing_reserve_mb == -1 and agent(["--landing-reserve-mb", "512"]).landing_reserve_mb == 512
    s = agent(["--labels", "rack=r1,zone=z", "--node-id", "n-1"])
    assert s.labels == {"rack": "r1", "zone": "z"} and s.effective_node_id == "n-1"


def test_load_or_exit_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_or_exit(CoordinatorSettings, ["--tick-s", "0"], {}, prog="ftd-coordinator", env_prefix=ENV_PREFIX)
    assert exc.value.code == 2
    assert "bad setting tick_s" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["ftd.coordinator.main", "ftd.agent.main"])
def test_daemons_exit_2_on_bad_config(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--heartbeat-interval-s", "-5"]
                          if module.endswith("agent.main") else
                          [sys.executable, "-m", module, "--dead-after-s", "zero"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "bad setting" in proc.stderr


def test_every_field_is_documented_with_a_default() -> None:
    for cls, prefix in ((CoordinatorSettings, ENV_PREFIX), (AgentSettings, AGENT_ENV)):
        for row in describe(cls, prefix):
            assert row["help"], row["name"]
            assert row["env"] == prefix + row["name"].upper()
