"""deploy/prometheus: the scrape config and rules load, and the rules behave as promised."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
SEVERITIES = {"critical", "warning", "info"}

Rules = list[dict[str, Any]]
Names = Callable[[str], set[str]]


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR
    )


def test_promtool_accepts_the_scrape_config(promtool: str) -> None:
    # Also loads the rule files it names, so a broken path to the rules fails here.
    result = _run(promtool, "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = _run(promtool, "check", "rules", "gpuwatch.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass(promtool: str) -> None:
    """deploy/prometheus/tests/: the fill-up alert fires on a climb before the GPU is
    full and stays quiet on flat, step and saw-tooth usage; the other alerts fire
    when, and only when, they should."""
    tests = sorted(str(p.relative_to(PROMETHEUS_DIR)) for p in PROMETHEUS_DIR.glob("tests/*.yml"))
    assert tests, "no promtool unit tests found"
    result = _run(promtool, "test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_covered_by_a_unit_test(all_rules: Rules) -> None:
    tested = set()
    for path in PROMETHEUS_DIR.glob("tests/*.yml"):
        for case in _load(path)["tests"]:
            tested.update(t["alertname"] for t in case.get("alert_rule_test", []))
    untested = {r["alert"] for r in all_rules if "alert" in r} - tested
    # Alerts on Prometheus's own `up` are plain enough to go without.
    assert untested <= {"GpuwatchAgentsMissing", "GpuwatchServerDown"}, untested


def test_every_alert_has_a_severity_and_says_what_and_why(all_rules: Rules) -> None:
    for rule in all_rules:
        if "alert" not in rule:
            continue
        assert rule.get("labels", {}).get("severity") in SEVERITIES, rule["alert"]
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), rule["alert"]


def test_rules_use_only_metrics_gpuwatch_exposes(
    all_rules: Rules, metric_names: Names, known_series: frozenset[str]
) -> None:
    for rule in all_rules:
        names = metric_names(rule["expr"])
        assert names, f"found no metric in {rule['expr']!r}"
        unknown = names - known_series
        assert not unknown, f"{rule.get('alert') or rule.get('record')}: unknown {unknown}"


def test_recording_rule_names_follow_the_level_metric_operations_convention(
    all_rules: Rules,
) -> None:
    for rule in all_rules:
        if "record" in rule:
            parts = rule["record"].split(":")
            assert len(parts) in (2, 3) and parts[0] == "gpuwatch" and all(parts), rule["record"]


def test_recording_rules_come_before_the_alerts_that_read_them(
    rule_groups: Rules, metric_names: Names
) -> None:
    # Rules in a group run in order: an alert after its inputs sees this round's values.
    for group in rule_groups:
        seen: set[str] = set()
        recorded = {r["record"] for r in group["rules"] if "record" in r}
        for rule in group["rules"]:
            used = metric_names(rule["expr"]) & recorded
            assert used <= seen, f"{rule.get('alert') or rule['record']} reads {used - seen} early"
            if "record" in rule:
                seen.add(rule["record"])


@pytest.mark.parametrize("job", ["gpuwatch-agent", "gpuwatch-server"])
def test_the_job_names_the_rules_select_are_scraped(job: str, all_rules: Rules) -> None:
    config = _load(PROMETHEUS_DIR / "prometheus.yml")
    assert job in {c["job_name"] for c in config["scrape_configs"]}
    assert any(f'job="{job}"' in r["expr"] for r in all_rules)


def test_per_process_labels_never_collide_with_prometheus_job() -> None:
    """The Slurm job is exported as `slurm_job`: a `job` label would clash with the target's."""
    from gpuwatch.agent.collectors import process

    for spec in process.METRICS:
        assert "job" not in spec.labels and "instance" not in spec.labels
    assert "slurm_job" in process.MEMORY.labels


def test_metric_name_extraction_sees_metrics_and_nothing_else(metric_names: Names) -> None:
    # The catalogue checks above are only as good as this.
    expr = (
        'sum by (gpu, uuid) (rate(gpuwatch_agent_polls_total{result="failure"}[5m] offset 1m))'
        " / on (instance) group_left (name) up > 2^30 and 1e9 < gpuwatch:gpu_memory_used:ratio"
    )
    assert metric_names(expr) == {
        "gpuwatch_agent_polls_total",
        "up",
        "gpuwatch:gpu_memory_used:ratio",
    }
