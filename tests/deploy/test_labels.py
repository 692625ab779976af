"""Label names in the rules and dashboards are labels the metrics really carry.

The other checks make sure every *metric* a query names exists. A label that does not
exist is just as silent: a matcher on it selects nothing (an alert that can never fire),
a ``by``/``on`` clause on it collapses or breaks a join, and ``{{ $labels.x }}`` or a
legend ``{{x}}`` renders empty. Here every label a query or template names must be one
the code declares for a metric of that query (docs/metrics.md is generated from the
same declarations), or one Prometheus adds to every target (``job``, ``instance``).

Checked: alert and recording rule expressions, the queries the alert annotations run
(``query`` template function), ``$labels.x`` and ``$p.Labels.x`` in annotations, every
dashboard panel query, legend, annotation query and variable, and NVIDIA's
dcgm-exporter dashboard (``fixtures/``) against the ``--dcgm-compat`` labels.

Also here: the server's ``gpuwatch_fleet_*`` series, which every replica exports alike,
are read once (``max by``) by every rule and dashboard query.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.promql import GROUPING, STRING

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
NVIDIA_DASHBOARD = Path(__file__).parent / "fixtures" / "dcgm-exporter-dashboard.json"
# What Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
# Prometheus's own series. ALERTS carries each alert's labels: anything goes.
OWN_SERIES: dict[str, frozenset[str] | None] = {"up": TARGET_LABELS, "ALERTS": None}

_SELECTOR = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(rf"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*(?:{STRING})")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)$")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
# label_replace(v, "dst", "replacement", "src", "regex"): the label it writes, "dst".
_REPLACED = re.compile(r'"(\w+)"\s*,\s*"[^"]*"\s*,\s*"\w*"\s*,\s*"[^"]*"\s*\)')
# `{{ range $i, $p := printf `query` ... | query }}` ... `$p.Labels.pid`
_RANGE_QUERY = re.compile(r"range\s+\$\w+\s*,\s*\$(\w+)\s*:=\s*printf\s+`([^`]*)`")
_PRINTF_QUERY = re.compile(r"printf\s+`([^`]*)`")

Names = Callable[[str], set[str]]
Labels = dict[str, frozenset[str] | None]


@pytest.fixture(scope="module")
def labels_of(
    metric_labels: dict[str, frozenset[str]], all_rules: list[dict[str, Any]], metric_names: Names
) -> Labels:
    """Metric or recorded series -> the labels it can carry (None: any)."""
    known: Labels = {
        name: labels | TARGET_LABELS for name, labels in metric_labels.items()
    } | OWN_SERIES
    # A recording rule keeps its inputs' labels (at most); rules run in file order.
    for rule in all_rules:
        if "record" in rule:
            known[rule["record"]] = _union(known, metric_names(rule["expr"])) or frozenset()
    return known


def _union(known: Labels, names: Iterable[str]) -> frozenset[str] | None:
    out: set[str] = set(TARGET_LABELS)
    for name in names:
        labels = known.get(name, frozenset())
        if labels is None:
            return None
        out |= labels
    return frozenset(out)


def _problems(expr: str, known: Labels, metric_names: Names) -> Iterator[str]:
    """Label names in ``expr`` that none of its metrics carries."""
    for metric, body in _SELECTOR.findall(expr):
        allowed = known.get(metric, frozenset())
        if allowed is None:
            continue
        for label in _MATCHER.findall(body):
            if label != "__name__" and label not in allowed:
                yield f"{metric}{{{label}=...}}: {metric} has no label {label!r}"
    allowed_any = _union(known, metric_names(expr))
    if allowed_any is None:
        return
    for clause in GROUPING.findall(expr):
        for label in (part.strip() for part in clause.split(",")):
            if label and label not in allowed_any:
                yield f"grouping by {label!r}: no metric of the query has it"


def _check(where: str, expr: str, known: Labels, metric_names: Names) -> list[str]:
    return [
        f"{where}: {problem}\n    {expr.strip()}"
        for problem in _problems(expr, known, metric_names)
    ]


def _annotation_queries(text: str) -> Iterator[str]:
    # %q is where the template puts a quoted label value.
    for query in _PRINTF_QUERY.findall(text):
        yield query.replace("%q", '"x"')


# -- rules ---------------------------------------------------------------------------


def test_rule_expressions_name_only_labels_their_metrics_carry(
    all_rules: list[dict[str, Any]], labels_of: Labels, metric_names: Names
) -> None:
    problems = [
        p
        for rule in all_rules
        for p in _check(rule.get("alert") or rule["record"], rule["expr"], labels_of, metric_names)
    ]
    assert not problems, "\n".join(problems)


def test_annotation_queries_name_known_metrics_and_labels(
    all_rules: list[dict[str, Any]],
    labels_of: Labels,
    metric_names: Names,
    known_series: frozenset[str],
) -> None:
    """The `query` calls that name the culprit run at evaluation time; promtool's unit
    tests only see them render what their input series happen to hold."""
    problems = []
    for rule in (r for r in all_rules if "alert" in r):
        for key, text in rule.get("annotations", {}).items():
            for query in _annotation_queries(text):
                names = metric_names(query)
                if not names:  # a number format such as `%.0f`
                    continue
                where = f"{rule['alert']} {key}"
                if names - known_series:
                    problems.append(f"{where}: unknown {sorted(names - known_series)}")
                problems += _check(where, query, labels_of, metric_names)
    assert not problems, "\n".join(problems)


def test_annotation_templates_use_labels_the_series_carry(
    all_rules: list[dict[str, Any]], labels_of: Labels, metric_names: Names
) -> None:
    problems = []
    for rule in (r for r in all_rules if "alert" in r):
        alert_labels = _union(labels_of, metric_names(rule["expr"]))
        assert alert_labels is not None
        for key, text in rule.get("annotations", {}).items():
            for label in re.findall(r"\$labels\.(\w+)", text):
                if label not in alert_labels:
                    problems.append(f"{rule['alert']} {key}: $labels.{label} is never set")
            for var, query in _RANGE_QUERY.findall(text):
                row_labels = _union(labels_of, metric_names(query.replace("%q", '"x"')))
                assert row_labels is not None
                for label in re.findall(rf"\${var}\.Labels\.(\w+)", text):
                    if label not in row_labels:
                        problems.append(
                            f"{rule['alert']} {key}: ${var}.Labels.{label} is never set"
                        )
    assert not problems, "\n".join(problems)


# -- dashboards ----------------------------------------------------------------------


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard_problems(
    dashboard: dict[str, Any], known: Labels, metric_names: Names, substitute: Callable[[str], str]
) -> list[str]:
    problems = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if not target.get("expr"):
                continue
            expr = substitute(target["expr"])
            where = f"panel {panel.get('title')!r}"
            problems += _check(where, expr, known, metric_names)
            allowed = _union(known, metric_names(expr))
            if allowed is not None and "label_replace" in expr:
                allowed |= frozenset(_REPLACED.findall(expr))
            for label in _LEGEND.findall(target.get("legendFormat") or ""):
                if allowed is not None and label not in allowed:
                    problems.append(
                        f"{where}: legend {{{{{label}}}}}: no metric of the query has it"
                    )
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            where = f"annotation {annotation.get('name')!r}"
            problems += _check(where, substitute(annotation["expr"]), known, metric_names)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = _LABEL_VALUES.match(str(query).strip())
        if not match:
            continue
        selector = substitute(match["selector"])
        where = f"variable {var['name']!r}"
        problems += _check(where, selector, known, metric_names)
        allowed = _union(known, metric_names(selector))
        if allowed is not None and match["label"] not in allowed:
            problems.append(f"{where}: label_values(..., {match['label']}): no such label")
    return problems


@pytest.mark.parametrize(
    "path", [*DASHBOARDS, NVIDIA_DASHBOARD], ids=[*(p.stem for p in DASHBOARDS), "nvidia-dcgm"]
)
def test_dashboard_queries_name_only_labels_their_metrics_carry(
    path: Path, labels_of: Labels, metric_names: Names, substitute_grafana_variables: Any
) -> None:
    """NVIDIA's dashboard included: its labels (``Hostname``, ``gpu``, ...) are the
    dcgm-exporter labels gpuwatch's --dcgm-compat series must carry."""
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    problems = _dashboard_problems(dashboard, labels_of, metric_names, substitute_grafana_variables)
    assert not problems, "\n".join(problems)


# -- the server's fleet series ---------------------------------------------------------

# Every server replica exports the same gpuwatch_fleet_* figures from the shared
# database, each under its own `instance`: read raw or summed, a fleet of two replicas
# shows every open event twice. `max by (...)` (the rules' way) counts each once.
_FLEET = re.compile(r"gpuwatch_fleet_\w+")
# A range function inside (last_over_time, to ride out a missed scrape) is fine.
_ONCE = re.compile(r"max\s+by\s*\([\w\s,]*\)\s*\(\s*(?:\w+_over_time\(\s*)?$")


def _fleet_reads_not_deduplicated(expr: str) -> list[str]:
    return [m.group(0) for m in _FLEET.finditer(expr) if not _ONCE.search(expr[: m.start()])]


def test_fleet_series_are_counted_once_across_server_replicas(
    all_rules: list[dict[str, Any]],
) -> None:
    queries = [(rule.get("alert") or rule["record"], rule["expr"]) for rule in all_rules]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        queries += [
            (f"{path.stem}: {panel.get('title')!r}", target["expr"])
            for panel in _panels(dashboard["panels"])
            for target in panel.get("targets", [])
            if target.get("expr")
        ]
    problems = [
        f"{where}: {names} not under max by (...): {expr}"
        for where, expr in queries
        if (names := _fleet_reads_not_deduplicated(expr))
    ]
    assert not problems, "\n".join(problems)


# -- the checker itself --------------------------------------------------------------


def test_the_label_check_can_fail(labels_of: Labels, metric_names: Names) -> None:
    """The checks above are only as good as this."""
    assert not list(
        _problems(
            'max by (job, instance, gpu, uuid) (gpuwatch_gpu_throttle_reasons{reason="x"})'
            " and on (instance) up",
            labels_of,
            metric_names,
        )
    )
    bad = list(
        _problems(
            'sum by (host) (gpuwatch_gpu_memory_used_bytes{hostname="a", gpu="0"})',
            labels_of,
            metric_names,
        )
    )
    assert len(bad) == 2 and "'hostname'" in bad[0] and "'host'" in bad[1], bad
    assert list(_annotation_queries("{{ with printf `gpuwatch_gpu_up{uuid=%q}` $x | query }}")) == [
        'gpuwatch_gpu_up{uuid="x"}'
    ]
    assert _fleet_reads_not_deduplicated("sum(gpuwatch_fleet_agent_silent)") == [
        "gpuwatch_fleet_agent_silent"
    ]
    assert not _fleet_reads_not_deduplicated("sum(max by (host) (gpuwatch_fleet_agent_silent))")
