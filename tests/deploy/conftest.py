"""Fixtures for the deployment-file tests: the agent's metric catalogue, the rules, PromQL checks.

Fixtures rather than importable helpers: with ``--import-mode=importlib`` a test module
cannot import a sibling module, and ``conftest`` names the top-level one.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.promql import GROUPING, STRING

from gpuwatch.server.metrics import METRICS as SERVER_METRICS

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "gpuwatch.rules.yml"

# Series that Prometheus itself writes, which a dashboard or rule may use.
PROMETHEUS_OWN_SERIES = frozenset({"up", "ALERTS"})

_COLLECTOR_MODULES = ("gpu", "process", "agent", "registry", "dcgm")
_PROMQL_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"and", "or", "unless", "atan2", "inf", "nan"}
)
_STRING = re.compile(STRING)
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
# An identifier not followed by "(" (that would be a function). The lookarounds keep
# "m" in "5m" or "e9" in "1e9" from counting, and stop backtracking into "rat(e".
_IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_GRAFANA_INTERVAL = re.compile(r"\$\{?__(?:rate_interval|interval|range)\}?")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?")


def _metric_names(expr: str) -> set[str]:
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = GROUPING.sub("", text)
    return {m for m in _IDENTIFIER.findall(text) if m.lower() not in _PROMQL_KEYWORDS}


def _substitute_grafana_variables(expr: str) -> str:
    return _GRAFANA_VARIABLE.sub("x", _GRAFANA_INTERVAL.sub("5m", expr))


@pytest.fixture(scope="session")
def metric_names() -> Callable[[str], set[str]]:
    """Metric names a PromQL expression selects (not functions, labels or keywords)."""
    return _metric_names


@pytest.fixture(scope="session")
def substitute_grafana_variables() -> Callable[[str], str]:
    """Make a dashboard query plain PromQL: intervals become 5m, other variables "x"."""
    return _substitute_grafana_variables


@pytest.fixture(scope="session")
def rule_groups() -> list[dict[str, Any]]:
    return yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]


@pytest.fixture(scope="session")
def all_rules(rule_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in rule_groups for rule in group["rules"]]


@pytest.fixture(scope="session")
def metric_catalogue() -> frozenset[str]:
    """Every metric name the agent or the server can expose, from their own declarations."""
    names: set[str] = set()
    for module_name in _COLLECTOR_MODULES:
        module = importlib.import_module(f"gpuwatch.agent.collectors.{module_name}")
        names.update(spec.exposed_name for spec in module.METRICS)
    names.update(spec.exposed_name for spec in SERVER_METRICS)
    assert "gpuwatch_gpu_memory_used_bytes" in names, "catalogue looks wrong"
    return frozenset(names)


@pytest.fixture(scope="session")
def metric_labels() -> dict[str, frozenset[str]]:
    """Every metric the agent or the server can expose -> its own label names (as the
    code declares them; Prometheus adds ``job`` and ``instance``)."""
    labels: dict[str, frozenset[str]] = {}
    for module_name in _COLLECTOR_MODULES:
        module = importlib.import_module(f"gpuwatch.agent.collectors.{module_name}")
        labels.update((spec.exposed_name, frozenset(spec.labels)) for spec in module.METRICS)
    labels.update((spec.exposed_name, frozenset(spec.labels)) for spec in SERVER_METRICS)
    return labels


@pytest.fixture(scope="session")
def recorded_names(all_rules: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(rule["record"] for rule in all_rules if "record" in rule)


@pytest.fixture(scope="session")
def known_series(
    metric_catalogue: frozenset[str], recorded_names: frozenset[str]
) -> frozenset[str]:
    return metric_catalogue | recorded_names | PROMETHEUS_OWN_SERIES


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool missing (Debian package prometheus; ./dev setup installs it)")
    return path


@pytest.fixture
def check_promql(promtool: str, tmp_path: Path) -> Callable[[Iterable[tuple[str, str]]], None]:
    """Returns a checker: each (where, expr) must parse, as promtool parses rule expressions."""

    def check(exprs: Iterable[tuple[str, str]]) -> None:
        named = list(exprs)
        assert named, "no expressions to check"
        rules = [
            {"record": f"check:expr_{i}", "expr": expr, "labels": {"where": where}}
            for i, (where, expr) in enumerate(named)
        ]
        path = tmp_path / "exprs.rules.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
        result = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
        )
        if result.returncode != 0:
            # promtool names the failing rule by position; map it back to its origin.
            index = {f"check:expr_{i}": f"{where}: {expr}" for i, (where, expr) in enumerate(named)}
            pytest.fail(f"promtool rejects an expression:\n{result.stdout}{result.stderr}\n{index}")

    return check
