"""The shipped Alertmanager config (deploy/alertmanager/alertmanager.yml): Alertmanager's
own amtool accepts it, and routes each kind of gpuwatch alert where its comments say."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"


@pytest.fixture(scope="module")
def amtool() -> str:
    path = shutil.which("amtool")
    if path is None:
        pytest.skip(
            "amtool missing (Debian package prometheus-alertmanager; ./dev setup installs it)"
        )
    return path


def _route(amtool: str, **labels: str) -> str:
    done = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={CONFIG}"]
        + [f"{name}={value}" for name, value in labels.items()],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_amtool_accepts_the_config(amtool: str) -> None:
    done = subprocess.run(
        [amtool, "check-config", str(CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("alert", "severity", "receiver"),
    [
        ("GpuLost", "critical", "gpu-oncall"),  # hardware: drain the node
        ("GpuEccUncorrectableErrors", "critical", "gpu-oncall"),
        ("GpuMemoryFullSoon", "warning", "gpu-users"),  # the people sharing the GPU
        ("GpuFillingUp", "warning", "gpu-users"),
        ("GpuwatchAgentDown", "warning", "gpuwatch-admins"),  # the monitoring itself
        ("GpuwatchAgentDroppingEvents", "warning", "gpuwatch-admins"),
    ],
)
def test_each_kind_of_alert_reaches_its_receiver(
    amtool: str, alert: str, severity: str, receiver: str, all_rules: list[dict[str, Any]]
) -> None:
    shipped = {r["alert"]: r["labels"]["severity"] for r in all_rules if "alert" in r}
    assert shipped[alert] == severity  # the rule still says so
    assert _route(amtool, alertname=alert, severity=severity) == receiver


def test_every_alert_named_in_the_config_is_a_shipped_alert(
    all_rules: list[dict[str, Any]],
) -> None:
    shipped = {r["alert"] for r in all_rules if "alert" in r}
    config = yaml.safe_load(CONFIG.read_text())
    matchers = [
        m
        for rule in config["inhibit_rules"]
        for key in ("source_matchers", "target_matchers")
        for m in rule[key]
    ]
    matchers += [m for route in config["route"]["routes"] for m in route["matchers"]]
    for matcher in matchers:
        name, op, value = re.fullmatch(r'(\w+)(=~|!=|=)"(.*)"', matcher).groups()  # type: ignore[union-attr]
        if name != "alertname":
            continue
        pattern = re.compile(value if op == "=~" else re.escape(value))
        assert any(pattern.fullmatch(alert) for alert in shipped), matcher
