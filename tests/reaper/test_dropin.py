"""deploy/systemd/gpuwatch-agent-reap.conf: one capability, CAP_KILL, and it loads."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "gpuwatch-agent.service"
DROPIN = ROOT / "deploy" / "systemd" / "gpuwatch-agent-reap.conf"


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_grants_cap_kill_and_nothing_else() -> None:
    d = _directives(DROPIN.read_text(encoding="utf-8"))
    assert d["CapabilityBoundingSet"] == ["CAP_KILL"]
    assert d["AmbientCapabilities"] == ["CAP_KILL"]
    assert "NoNewPrivileges" not in d  # the base unit's stays on
    assert set(d) <= {
        "CapabilityBoundingSet",
        "AmbientCapabilities",
        "Environment",
        "SystemCallFilter",
    }


def test_the_audit_log_setting_is_json_the_agent_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwatch.settings import AgentSettings, load

    (value,) = _directives(DROPIN.read_text(encoding="utf-8"))["Environment"]
    name, _, json_value = value.strip("'").partition("=")
    monkeypatch.setenv(name, json_value)
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    settings = load(AgentSettings)
    assert settings.reap.audit_log == Path("/var/lib/gpuwatch/reap-audit.jsonl")
    assert settings.reap.enabled is False  # the drop-in grants; the config file enables


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_loads_the_unit_with_the_dropin(tmp_path: Path) -> None:
    stub = tmp_path / "gpuwatch"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text(encoding="utf-8").replace("/usr/local/bin/gpuwatch", str(stub)))
    (tmp_path / f"{UNIT.name}.d").mkdir()
    shutil.copy(DROPIN, tmp_path / f"{UNIT.name}.d" / "reap.conf")
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0"}
    verify = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", str(unit)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify.stderr
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    if security.returncode != 0 and "offline" in security.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or later")
    # The drop-in was loaded: CAP_KILL is the one capability the analysis now flags.
    assert "✗ CapabilityBoundingSet=~CAP_KILL" in security.stdout
