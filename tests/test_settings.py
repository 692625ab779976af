"""Settings: defaults < TOML file < environment < command line, and clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.settings import AgentSettings, ServerSettings, load, parse_host_port


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(
        '[agent]\nlisten = "0.0.0.0:9500"\npoll_interval_seconds = 10\n\n'
        '[server]\ndatabase_url = "sqlite:////tmp/x.db"\n'
    )
    monkeypatch.setenv("GPUWATCH_CONFIG", str(path))
    for name in ("GPUWATCH_AGENT_LISTEN", "GPUWATCH_AGENT_POLL_INTERVAL_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_precedence_file_then_env_then_cli(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load(AgentSettings).listen == "0.0.0.0:9500"
    assert load(AgentSettings).poll_interval_seconds == 10
    monkeypatch.setenv("GPUWATCH_AGENT_LISTEN", "127.0.0.1:9600")
    assert load(AgentSettings).listen == "127.0.0.1:9600"
    assert load(AgentSettings, listen="127.0.0.1:9700").listen == "127.0.0.1:9700"
    # A None override (an option the user did not give) does not shadow the env.
    assert load(AgentSettings, listen=None).listen == "127.0.0.1:9600"
    assert load(ServerSettings).resolved_database_url() == "sqlite:////tmp/x.db"


def test_token_is_secret_in_reprs(monkeypatch: pytest.MonkeyPatch, config: Path) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_TOKEN", "s3cret-token")
    settings = load(AgentSettings)
    assert "s3cret-token" not in repr(settings) and "s3cret-token" not in str(settings)
    assert settings.token is not None and settings.token.get_secret_value() == "s3cret-token"


def test_invalid_values_are_one_line_config_errors(config: Path) -> None:
    with pytest.raises(ConfigError, match="poll_interval_seconds"):
        load(AgentSettings, poll_interval_seconds=-1)
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        load(AgentSettings, listen="nowhere")
    config.write_text("[agent]\nno_such_setting = 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(AgentSettings)
    config.write_text("[agent\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(AgentSettings)


def test_a_table_from_the_environment_is_json_merged_into_the_files(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config.write_text("[agent.reap]\ndry_run = true\nmax_per_host_per_hour = 3\n")
    monkeypatch.setenv("GPUWATCH_AGENT_REAP", '{"max_per_host_per_hour": 5}')
    reap = load(AgentSettings).reap
    assert (reap.dry_run, reap.max_per_host_per_hour) == (True, 5)
    monkeypatch.setenv("GPUWATCH_AGENT_REAP", "{not json")
    with pytest.raises(ConfigError, match="GPUWATCH_AGENT_REAP must be JSON"):
        load(AgentSettings)


def test_variable_names_are_read_in_any_case(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("gpuwatch_agent_poll_interval_seconds", "7.5")
    assert load(AgentSettings).poll_interval_seconds == 7.5


def test_only_load_reads_the_file_and_the_environment(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_POLL_INTERVAL_SECONDS", "7.5")
    assert AgentSettings().listen == "127.0.0.1:9402"
    assert AgentSettings().poll_interval_seconds == 5.0


def _gpuwatch(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuwatch ARGS`` in a child process with ``config`` as its only configuration."""
    env = {"GPUWATCH_CONFIG": str(config), "PATH": "/usr/bin:/bin"}
    env["XDG_RUNTIME_DIR"] = str(config.parent)
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_broken_config_file_from_the_cli_is_exit_3(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[agent]\npoll_interval_seconds = 'often'\n")
    result = _gpuwatch(bad, "status", "--fake-gpus", "workstation")
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "poll_interval_seconds" in result.stderr


def test_the_reap_policy_cannot_judge_idleness_on_fewer_than_five_polls(tmp_path: Path) -> None:
    short = tmp_path / "short.toml"
    short.write_text(
        '[agent]\npoll_interval_seconds = 5\nlisten = "127.0.0.1:0"\n\n'
        '[agent.reap]\nenabled = true\nidle = "1s"\naudit_log = "/dev/null"\n'
    )
    result = _gpuwatch(short, "agent", "--fake-gpus", "workstation")
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1
    assert "must span at least 5 poll intervals (25s at poll_interval_seconds = 5)" in result.stderr
    # 25 s is enough; and with the policy off the window is only gpuwatch reap's default.
    for enabled, idle in (("true", "25s"), ("false", "1s")):
        text = f"[agent]\npoll_interval_seconds = 5\n[agent.reap]\nenabled = {enabled}\nidle = '{idle}'\n"
        short.write_text(text)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("GPUWATCH_CONFIG", str(short))
            assert load(AgentSettings).reap.idle_seconds in (25.0, 1.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9402", ("127.0.0.1", 9402)),
        ("[::1]:80", ("::1", 80)),
        (":9402", ("0.0.0.0", 9402)),
    ],
)
def test_parse_host_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["9402", "host:", "host:99999", "host:abc"])
def test_parse_host_port_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(text)


def test_a_config_file_named_by_the_environment_must_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", str(tmp_path / "typo.toml"))
    with pytest.raises(ConfigError, match=r"typo\.toml.*does not exist"):
        load(AgentSettings)
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")  # none, on purpose
    assert load(AgentSettings).listen == AgentSettings().listen


def test_a_setting_outside_its_table_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text('listen = "0.0.0.0:9500"\n[agent]\npoll_interval_seconds = 10\n')
    monkeypatch.setenv("GPUWATCH_CONFIG", str(path))
    with pytest.raises(ConfigError, match=r"unknown top-level key 'listen'.*\[agent\]"):
        load(AgentSettings)
