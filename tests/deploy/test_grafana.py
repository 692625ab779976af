"""grafana/: the dashboard and provisioning parse, and every query uses real metrics and
parses as PromQL, so a renamed metric or a typo breaks a test, not a panel."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gpuwatch-host.json"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest theirs


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation."""
    found = [
        (f"panel {p['title']!r}", t["expr"])
        for p in _panels(dashboard["panels"])
        for t in p.get("targets", [])
    ]
    found += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return found


def _variable_metrics(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(variable, series selector) of each label_values(...) variable query."""
    found = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            assert query.startswith("label_values(") and query.endswith(")"), query
            selector = query.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)[0]
            found.append((var["name"], selector))
    return found


def test_dashboard_identity_is_stable(dashboard: dict[str, Any]) -> None:
    # Links and bookmarks use the uid; provisioning refuses duplicates.
    assert dashboard["uid"] == "gpuwatch-host"
    assert dashboard["title"]
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def test_every_panel_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    """No hard-coded datasource uid: the dashboard works against any Prometheus."""
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in names
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel[
                "title"
            ]


def test_dashboard_shows_what_the_brief_promises(dashboard: dict[str, Any]) -> None:
    text = " ".join(expr for _, expr in _queries(dashboard))
    for metric in (
        "gpuwatch_gpu_memory_total_bytes",
        "gpuwatch_gpu_memory_free_bytes",
        "gpuwatch_gpu_memory_unattributed_bytes",
        "gpuwatch_gpu_memory_dead_process_bytes",
        "gpuwatch_gpu_memory_orphaned_bytes",
        "gpuwatch_gpu_utilization_ratio",
        "gpuwatch_gpu_temperature_celsius",
        "gpuwatch_gpu_power_watts",
        "gpuwatch_gpu_process_memory_used_bytes",
        "gpuwatch_agent_last_poll_timestamp_seconds",
        "gpuwatch_nvml_errors_total",
    ):
        assert metric in text, metric


def test_every_query_names_only_known_metrics(
    dashboard: dict[str, Any],
    metric_names: Callable[[str], set[str]],
    known_series: frozenset[str],
) -> None:
    for where, expr in _queries(dashboard) + _variable_metrics(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        assert names <= known_series, f"{where}: unknown {names - known_series}"


def test_every_query_parses_as_promql(
    dashboard: dict[str, Any],
    substitute_grafana_variables: Callable[[str], str],
    check_promql: Callable[[Iterable[tuple[str, str]]], None],
) -> None:
    queries = _queries(dashboard) + _variable_metrics(dashboard)
    check_promql((where, substitute_grafana_variables(expr)) for where, expr in queries)


def test_check_promql_rejects_a_broken_query(
    check_promql: Callable[[Iterable[tuple[str, str]]], None],
) -> None:
    # The parse check above must be able to fail.
    with pytest.raises(pytest.fail.Exception, match="promtool rejects"):
        check_promql([("broken", "sum(rate(gpuwatch_gpu_up[5m])")])


def test_rule_expressions_parse_on_their_own(
    all_rules: list[dict[str, Any]], check_promql: Callable[[Iterable[tuple[str, str]]], None]
) -> None:
    check_promql((r.get("alert") or r["record"], r["expr"]) for r in all_rules)


def test_provisioning_files_parse() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/gpuwatch.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
