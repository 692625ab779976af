"""A key of ``[agent.reap]`` set by its own variable (GPUWATCH_AGENT_REAP_<KEY>)."""

from __future__ import annotations

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.settings import AgentSettings, ServerSettings, environment_variables, load


@pytest.fixture(autouse=True)
def _no_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")


def test_a_key_s_own_variable_wins_over_the_tables_json_and_keeps_its_other_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_REAP", '{"dry_run": true, "idle": "3h"}')
    monkeypatch.setenv("GPUWATCH_AGENT_REAP_IDLE", "4h")
    monkeypatch.setenv("GPUWATCH_AGENT_REAP_PROTECTED_USERS", '["alice"]')
    reap = load(AgentSettings).reap
    assert (reap.dry_run, reap.idle_seconds, reap.protected_users) == (True, 4 * 3600, ["alice"])


def test_a_list_key_s_variable_that_is_not_json_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUWATCH_AGENT_REAP_PROTECTED_USERS", "[alice")
    with pytest.raises(ConfigError, match="GPUWATCH_AGENT_REAP_PROTECTED_USERS must be JSON"):
        load(AgentSettings)


def test_variables_name_keys_as_the_file_writes_them_and_collide_with_no_setting() -> None:
    names = environment_variables(AgentSettings)
    assert names["GPUWATCH_AGENT_REAP_WARN_BEFORE"] == "reap.warn_before"
    assert names["GPUWATCH_AGENT_REAP"] == "reap"
    top_level = {n for n, s in names.items() if "." not in s}
    assert len(names) == len(top_level) + len(
        AgentSettings.model_fields["reap"].annotation.model_fields
    )  # type: ignore[union-attr]
    # The server has no keyed table: its variables are its settings, nothing more.
    assert set(environment_variables(ServerSettings).values()) == set(ServerSettings.model_fields)
