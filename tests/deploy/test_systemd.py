"""deploy/systemd: the units verify, keep their hardening, and match the CLI and settings.

The hardening assertions are the point: each directive below is in the unit for a
reason given there, and an edit that drops or loosens one must fail here, not pass
review unnoticed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpuwatch.settings import AgentSettings, ServerSettings, environment_variables, load

SYSTEMD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
AGENT = SYSTEMD_DIR / "gpuwatch-agent.service"
SERVER = SYSTEMD_DIR / "gpuwatch-server.service"
EXEC = "/usr/local/bin/gpuwatch"

Unit = dict[str, dict[str, list[str]]]

# Directives both units must carry, with their exact values.
COMMON = {
    "Type": "exec",
    "Restart": "on-failure",
    "DynamicUser": "yes",
    "User": "gpuwatch",
    "StateDirectory": "gpuwatch",
    "StateDirectoryMode": "0750",
    "UMask": "0077",
    "NoNewPrivileges": "yes",
    "RestrictSUIDSGID": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RemoveIPC": "yes",
    "LockPersonality": "yes",
    "RestrictRealtime": "yes",
    "RestrictNamespaces": "yes",
    "DevicePolicy": "closed",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
}
AGENT_ONLY = {
    "EnvironmentFile": "-/etc/gpuwatch/agent.env",
    # The permissive values are deliberate (see the unit): stricter ones break attribution.
    "ProtectProc": "default",
    "ProcSubset": "all",
    "PrivateUsers": "no",
    "PrivateDevices": "no",
}
SERVER_ONLY = {
    "EnvironmentFile": "-/etc/gpuwatch/server.env",
    "ProtectProc": "invisible",
    "ProcSubset": "pid",
    "PrivateUsers": "yes",
    "PrivateDevices": "yes",
    "MemoryDenyWriteExecute": "yes",
}
# `systemd-analyze security` exposure, 0 (locked down) to 10. Measured 1.7 and 1.1 with
# systemd 252; the margin absorbs scoring changes between versions, not loosening.
EXPOSURE_LIMIT = {AGENT: 2.0, SERVER: 1.5}


def parse_unit(path: Path) -> Unit:
    """Sections -> key -> every assignment, in order (systemd allows repeats)."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        # Continuations would make the simple parse below lie about values.
        assert not line.endswith("\\"), f"{path.name}:{number}: line continuation"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{number}: {line!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def effective(unit: Unit, key: str) -> list[str]:
    """A list setting's assignments after the last empty one (which resets the list)."""
    values = unit["Service"].get(key, [])
    if "" in values:
        values = values[len(values) - values[::-1].index("") :]
    return values


def single(unit: Unit, key: str) -> str:
    values = unit["Service"].get(key)
    assert values is not None, f"{key}= missing"
    assert len(values) == 1, f"{key}= set {len(values)} times: {values}"
    return values[0]


@pytest.fixture(scope="module", params=[AGENT, SERVER], ids=["agent", "server"])
def unit_path(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.mark.parametrize(
    ("path", "expected"),
    [(AGENT, {**COMMON, **AGENT_ONLY}), (SERVER, {**COMMON, **SERVER_ONLY})],
    ids=["agent", "server"],
)
def test_hardening_directives_are_present_with_their_values(
    path: Path, expected: dict[str, str]
) -> None:
    unit = parse_unit(path)
    wrong = {
        k: unit["Service"].get(k) for k, v in expected.items() if unit["Service"].get(k) != [v]
    }
    assert not wrong, f"{path.name}: expected {[f'{k}={expected[k]}' for k in wrong]}, got {wrong}"


def test_no_capabilities_at_all(unit_path: Path) -> None:
    unit = parse_unit(unit_path)
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        assert unit["Service"].get(key), f"{key}= must be set (to empty), not left to default"
        assert effective(unit, key) == [], f"{key}= grants {effective(unit, key)}"


def test_system_calls_are_an_allow_list_minus_privileged_ones(unit_path: Path) -> None:
    filters = effective(parse_unit(unit_path), "SystemCallFilter")
    # The first assignment decides allow-list semantics: it must not start with "~".
    assert filters[0] == "@system-service"
    denied = {group for f in filters[1:] for group in f.removeprefix("~").split()}
    assert all(f.startswith("~") for f in filters[1:]) and "@privileged" in denied


def test_only_unix_and_ip_sockets(unit_path: Path) -> None:
    families = " ".join(effective(parse_unit(unit_path), "RestrictAddressFamilies")).split()
    assert sorted(families) == ["AF_INET", "AF_INET6", "AF_UNIX"]


def test_memory_and_tasks_are_bounded(unit_path: Path) -> None:
    unit = parse_unit(unit_path)
    for key in ("MemoryHigh", "MemoryMax"):
        assert re.fullmatch(r"\d+[MG]", single(unit, key)), key
    size = {"M": 1, "G": 1024}
    high, limit = (
        int(single(unit, k)[:-1]) * size[single(unit, k)[-1]] for k in ("MemoryHigh", "MemoryMax")
    )
    assert high < limit, "MemoryHigh must throttle before MemoryMax kills"
    assert single(unit, "TasksMax").isdigit()


def test_agent_may_open_only_the_nvidia_devices_nvml_uses() -> None:
    allowed = set(effective(parse_unit(AGENT), "DeviceAllow"))
    # Both names of major 195 (proprietary / open kernel modules), MIG caps read-only.
    assert allowed == {"char-nvidia-frontend rw", "char-nvidia rw", "char-nvidia-caps r"}


def test_server_has_no_device_access() -> None:
    assert "DeviceAllow" not in parse_unit(SERVER)["Service"]


def test_units_carry_no_secrets(unit_path: Path) -> None:
    """Secrets come from EnvironmentFile=, which only root can read; never from Environment=."""
    for value in parse_unit(unit_path)["Service"].get("Environment", []):
        name = value.split("=", 1)[0].upper()
        assert not any(s in name for s in ("TOKEN", "PASSWORD", "DATABASE_URL", "SECRET")), value


def test_state_paths_point_into_the_state_directory() -> None:
    # A dynamic user's $HOME is "/", so the non-root defaults (under $HOME) are unusable.
    assert parse_unit(AGENT)["Service"]["Environment"] == [
        "GPUWATCH_AGENT_SPOOL_DIR=%S/gpuwatch/spool"
    ]
    assert parse_unit(SERVER)["Service"]["Environment"] == ["GPUWATCH_SERVER_DATA_DIR=%S/gpuwatch"]


@pytest.mark.parametrize(("path", "command"), [(AGENT, "agent"), (SERVER, "server")])
def test_execstart_runs_an_existing_gpuwatch_command(path: Path, command: str) -> None:
    assert single(parse_unit(path), "ExecStart").split() == [EXEC, command]
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if command == "server" and "No such command" in result.stderr:
        pytest.skip("`gpuwatch server` is not registered in the CLI yet")
    assert result.returncode == 0, result.stderr


def test_units_install_into_multi_user_target(unit_path: Path) -> None:
    assert parse_unit(unit_path)["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.fixture
def units_with_stub_binary(tmp_path: Path) -> list[Path]:
    """The units, with ExecStart pointing at an executable that exists on this machine
    (systemd-analyze verify rejects a missing binary; gpuwatch need not be installed)."""
    stub = tmp_path / "gpuwatch"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    copies = []
    for path in (AGENT, SERVER):
        copy = tmp_path / path.name
        copy.write_text(path.read_text(encoding="utf-8").replace(EXEC, str(stub)))
        copies.append(copy)
    return copies


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify_accepts_the_units_without_warnings(
    units_with_stub_binary: list[Path],
) -> None:
    # It exits 0 on unknown keys and bad values, so its output must be empty too.
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            "--generators=no",
            *map(str, units_with_stub_binary),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_exposure_score_stays_low(units_with_stub_binary: list[Path]) -> None:
    for copy, original in zip(units_with_stub_binary, (AGENT, SERVER), strict=True):
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(copy)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if "--offline" in result.stderr and result.returncode != 0:
            pytest.skip("systemd-analyze security --offline needs systemd 250 or later")
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
        assert match, result.stdout + result.stderr
        score = float(match.group(1))
        assert score <= EXPOSURE_LIMIT[original], f"{original.name}: exposure {score}"


def test_toml_example_loads_through_the_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example is read exactly as /etc/gpuwatch/gpuwatch.toml would be."""
    example = SYSTEMD_DIR / "gpuwatch.toml.example"
    for name in os.environ:
        if name.startswith(("GPUWATCH_AGENT_", "GPUWATCH_SERVER_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUWATCH_CONFIG", str(example))
    doc = tomllib.loads(example.read_text(encoding="utf-8"))
    assert set(doc) == {"agent", "server"}
    agent, server = load(AgentSettings), load(ServerSettings)
    for section, settings in (("agent", agent), ("server", server)):
        for key, value in doc[section].items():
            assert getattr(settings, key) == value, f"[{section}] {key}"
    # No secret in a file the service user must be able to read.
    assert agent.token is None and server.read_token is None and server.database_url is None


@pytest.mark.parametrize(
    ("name", "prefix", "settings"),
    [
        ("agent.env.example", "GPUWATCH_AGENT_", AgentSettings),
        ("server.env.example", "GPUWATCH_SERVER_", ServerSettings),
    ],
)
def test_env_examples_name_real_settings(name: str, prefix: str, settings: type) -> None:
    text = (SYSTEMD_DIR / name).read_text(encoding="utf-8")
    # Active and commented-out assignments alike.
    keys = re.findall(r"^#?([A-Z][A-Z0-9_]*)=", text, flags=re.MULTILINE)
    assert keys
    for key in keys:
        assert key.startswith(prefix), key
        assert key in environment_variables(settings), key


def test_agent_env_example_names_every_secret_of_the_agent() -> None:
    """agent.env is the one root-only place for them; gpuwatch.toml is world-readable."""
    text = (SYSTEMD_DIR / "agent.env.example").read_text(encoding="utf-8")
    named = set(re.findall(r"^#?(GPUWATCH_AGENT_[A-Z0-9_]+)=", text, flags=re.MULTILINE))
    secrets = {
        variable
        for variable, setting in environment_variables(AgentSettings).items()
        if _is_secret(AgentSettings, setting)
    }
    assert secrets == {
        "GPUWATCH_AGENT_TOKEN",
        "GPUWATCH_AGENT_SNAPSHOT_TOKEN",
        "GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN",
    }
    assert secrets <= named, sorted(secrets - named)


def _is_secret(model: type[BaseModel], setting: str) -> bool:
    name, _, rest = setting.partition(".")
    by_key = {(f.alias or n): f for n, f in model.model_fields.items()}
    annotation = by_key[name].annotation
    if rest:
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
        return _is_secret(annotation, rest)
    return "SecretStr" in str(annotation)


def _unit_environment(*units: Path) -> dict[str, str]:
    """Environment= of ``units`` (a unit, then its drop-ins), as systemd assigns it."""
    found: dict[str, str] = {}
    for path in units:
        for value in parse_unit(path)["Service"].get("Environment", []):
            for assignment in shlex.split(value):
                key, _, val = assignment.partition("=")
                found[key] = val.replace("%S", "/var/lib")
    return found


def test_the_reap_drop_in_s_audit_log_survives_the_secret_read_token_in_agent_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """systemd lets EnvironmentFile= values replace Environment= ones. The reaper's read
    token (a secret: agent.env) once went in the same JSON variable as the drop-in's audit
    log, which it then replaced: the audit log fell back to the dynamic user's $HOME ("/",
    read-only) and the policy refused every stop. Both ways an admin may write it must
    leave the drop-in's audit log and set the token."""
    for name in os.environ:
        if name.startswith("GPUWATCH_AGENT_"):
            monkeypatch.delenv(name)
    config = tmp_path / "gpuwatch.toml"
    config.write_text("[agent.reap]\nenabled = true\n")
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    # The dynamic user: not root, $HOME is "/".
    monkeypatch.setattr(os, "geteuid", lambda: 61234)
    monkeypatch.setenv("HOME", "/")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    unit = _unit_environment(AGENT, SYSTEMD_DIR / "gpuwatch-agent-reap.conf")
    example = (SYSTEMD_DIR / "agent.env.example").read_text(encoding="utf-8")
    assert "#GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN=" in example
    for agent_env in (
        {"GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN": "read-secret"},
        {"GPUWATCH_AGENT_REAP": '{"server_read_token": "read-secret"}'},
    ):
        with monkeypatch.context() as env:
            for key, value in {**unit, **agent_env}.items():
                env.setenv(key, value)
            reap = load(AgentSettings).reap
        assert reap.audit_log == Path("/var/lib/gpuwatch/reap-audit.jsonl"), agent_env
        assert reap.server_read_token is not None, agent_env
        assert reap.server_read_token.get_secret_value() == "read-secret"


def test_server_env_example_sets_up_an_admin_token_apart_from_the_read_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read token goes to Prometheus, Grafana and every reaper: without an admin token
    it also creates silences. Filled in as the comments say, the example's tokens differ
    and its receivers (credentials, kept out of the world-readable TOML) load."""
    text = (SYSTEMD_DIR / "server.env.example").read_text(encoding="utf-8")
    for name in os.environ:
        if name.startswith("GPUWATCH_SERVER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    for key, value in re.findall(r"^#?(GPUWATCH_SERVER_[A-Z_]+)=(.*)$", text, flags=re.MULTILINE):
        # What a shell (`set -a; . server.env`) or systemd makes of the value; an empty
        # token is one to fill in.
        (parsed,) = shlex.split(value) or [f"{key.lower()}-filled-in"]
        monkeypatch.setenv(key, parsed)
    settings = load(ServerSettings)
    assert settings.read_token is not None and settings.admin_token is not None
    assert settings.read_token.get_secret_value() != settings.admin_token.get_secret_value()
    assert [r.name for r in settings.receivers] == ["oncall"]


def _comment_above(text: str, key: str) -> str:
    """The comment lines right above ``key = ...`` in a TOML example, joined."""
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(f"{key} ="))
    comment: list[str] = []
    for line in reversed(lines[:index]):
        if not line.startswith("#"):
            break
        comment.insert(0, line.lstrip("# "))
    return " ".join(comment)


def test_toml_example_says_what_a_hung_nvml_call_does(all_rules: list[dict[str, Any]]) -> None:
    """A GPU whose read hangs past nvml_timeout_seconds is reported timed out
    (gpuwatch_gpu_up 0, the GpuUnreadable alert); the poll still succeeds, so an operator
    told it "counts as a failure" would watch GpuwatchAgentPollsFailing, which never fires
    for it (tests/deploy/test_prometheus.py runs the exported series through the rules)."""
    text = (SYSTEMD_DIR / "gpuwatch.toml.example").read_text(encoding="utf-8")
    comment = _comment_above(text, "nvml_timeout_seconds")
    assert "gpuwatch_gpu_up 0" in comment and "GpuUnreadable" in comment, comment
    assert "failure" not in comment.replace("counts as a success", ""), comment
    alerts = {rule.get("alert") for rule in all_rules}
    for named in re.findall(r"\b(?:Gpu|Gpuwatch)[A-Z]\w+", text):
        assert named in alerts, f"gpuwatch.toml.example names no such alert: {named}"


_SYSTEMD_UNITS = {"s": 1, "min": 60, "h": 3600}


def _seconds(value: str) -> int:
    match = re.fullmatch(r"(\d+)(s|min|h)", value)
    assert match, f"unexpected time span {value!r}"
    return int(match.group(1)) * _SYSTEMD_UNITS[match.group(2)]


@pytest.mark.parametrize("path", [AGENT, SERVER], ids=["agent", "server"])
def test_restarts_outlast_a_driver_or_database_that_is_not_up_yet_and_say_how_long(
    path: Path,
) -> None:
    """A DKMS rebuild after a kernel update takes minutes: the agent exits 4 (no NVML) at
    each start until it is done. Five starts 5 s apart gave up after 30 s and left the
    unit failed for good. The restarts must span at least 15 minutes, still stop a crash
    loop within the rate-limit window, and the unit and docs/deploy.md must say how long."""
    unit = parse_unit(path)
    burst = int(unit["Unit"]["StartLimitBurst"][0])
    window = _seconds(unit["Unit"]["StartLimitIntervalSec"][0])
    # Each start takes about a second to fail (0.8 s measured for exit 4).
    span_minutes = burst * (_seconds(single(unit, "RestartSec")) + 1) / 60
    assert span_minutes >= 15, f"{path.name}: restarts span only {span_minutes:.1f} min"
    assert span_minutes * 60 < window, f"{path.name}: the rate limit would never stop a loop"
    doc = (SYSTEMD_DIR.parents[1] / "docs" / "deploy.md").read_text(encoding="utf-8")
    doc_rows = "\n".join(line for line in doc.splitlines() if "StartLimitBurst" in line)
    for where, text in (
        (path.name, path.read_text(encoding="utf-8")),
        ("docs/deploy.md", doc_rows),
    ):
        said = [int(n) for n in re.findall(r"about (\d+)\s+(?:#\s*)?minutes", text)]
        assert any(abs(n - span_minutes) <= 0.2 * span_minutes for n in said), (
            f"{where} does not say the restarts span about {span_minutes:.0f} minutes: {said}"
        )
