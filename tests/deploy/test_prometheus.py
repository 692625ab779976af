"""deploy/prometheus: the scrape config and rules load, and the rules behave as promised."""

from __future__ import annotations

import importlib
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.snapshots import sample_snapshot

from gpuwatch.agent.collectors import health
from gpuwatch.agent.collectors.agent import AgentCollector, PushStats
from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.collectors.registry import build_registry as build_agent_registry
from gpuwatch.agent.state import AgentState
from gpuwatch.metricspec import MetricSpec
from gpuwatch.server.auth.service import create_token
from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.metrics import METRICS as SERVER_METRICS
from gpuwatch.server.metrics import ServerStats
from gpuwatch.server.metrics import build_registry as build_server_registry
from gpuwatch.settings import ServerSettings

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
UNIT_TEST_FILES = sorted(PROMETHEUS_DIR.glob("tests/*.yml"))
SEVERITIES = {"critical", "warning", "info"}
AGENT_COLLECTORS = ("gpu", "process", "agent", "registry", "dcgm")
# Counters the agent reads from NVML (ECC errors, Xid events, energy, PCIe replays): it
# exports them from its first poll at what NVML reports, 0 on a healthy board.
NVML_COUNTERS = frozenset(s.exposed_name for s in health.METRICS if s.kind == "counter")

Rules = list[dict[str, Any]]
Names = Callable[[str], set[str]]


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _specs() -> dict[str, tuple[MetricSpec, str]]:
    """Every family the agent and the server declare, by exposed name, with its job."""
    specs: dict[str, tuple[MetricSpec, str]] = {}
    for module_name in AGENT_COLLECTORS:
        module = importlib.import_module(f"gpuwatch.agent.collectors.{module_name}")
        specs.update((spec.exposed_name, (spec, "gpuwatch-agent")) for spec in module.METRICS)
    specs.update((spec.exposed_name, (spec, "gpuwatch-server")) for spec in SERVER_METRICS)
    return specs


_SERIES = re.compile(r"^([A-Za-z_:][\w:]*)\{(.*)\}$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_FIRST_VALUE = re.compile(r"^\s*(_|[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)")


def _parse_series(series: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(series.strip())
    assert match, f"cannot parse input series {series!r}"
    return match.group(1), dict(_LABEL.findall(match.group(2)))


def _first_value(values: str) -> float | None:
    """The first sample of a promtool `values` string; None when it starts missing (_)."""
    match = _FIRST_VALUE.match(str(values))
    assert match, f"cannot parse values {values!r}"
    return None if match.group(1) == "_" else float(match.group(1))


@dataclass(frozen=True)
class ExportedAtStart:
    """What a fresh agent and a fresh server (one host known, nothing pushed) export.

    ``counters``: the counter series already there, as (name, sorted labels without job
    and instance; the host is named "host"). ``values``: every label value seen, by
    (name, label name).
    """

    counters: frozenset[tuple[str, tuple[tuple[str, str], ...]]]
    values: dict[tuple[str, str], set[str]]


@pytest.fixture(scope="module")
def exported_at_start(tmp_path_factory: pytest.TempPathFactory) -> ExportedAtStart:
    # The agent's collectors before its first poll, with a server to push to.
    state = AgentState()
    agent = build_agent_registry(
        [
            GpuCollector(lambda: state.latest),
            ProcessCollector(lambda: state.latest, enabled=True, max_series=10),
            AgentCollector(state, push_stats=PushStats),
            DcgmCompatCollector(lambda: state.latest),
        ]
    )
    data_dir = tmp_path_factory.mktemp("server")
    url = f"sqlite:///{data_dir / 'gpuwatch.db'}"
    database = create_database(url)
    try:
        upgrade(database)
        with database.writer() as session, session.begin():
            create_token(session=session, hostname="host", now=1.8e9)
        server = build_server_registry(
            database=database,
            settings=ServerSettings(data_dir=data_dir, database_url=url, scheduler=False),
            stats=ServerStats(),
            clock=lambda: 1.8e9,
        )
        samples = [s for r in (agent, server) for f in r.collect() for s in f.samples]
    finally:
        database.dispose()
    counters = set()
    values: dict[tuple[str, str], set[str]] = {}
    for sample in samples:
        for label, value in sample.labels.items():
            values.setdefault((sample.name, label), set()).add(value)
        if sample.name.endswith("_total"):
            counters.add((sample.name, tuple(sorted(sample.labels.items()))))
    return ExportedAtStart(frozenset(counters), values)


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
    full and stays quiet on flat, step and saw-tooth usage; the other alerts, the
    server's fleet alerts included, fire when, and only when, they should."""
    tests = [str(p.relative_to(PROMETHEUS_DIR)) for p in UNIT_TEST_FILES]
    assert tests, "no promtool unit tests found"
    result = _run(promtool, "test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr
    # promtool reports each file; make sure none was skipped.
    assert result.stdout.count("SUCCESS") == len(tests), result.stdout


def _unit_tests() -> list[dict[str, Any]]:
    return [case for path in UNIT_TEST_FILES for case in _load(path)["tests"]]


def test_every_unit_test_file_loads_the_shipped_rules() -> None:
    assert UNIT_TEST_FILES, "no promtool unit tests found"
    for path in UNIT_TEST_FILES:
        assert _load(path)["rule_files"] == ["../gpuwatch.rules.yml"], path.name


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_quiet(
    all_rules: Rules,
) -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in _unit_tests():
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {r["alert"] for r in all_rules if "alert" in r}
    assert not alerts - fires, f"no unit test where these fire: {sorted(alerts - fires)}"
    assert not alerts - quiet, f"no unit test where these stay quiet: {sorted(alerts - quiet)}"
    assert not (fires | quiet) - alerts, f"tests of unknown alerts: {(fires | quiet) - alerts}"


def test_every_recording_rule_is_evaluated_by_a_unit_test(recorded_names: frozenset[str]) -> None:
    exprs = " ".join(t["expr"] for case in _unit_tests() for t in case.get("promql_expr_test", []))
    untested = {name for name in recorded_names if name not in exprs}
    assert not untested, f"no promql_expr_test reads {sorted(untested)}"


def test_unit_test_inputs_are_series_gpuwatch_really_exports(
    exported_at_start: ExportedAtStart,
) -> None:
    """Metric and label names as the code declares them, the job that exports them,
    label values from the code's known sets, and a counter starting at 0 only where the
    code exports that series before anything happened (one born at its first increment
    never shows 0, and an alert tested on a 0 it never sees can stay silent in
    production: how GpuwatchAgentDroppingSnapshots once missed single bursts)."""
    specs = _specs()
    problems = [
        f"{case['name']!r}: {item['series']}: {problem}"
        for case in _unit_tests()
        for item in case.get("input_series", [])
        for problem in _input_problems(item, specs, exported_at_start)
    ]
    assert not problems, "\n".join(problems)


def _input_problems(
    item: dict[str, str], specs: dict[str, tuple[MetricSpec, str]], start: ExportedAtStart
) -> list[str]:
    name, labels = _parse_series(item["series"])
    if name == "up":
        return [] if set(labels) == {"job", "instance"} else ["up has only job and instance"]
    if name not in specs:
        return ["no such metric"]
    spec, job = specs[name]
    problems = []
    if labels.get("job") != job or "instance" not in labels:
        problems.append(f"needs job={job!r} and an instance")
    own = {k: v for k, v in labels.items() if k not in ("job", "instance")}
    if set(own) != set(spec.labels):
        problems.append(f"labels {sorted(own)}, the code's {list(spec.labels)}")
    # A label with values before anything happened has a fixed set of them; hosts
    # are the fleet's own.
    for label, value in own.items():
        known = start.values.get((name, label))
        if known and label != "host" and value not in known:
            problems.append(f"{label}={value!r} is not one of {sorted(known)}")
    if spec.kind == "counter" and _first_value(item["values"]) == 0 and name not in NVML_COUNTERS:
        as_at_start = tuple(sorted((k, "host" if k == "host" else v) for k, v in own.items()))
        if (name, as_at_start) not in start.counters:
            problems.append("starts at 0, but the code exports it from its first increment")
    return problems


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


def test_no_metric_has_a_label_prometheus_sets_on_the_target(
    metric_labels: dict[str, frozenset[str]],
) -> None:
    """A `job` or `instance` label of our own clashes with the target's: with the shipped
    prometheus.yml (honor_labels false) it arrives as `exported_job`, and `by (job)`
    lumps every value together. The audit found the server's scheduled jobs so; the
    Slurm job is exported as `slurm_job`."""
    from gpuwatch.agent.collectors import process

    clashing = {
        name: sorted(labels & {"job", "instance"})
        for name, labels in metric_labels.items()
        if labels & {"job", "instance"}
    }
    assert clashing == {}
    assert "slurm_job" in process.MEMORY.labels
    assert "scheduled_job" in metric_labels["gpuwatch_server_job_runs_total"]


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


def test_a_gpu_whose_nvml_call_hangs_raises_gpu_unreadable(
    promtool: str, tmp_path: Path, all_rules: list[dict[str, Any]]
) -> None:
    """What the agent exports for a GPU whose read timed out (gpuwatch.toml.example's
    nvml_timeout_seconds: the poll still succeeds, so GpuwatchAgentPollsFailing stays
    quiet) is what GpuUnreadable fires on, after its 5 minutes."""
    sample = sample_snapshot()
    # Hung since the agent started: NVML never told its UUID (the agent's stand-in name).
    hung = sample.gpus[0].model_copy(
        update={
            **{name: None for name in type(sample.gpus[0]).model_fields if name.endswith(
                ("_bytes", "_ratio", "_celsius", "_watts"))},
            "uuid": "GPU-unknown-0", "read_error": "timeout", "processes": [],
        }
    )  # fmt: skip
    snapshot = sample.model_copy(update={"gpus": [hung]})
    exported = [
        s
        for family in GpuCollector(lambda: snapshot).collect()
        for s in family.samples
        if s.name in ("gpuwatch_gpu_up", "gpuwatch_gpu_lost")
    ]
    assert {(s.name, s.value) for s in exported} == {
        ("gpuwatch_gpu_up", 0.0),
        ("gpuwatch_gpu_lost", 0.0),
    }
    target = {"job": "gpuwatch-agent", "instance": "gpu-node-01:9402"}
    series = [
        {
            "series": s.name
            + "{"
            + ",".join(f'{k}="{v}"' for k, v in {**target, **s.labels}.items())
            + "}",
            "values": f"{s.value:g}x10",
        }
        for s in exported
    ]
    labels = {"severity": "warning", **target, **exported[0].labels}
    rule = next(r for r in all_rules if r.get("alert") == "GpuUnreadable")
    annotations = {
        "summary": "GPU 0 on gpu-node-01:9402 cannot be read",
        "description": rule["annotations"]["description"],  # no template in it
    }
    case = {
        "rule_files": [str(PROMETHEUS_DIR / "gpuwatch.rules.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "GpuUnreadable", "exp_alerts": []},
                    {
                        "eval_time": "5m",
                        "alertname": "GpuUnreadable",
                        "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
                    },
                    {
                        "eval_time": "10m",
                        "alertname": "GpuwatchAgentPollsFailing",
                        "exp_alerts": [],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "hung.test.yml"
    path.write_text(yaml.safe_dump(case), encoding="utf-8")
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
