"""A ``GPUWATCH_AGENT_*`` / ``GPUWATCH_AGENT_REAP_*`` / ``GPUWATCH_SERVER_*`` variable that
names no setting is refused at start (exit 3, one line, "did you mean"), as an unknown
key of the config file is; names set on purpose by deployments are not.

Before: a misspelt secret (``GPUWATCH_SERVER_READTOKEN``) was ignored, and the server
started with its reads open."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.settings import AgentSettings, ServerSettings, environment_variables, load
from gpuwatch.settings_env import NOT_SETTINGS, refuse_unknown_variables, unknown_variables

ROOT = Path(__file__).resolve().parent.parent
AGENT = ("GPUWATCH_AGENT_", environment_variables(AgentSettings))
SERVER = ("GPUWATCH_SERVER_", environment_variables(ServerSettings))


@pytest.mark.parametrize(
    ("kind", "variable", "meant"),
    [
        (SERVER, "GPUWATCH_SERVER_READTOKEN", "GPUWATCH_SERVER_READ_TOKEN"),
        (SERVER, "GPUWATCH_SERVER_ADMINTOKEN", "GPUWATCH_SERVER_ADMIN_TOKEN"),
        (AGENT, "GPUWATCH_AGENT_POLL_INTERVAL", "GPUWATCH_AGENT_POLL_INTERVAL_SECONDS"),
        (AGENT, "GPUWATCH_AGENT_REAP_PROTECTED_USER", "GPUWATCH_AGENT_REAP_PROTECTED_USERS"),
        (AGENT, "gpuwatch_agent_tokn", "GPUWATCH_AGENT_TOKEN"),  # any case, as they are read
    ],
)
def test_a_misspelt_variable_is_refused_with_the_one_meant(
    kind: tuple[str, dict[str, str]], variable: str, meant: str
) -> None:
    prefix, known = kind
    with pytest.raises(ConfigError) as refused:
        refuse_unknown_variables(prefix, known, {variable: "x", "PATH": "/bin"})
    message = str(refused.value)
    assert f"unknown environment variable {variable}" in message
    assert f"did you mean {meant}?" in message and "\n" not in message
    assert refused.value.exit_code == 3


def test_a_variable_like_none_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as refused:
        refuse_unknown_variables(*AGENT, {"GPUWATCH_AGENT_BOGUS": "1"})
    assert "did you mean" not in str(refused.value)


@pytest.mark.parametrize(
    "variable",
    [
        "GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN",  # a key of a keyed table
        "GPUWATCH_AGENT_REAP_AUDIT_LOG",
        "GPUWATCH_AGENT_REAP",
        "GPUWATCH_AGENT_URL",  # gpuwatch.torch's, in training jobs
        "GPUWATCH_CONFIG",
        "GPUWATCH_FAKE_NVML_SCENARIO",
        # Kubernetes service links of a Service named gpuwatch-agent
        "GPUWATCH_AGENT_SERVICE_HOST",
        "GPUWATCH_AGENT_SERVICE_PORT",
        "GPUWATCH_AGENT_SERVICE_PORT_METRICS",
        "GPUWATCH_AGENT_PORT",
        "GPUWATCH_AGENT_PORT_9402_TCP",
        "GPUWATCH_AGENT_PORT_9402_TCP_ADDR",
    ],
)
def test_variables_set_on_purpose_are_not_refused(variable: str) -> None:
    assert unknown_variables(*AGENT, {variable: "x"}) == []


def test_the_reporter_url_variable_is_the_one_gpuwatch_torch_reads() -> None:
    from gpuwatch.torch import AGENT_URL_ENV

    assert AGENT_URL_ENV in NOT_SETTINGS


def test_every_variable_the_deployments_and_docs_name_is_accepted() -> None:
    # deploy/ (systemd, Kubernetes, Docker), docker-compose.yml and the docs set or show
    # these: none may stop a deployment that follows them.
    files = [ROOT / "docker-compose.yml", ROOT / "README.md"]
    files += [p for p in (ROOT / "deploy").rglob("*") if p.is_file()]
    files += list((ROOT / "docs").glob("*.md"))
    named = set()
    for path in files:
        named |= set(re.findall(r"GPUWATCH_(?:AGENT|SERVER)_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert "GPUWATCH_SERVER_READ_TOKEN" in named and "GPUWATCH_AGENT_TOKEN" in named
    given = dict.fromkeys(named, "x")
    assert unknown_variables(*AGENT, given) == []
    assert unknown_variables(*SERVER, given) == []


def test_load_refuses_a_misspelt_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    monkeypatch.setenv("GPUWATCH_SERVER_READTOKEN", "s3cret")
    with pytest.raises(ConfigError, match="did you mean GPUWATCH_SERVER_READ_TOKEN"):
        load(ServerSettings)
    # The agent's settings do not answer for the server's variables.
    assert load(AgentSettings).listen


def test_load_refuses_an_unknown_reap_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    monkeypatch.setenv("GPUWATCH_AGENT_REAP_BOGUS", "1")
    with pytest.raises(ConfigError, match="GPUWATCH_AGENT_REAP_BOGUS"):
        load(AgentSettings)
