"""grafana/: the dashboards and provisioning, checked on paper and against a real Prometheus.

On paper: every dashboard parses, is templated by data source (no datasource uid written
in it), host and GPU, and every query names metrics gpuwatch exports and parses as PromQL.

For real: a central server, agents on simulated GPUs (``workstation``; ``a100-mig``
for MIG; a failing A100; Hopper boards, whole and in MIG mode, with GPM) with per-process and dcgm-compatible metrics on, and a real Prometheus (Debian's
``prometheus``) running ``deploy/prometheus/prometheus.yml`` changed only in its targets
and intervals. Each dashboard's variables are resolved by their own queries and
substituted as Grafana does with "All" selected; then every panel query goes through
Prometheus's HTTP API and must return data. NVIDIA's dcgm-exporter dashboard
(``fixtures/dcgm-exporter-dashboard.json``, unchanged) runs the same way; its queries may
come back empty only for fields docs/dcgm.md lists as absent, and its "Tensor Core
Utilization" panel returns the Hopper boards' GPM figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.processes import stop_processes

from gpuwatch.agent.collectors import dcgm

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
NVIDIA_DASHBOARD = Path(__file__).parent / "fixtures" / "dcgm-exporter-dashboard.json"
# The file as published in NVIDIA/dcgm-exporter (commit d5e5f51): the test uses it unchanged.
NVIDIA_SHA256 = "7c2172e582524efb70d9f585502366f7fec22b2464c3b89f75418ca648353e71"
DCGM_DOC = ROOT / "docs" / "dcgm.md"
GPUWATCH = [sys.executable, "-m", "gpuwatch"]
DEADLINE_SECONDS = 45.0
# Orphans, dead PIDs, an idle notebook and ECC off; a GPU in MIG mode next to a whole A100;
# and a GPU going bad within seconds, for the health alerts (written by the fixture).
SCENARIOS = ("workstation", "a100-mig", "failing", "hopper")
FAILING = """
[fake]
name = "failing"
lifetime = "10m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
fans = 0
ecc_uncorrected = { steps = [["0s", 0], ["5s", 1]] }
remapped_rows_failure = true
throttle_reasons = ["hw_power_brake_slowdown"]
# Xids every 10 s: increase() counts those after Prometheus's first scrape of the agent.
xid = [["10s", 48], ["20s", 48], ["30s", 48], ["40s", 48], ["50s", 48], ["60s", 48]]
"""
# GPM (Hopper and later): the profiling fields, for a whole GPU and per MIG instance.
HOPPER = """
[fake]
name = "hopper"
lifetime = "10m"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
[[gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"
gpu_instance_id = 2
[[gpu.mig]]
profile = "2g.20gb"
memory_total = "20GiB"
gpu_instance_id = 3

[[process]]
gpu = 0
ghost = 4100201
memory = "60GiB"
sm_percent = 90
tensor_percent = 60

[[process]]
gpu = 1
mig = 0
ghost = 4100202
memory = "30GiB"
sm_percent = 50
tensor_percent = 20
"""
# Scenarios written by the fixture rather than bundled.
INLINE = {"failing": FAILING, "hopper": HOPPER}
# What Grafana puts for its interval variables; the stack scrapes every second.
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}

Dashboard = dict[str, Any]


def _load(path: Path) -> Dashboard:
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _panels(panels: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest theirs


def _targets(dashboard: Dashboard) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target."""
    return [
        (p.get("title", "?"), t["expr"])
        for p in _panels(dashboard["panels"])
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def _queries(dashboard: Dashboard) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation."""
    found = [(f"panel {title!r}", expr) for title, expr in _targets(dashboard)]
    found += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return found


def _variable_query(var: dict[str, Any]) -> str:
    query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    return str(query).strip()


_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.*),\s*)?(?P<label>\w+)\s*\)$")


def _variable_metrics(dashboard: Dashboard) -> list[tuple[str, str]]:
    """(variable, series selector) of each label_values(...) variable query."""
    found = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            match = _LABEL_VALUES.match(_variable_query(var))
            assert match and match["selector"], _variable_query(var)
            found.append((var["name"], match["selector"]))
    return found


def _variables(dashboard: Dashboard) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


@pytest.fixture(params=DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def dashboard(request: pytest.FixtureRequest) -> Dashboard:
    return _load(request.param)


# -- on paper ------------------------------------------------------------------------


def test_the_dashboards_are_there() -> None:
    assert {p.stem for p in DASHBOARDS} == {
        "gpuwatch-fleet", "gpuwatch-host", "gpuwatch-holders", "gpuwatch-agents",
    }  # fmt: skip


def test_dashboard_identity_is_stable(dashboard: Dashboard) -> None:
    # Links and bookmarks use the uid; provisioning refuses duplicates.
    assert f"{dashboard['uid']}.json" in {p.name for p in DASHBOARDS}
    assert dashboard["title"].startswith("gpuwatch / ")
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"


def test_uids_and_titles_are_unique() -> None:
    loaded = [_load(p) for p in DASHBOARDS]
    assert len({d["uid"] for d in loaded}) == len({d["title"] for d in loaded}) == len(loaded)


def test_every_panel_uses_the_datasource_variable(dashboard: Dashboard) -> None:
    """No hard-coded datasource uid: the dashboard works against any Prometheus."""
    assert _variables(dashboard)["datasource"]["type"] == "datasource"
    for panel in _panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel[
                "title"
            ]
    uids = set(re.findall(r'"uid": "([^"]*)"', json.dumps(dashboard)))
    assert uids <= {dashboard["uid"], "${datasource}", "-- Grafana --"}, uids


def test_templated_by_host_and_gpu(
    dashboard: Dashboard, metric_names: Callable[[str], set[str]]
) -> None:
    variables = _variables(dashboard)
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    uses_gpu = any("$gpu" in expr for _, expr in _queries(dashboard))
    assert uses_gpu == ("gpu" in variables), "a $gpu variable exactly where panels are per GPU"
    # Every query of the agents' series follows the host selection (the server's do not:
    # they carry a `host` label of their own).
    for where, expr in _queries(dashboard):
        agent_series = {
            n for n in metric_names(expr)
            if not n.startswith(("gpuwatch_fleet_", "gpuwatch_server_"))
            and n not in ("up", "ALERTS")  # Prometheus's own: by job, tested below
        }  # fmt: skip
        if agent_series or 'job="gpuwatch-agent"' in expr:
            assert '"$instance"' in expr, f"{where}: {expr}"


def test_the_dashboards_show_what_the_brief_promises() -> None:
    text = " ".join(expr for path in DASHBOARDS for _, expr in _queries(_load(path)))
    for metric in (
        # memory, and who holds it
        "gpuwatch_gpu_memory_total_bytes", "gpuwatch_gpu_memory_free_bytes",
        "gpuwatch_gpu_memory_unattributed_bytes", "gpuwatch_gpu_memory_dead_process_bytes",
        "gpuwatch_gpu_memory_orphaned_bytes", "gpuwatch_gpu_process_memory_used_bytes",
        "gpuwatch_gpu_process_sm_ratio", "gpuwatch_mig_memory_used_bytes",
        "gpuwatch_mig_memory_total_bytes",
        # activity (GPM's stands in where NVML gives none: MIG) and health
        "gpuwatch_gpu_utilization_ratio", "gpuwatch_gpu_activity_ratio",
        "gpuwatch_gpu_pcie_bytes_per_second", "gpuwatch_gpu_temperature_celsius",
        "gpuwatch_gpu_power_watts", "gpuwatch_gpu_energy_joules_total", "gpuwatch_gpu_clock_hertz",
        "gpuwatch_gpu_fan_ratio", "gpuwatch_gpu_throttle_reasons", "gpuwatch_gpu_ecc_errors_total",
        "gpuwatch_gpu_remapped_rows", "gpuwatch_gpu_xid_errors_total",
        # the agents and the server
        "gpuwatch_agent_last_poll_timestamp_seconds", "gpuwatch_nvml_errors_total",
        "gpuwatch_agent_push_batches_total", "gpuwatch_fleet_open_events",
    ):  # fmt: skip
        assert metric in text, metric


# Each kind of alert the rules raise, by the labels it carries besides its name: on one
# GPU of an agent, on an agent, about a host or an event kind of the whole fleet (the
# server's gpuwatch_fleet_* series, aggregated by host or kind: no instance), on the
# server, and absent() of the agents' job (no label at all).
ALERT_KINDS = {
    "GpuLost": {"job": "gpuwatch-agent", "instance": "a:9402", "gpu": "0", "uuid": "GPU-1"},
    "GpuwatchAgentDown": {"job": "gpuwatch-agent", "instance": "a:9402"},
    "GpuHostMemoryHeldByOrphans": {"job": "gpuwatch-server", "host": "a"},
    "GpuRunawayProcesses": {"job": "gpuwatch-server", "kind": "runaway"},
    "GpuwatchServerDown": {"job": "gpuwatch-server", "instance": "s:9403"},
    "GpuwatchAgentsMissing": {},
}
_ALERTS_SELECTOR = re.compile(r"^ALERTS\{(?P<matchers>.*)\}$")
_ALERTS_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"\\]*)"')


def _selects(expr: str, labels: dict[str, str], instance: str) -> bool:
    """Whether the annotation query ``expr`` (one ALERTS selector) selects the series
    ``labels`` with ``$instance`` as given (a missing label is "", as in PromQL)."""
    selector = _ALERTS_SELECTOR.match(expr)
    assert selector, expr
    for name, op, value in _ALERTS_MATCHER.findall(selector["matchers"]):
        value = value.replace("$instance", instance)
        have = labels.get(name, "")
        equal = re.fullmatch(value, have) is not None if "~" in op else value == have
        if equal == op.startswith("!"):
            return False
    return True


def _render(template: str, labels: dict[str, str]) -> str:
    """A legend or annotation text as Grafana fills it: ``{{label}}`` -> its value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


def test_the_alert_annotations_show_every_alert_once_and_say_where(
    dashboard: Dashboard, all_rules: list[dict[str, Any]]
) -> None:
    """The audit: the one annotation filtered on `instance`, which the fleet's alerts
    do not have and the server's is not an agent's, so only agent alerts were ever
    shown, and "{{instance}} GPU {{gpu}}" read "host:9402 GPU " for an agent's."""
    assert ALERT_KINDS.keys() <= {rule["alert"] for rule in all_rules if "alert" in rule}
    annotations = [a for a in dashboard["annotations"]["list"] if "expr" in a]
    # "All" as Grafana writes it: the variable's allValue, else every value as a regex.
    all_value = _variables(dashboard)["instance"].get("allValue") or "(a:9402|b:9402)"
    assert all_value == ".*"  # short for a 500-host fleet
    for name, labels in ALERT_KINDS.items():
        series = {"alertname": name, "alertstate": "firing", **labels}
        shown = [a for a in annotations if _selects(a["expr"], series, all_value)]
        assert len(shown) == 1, (name, [a["name"] for a in shown])
        text = _render(shown[0]["textFormat"], series)
        assert not text.rstrip().endswith("GPU") and (text.strip() or not labels), (name, text)
        # With another host selected, what is about no agent is still shown.
        elsewhere = [a for a in annotations if _selects(a["expr"], series, "b:9402")]
        assert len(elsewhere) == (labels.get("job") != "gpuwatch-agent"), name


def test_every_query_names_only_known_metrics(
    dashboard: Dashboard,
    metric_names: Callable[[str], set[str]],
    known_series: frozenset[str],
) -> None:
    for where, expr in _queries(dashboard) + _variable_metrics(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        assert names <= known_series, f"{where}: unknown {names - known_series}"


def test_every_query_parses_as_promql(
    dashboard: Dashboard,
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


def test_nvidia_dashboard_is_the_published_file_unchanged() -> None:
    digest = hashlib.sha256(NVIDIA_DASHBOARD.read_bytes()).hexdigest()
    assert digest == NVIDIA_SHA256, "the fixture must stay NVIDIA's file as published"


def _absent_dcgm_fields() -> set[str]:
    """The fields docs/dcgm.md lists under "## Absent"."""
    text = DCGM_DOC.read_text(encoding="utf-8").split("\n## Absent", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(DCGM_[A-Z0-9_]+)`", text))


def test_the_absent_list_leaves_out_what_gpm_gives() -> None:
    absent = _absent_dcgm_fields()
    assert not {f for f in absent if f.startswith("DCGM_FI_DEV_FB_")}
    assert not absent & {spec.name for spec in dcgm.METRICS}, "exported, yet listed absent"


# -- for real: server, agents, Prometheus ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    """Prometheus's HTTP API, and the processes behind the data it has."""

    url: str
    logs: list[Path] = field(default_factory=list)

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]  # type: ignore[no-any-return]

    def label_values(self, selector: str | None, label: str) -> list[str]:
        if selector is None:
            return sorted(self.get(f"/api/v1/label/{label}/values"))
        series = self.get("/api/v1/series", **{"match[]": selector})
        return sorted({s[label] for s in series if label in s})

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs
        )


class _Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(tmp / "run"),
            "GPUWATCH_CONFIG": "/dev/null",
            "GPUWATCH_SERVER_DATA_DIR": str(tmp / "data"),
            "GPUWATCH_AGENT_PUSH_INTERVAL_SECONDS": "0.5",
        }
        (tmp / "run").mkdir()
        self.db_url = f"sqlite:///{tmp / 'gpuwatch.db'}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def cli(self, *args: str) -> str:
        result = subprocess.run(
            [*GPUWATCH, *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Path:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            self.processes.append(
                subprocess.Popen(
                    argv, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
                )
            )
        self.logs.append(log)
        return log

    def url_in(self, log: Path, banner: str) -> str:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while time.monotonic() < deadline:
            match = re.search(rf"{banner} (http://\S+)", log.read_text(errors="replace"))
            if match:
                return match.group(1).removesuffix("/metrics")
            time.sleep(0.05)
        raise AssertionError(f"no {banner!r} in {log.name}:\n{log.read_text(errors='replace')}")

    def close(self) -> None:
        stop_processes(self.processes)
        subprocess.run(
            [*GPUWATCH, "fake-nvml", "stop", "--all"], env=self.env, capture_output=True, timeout=60
        )


def _prometheus_config(agents: list[str], server: str, prometheus: str) -> dict[str, Any]:
    """The shipped scrape config with this stack's targets and one-second intervals."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    targets = {"gpuwatch-agent": agents, "gpuwatch-server": [server], "prometheus": [prometheus]}
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config  # type: ignore[no-any-return]


def _hostport(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


def _start_agent(stack: _Stack, scenario: str, server: str, token: str) -> Path:
    name = Path(scenario).stem
    argv = [
        *GPUWATCH, "agent", "--fake-gpus", scenario, "--listen", "127.0.0.1:0",
        "--poll-interval", "0.5", "--collector.processes", "--dcgm-compat",
        "--server", server, "--token", token,
    ]  # fmt: skip
    env = {
        "GPUWATCH_AGENT_AGENT_ID": f"grafana-test-{name}",
        "GPUWATCH_AGENT_SPOOL_DIR": str(stack.tmp / f"spool-{name}"),
    }
    return stack.start(f"agent-{name}", argv, env)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus missing (Debian package prometheus; ./dev setup installs it)")
    tmp = tmp_path_factory.mktemp("grafana-live")
    stack = _Stack(tmp)
    try:
        stack.cli("db", "upgrade", "--database-url", stack.db_url)
        token = stack.cli("token", "create", socket.gethostname(), "--database-url", stack.db_url)
        token = token.strip().splitlines()[-1]
        server_log = stack.start(
            "server",
            [*GPUWATCH, "server", "--listen", "127.0.0.1:0", "--database-url", stack.db_url],
        )
        server = stack.url_in(server_log, "listening on")
        for name, text in INLINE.items():
            (tmp / f"{name}.toml").write_text(text, encoding="utf-8")
        agent_logs = [
            _start_agent(stack, str(tmp / f"{s}.toml") if s in INLINE else s, server, token)
            for s in SCENARIOS
        ]
        agents = [stack.url_in(log, "serving") for log in agent_logs]
        port = _free_port()
        config_dir = tmp / "prometheus"
        config_dir.mkdir()
        shutil.copy(PROMETHEUS_DIR / "gpuwatch.rules.yml", config_dir)  # rule_files is relative
        config = _prometheus_config(
            [_hostport(a) for a in agents], _hostport(server), f"127.0.0.1:{port}"
        )
        (config_dir / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        stack.start(
            "prometheus",
            [binary, f"--config.file={config_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"],
        )  # fmt: skip
        api = Prometheus(f"http://127.0.0.1:{port}", stack.logs)
        _wait_for_scrapes(api, targets=len(agents) + 2)
        yield api
    finally:
        stack.close()


def _wait_for_scrapes(api: Prometheus, *, targets: int) -> None:
    """Until every target is up and has been scraped a few times."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        try:
            up = api.query("count(up == 1)")
            scrapes = api.query("min(count_over_time(up[1m]))")
            if up and int(up[0]["value"][1]) == targets and float(scrapes[0]["value"][1]) >= 4:
                return
        except (httpx.HTTPError, AssertionError, IndexError, ValueError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"Prometheus never scraped all {targets} targets\n{api.log_tail()}")


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def _escape(value: str) -> str:
    # Grafana's Prometheus data source: regex-escape, doubled for the PromQL string literal.
    return re.sub(r"[\\^$*+?.()|\[\]{}]", lambda m: "\\\\" + m.group(0), value)


def _substitute(expr: str, dashboard: Dashboard, values: dict[str, list[str]]) -> str:
    variables = _variables(dashboard)

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name in GRAFANA_INTERVALS:
            return GRAFANA_INTERVALS[name]
        if name not in values:
            return match.group(0)
        found = values[name]
        assert found, f"variable {name} has no values"
        var = variables[name]
        if var.get("multi") or var.get("includeAll"):  # "All" selected
            if var.get("allValue"):
                return str(var["allValue"])
            return "(" + "|".join(_escape(v) for v in found) + ")"
        return found[0]

    return _VARIABLE.sub(replace, expr)


def _resolve_variables(dashboard: Dashboard, api: Prometheus) -> dict[str, list[str]]:
    """Each query variable's values, from its own query (in order: later ones use earlier)."""
    values: dict[str, list[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "datasource":
            continue
        assert var["type"] == "query", var["name"]
        match = _LABEL_VALUES.match(_variable_query(var))
        assert match, _variable_query(var)
        selector = match["selector"] and _substitute(match["selector"], dashboard, values)
        found = api.label_values(selector or None, match["label"])
        if var.get("regex"):
            found = [v for v in found if re.search(var["regex"], v)]
        values[var["name"]] = found
    return values


def _needs_the_idle_window(expr: str) -> bool:
    """A query of processes idle for the server's idle window (an hour): it reads each
    process's series an hour back, which a stack minutes old does not have."""
    return "gpuwatch_gpu_process_sm_ratio" in expr and "offset 1h" in expr


def _empty_targets(
    dashboard: Dashboard, api: Prometheus
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    values = _resolve_variables(dashboard, api)
    empty = []
    for title, expr in _targets(dashboard):
        if _needs_the_idle_window(expr):
            continue  # empty here by design: test_a_process_seen_for_less_than_...
        query = _substitute(expr, dashboard, values)
        if not api.query(query):
            empty.append((title, query))
    return values, empty


def _until_settled(check: Callable[[], list[Any]]) -> list[Any]:
    """Run ``check`` until it finds nothing wrong or the deadline passes (recording rules
    and the first pushes to the server take a few seconds to appear)."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while True:
        problems = check()
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(1)


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_panel_query_returns_data(path: Path, prometheus: Prometheus) -> None:
    dashboard = _load(path)
    values = _resolve_variables(dashboard, prometheus)
    assert len(values["instance"]) == len(SCENARIOS), values  # every agent
    if "gpu" in values:
        assert set(values["gpu"]) == {"0", "1", "2", "3"}, values
    empty = _until_settled(lambda: _empty_targets(dashboard, prometheus)[1])
    assert not empty, "queries without data:\n" + "\n".join(f"{t}: {q}" for t, q in empty)


def test_a_process_seen_for_less_than_the_idle_window_is_not_counted_idle(
    prometheus: Prometheus,
) -> None:
    """The audit: the idle panels counted a process idle once its series, however short,
    had no SM activity: one that appeared a minute ago and has not launched a kernel
    yet (loading data, compiling). The server calls a process idle after its idle
    window (an hour) of none; so do the panels, and a stack minutes old has no idle
    process although it has processes with no SM activity so far."""
    dashboard = _load(GRAFANA / "dashboards" / "gpuwatch-holders.json")
    idle = [(title, expr) for title, expr in _targets(dashboard) if _needs_the_idle_window(expr)]
    assert {title for title, _ in idle} == {
        "Held by idle processes", "Idle holders", "Idle memory by user", "Idle holders over time",
    }  # fmt: skip
    quiet = "max_over_time(gpuwatch_gpu_process_sm_ratio[1h]) == 0"
    assert not _until_settled(lambda: [] if prometheus.query(quiet) else [quiet])
    values = _resolve_variables(dashboard, prometheus)
    for title, expr in idle:
        # The stats read 0 ("or vector(0)"), not "No data"; the other panels return nothing.
        result = prometheus.query(_substitute(expr, dashboard, values))
        assert all(r["metric"] == {} and float(r["value"][1]) == 0 for r in result), title


def _legends(dashboard: Dashboard, api: Prometheus) -> dict[str, list[str]]:
    """Panel title -> the legend of each series its targets return, as Grafana writes
    it, with "All" selected."""
    values = _resolve_variables(dashboard, api)
    legends: dict[str, list[str]] = {}
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            if not (target.get("expr") and target.get("legendFormat")):
                continue
            for series in api.query(_substitute(target["expr"], dashboard, values)):
                legend = _render(target["legendFormat"], series["metric"])
                legends.setdefault(panel["title"], []).append(legend)
    return legends


def _legend_problems(dashboard: Dashboard, api: Prometheus) -> list[str]:
    problems = []
    for title, legends in _legends(dashboard, api).items():
        repeated = sorted({legend for legend in legends if legends.count(legend) > 1})
        problems += [f"{title}: {legend!r} names several series" for legend in repeated]
        # "MIG" with no instance after it: a whole GPU's series under an instance's legend.
        problems += [
            f"{title}: {legend!r}" for legend in legends if re.search(r"MIG(?! \d)", legend)
        ]
    return problems


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_series_of_a_panel_has_a_legend_of_its_own(
    path: Path, prometheus: Prometheus
) -> None:
    """The audit: with every host selected (the default) the host dashboard's "Agent"
    stat showed 3 values per host, all named "scrape", "simulated GPUs" and "PID
    namespace isolated"; a Hopper in MIG mode's whole-GPU GPM series read "GPU 1 MIG
    (engines busy, GPM)" beside its instances', and per-instance PCIe lines collided."""
    dashboard = _load(path)
    problems = _until_settled(lambda: _legend_problems(dashboard, prometheus))
    assert not problems, "\n".join(problems)


def test_nvidia_dcgm_exporter_dashboard_works_unchanged(
    prometheus: Prometheus, metric_names: Callable[[str], set[str]]
) -> None:
    dashboard = _load(NVIDIA_DASHBOARD)
    absent = _absent_dcgm_fields()

    def unexplained() -> list[tuple[str, str]]:
        _, empty = _empty_targets(dashboard, prometheus)
        return [(title, query) for title, query in empty if not metric_names(query) <= absent]

    problems = _until_settled(unexplained)
    assert not problems, "queries without data, for fields NVML can give:\n" + "\n".join(
        f"{t}: {q}" for t, q in problems
    )
    values, empty = _empty_targets(dashboard, prometheus)
    # Its variables resolve from DCGM_FI_DEV_GPU_TEMP: every agent, every GPU index.
    assert len(values["instance"]) == len(SCENARIOS), values
    assert set(values["gpu"]) == {"0", "1", "2", "3"}, values
    assert not empty, empty  # all 8 panels, "Tensor Core Utilization" from GPM included
    assert len(_targets(dashboard)) == 8


def test_tensor_activity_comes_from_gpm_on_hopper_only(prometheus: Prometheus) -> None:
    """DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: the whole H100 and each MIG instance its own,
    as 0-1 ratios; nothing for the A100s and the RTX A6000s (no GPM)."""
    query = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
    # Three series once the agent's second poll has paired GPM samples and been scraped.
    assert not _until_settled(lambda: [] if len(prometheus.query(query)) >= 3 else [query])
    series = prometheus.query(query)
    assert {s["metric"]["modelName"] for s in series} == {"NVIDIA H100 80GB HBM3"}
    found = {
        (s["metric"]["gpu"], s["metric"].get("GPU_I_ID", "")): float(s["value"][1]) for s in series
    }
    # GPU 0: its process's 60 %; GPU 1, in MIG mode, has no series of its own.
    assert found == {("0", ""): 0.6, ("1", "2"): 0.2, ("1", "3"): 0.0}
    native = prometheus.query('gpuwatch_gpu_activity_ratio{activity="tensor"}')
    assert {(s["metric"]["gpu"], s["metric"].get("gpu_instance_id", "")) for s in native} >= {
        ("0", ""), ("1", "2"), ("1", "3"),
    }  # fmt: skip


def test_mig_instances_get_their_own_dcgm_series(prometheus: Prometheus) -> None:
    """dcgm-exporter's MIG labels: one series per GPU instance, none for its GPU."""
    used = prometheus.query('DCGM_FI_DEV_FB_USED{GPU_I_ID!="", modelName=~"NVIDIA A100.*"}')
    assert sorted((s["metric"]["GPU_I_PROFILE"], s["metric"]["GPU_I_ID"]) for s in used) == [
        ("2g.20gb", "2"), ("2g.20gb", "3"), ("3g.40gb", "1"),
    ]  # fmt: skip
    assert {s["metric"]["gpu"] for s in used} == {"0"}
    # The MIG GPU has no whole-GPU series; the other A100 has no instance labels.
    (instance,) = {s["metric"]["instance"] for s in used}
    temperature = prometheus.query(f'DCGM_FI_DEV_GPU_TEMP{{instance="{instance}"}}')
    assert sorted((s["metric"]["gpu"], s["metric"].get("GPU_I_ID", "")) for s in temperature) == [
        ("0", "1"), ("0", "2"), ("0", "3"), ("1", ""),
    ]  # fmt: skip
    # The 3g.40gb instance holds the fine-tuning run's 31 GiB.
    (big,) = [s for s in used if s["metric"]["GPU_I_PROFILE"] == "3g.40gb"]
    assert float(big["value"][1]) == 31 * 1024


def test_mig_instances_get_their_own_native_memory_series(prometheus: Prometheus) -> None:
    """gpuwatch_mig_memory_*: one series per instance, labelled as the GPU's series plus
    gpu_instance_id and profile; the rules' GPU-or-instance series carry them too, and a
    process in an instance says which (empty off MIG)."""
    query = 'gpuwatch_mig_memory_total_bytes{profile!=""}'
    assert not _until_settled(lambda: [] if len(prometheus.query(query)) >= 5 else [query])
    total = prometheus.query(
        f'{query} and on (instance) gpuwatch_gpu_info{{name=~"NVIDIA A100.*"}}'
    )
    assert sorted((s["metric"]["profile"], s["metric"]["gpu_instance_id"]) for s in total) == [
        ("2g.20gb", "2"), ("2g.20gb", "3"), ("3g.40gb", "1"),
    ]  # fmt: skip
    assert {s["metric"]["gpu"] for s in total} == {"0"}
    assert all(s["metric"]["uuid"].startswith("GPU-") for s in total)  # the GPU's, as elsewhere
    (big,) = [s for s in total if s["metric"]["profile"] == "3g.40gb"]
    (instance,) = {s["metric"]["instance"] for s in total}
    used = prometheus.query(
        f'gpuwatch_mig_memory_used_bytes{{instance="{instance}", gpu_instance_id="1"}}'
    )
    assert float(used[0]["value"][1]) == 31 * 2**30  # the fine-tuning run's 31 GiB
    allocatable = prometheus.query(
        f'gpuwatch:memory_allocatable_bytes{{instance="{instance}", gpu_instance_id="1"}}'
    )
    assert float(allocatable[0]["value"][1]) == float(big["value"][1])
    ids = {  # Prometheus drops empty labels: a process off MIG has none
        s["metric"].get("gpu_instance_id", "")
        for s in prometheus.query(
            f'gpuwatch_gpu_process_memory_used_bytes{{instance="{instance}"}}'
        )
    }
    assert "1" in ids and ids <= {"", "1", "2", "3"}, ids


def test_health_alerts_fire_on_what_the_agent_exports(prometheus: Prometheus) -> None:
    """The shipped rules, evaluated by Prometheus on the agent's own series: the failing
    GPU's uncorrectable error, its Xid (delivered through an NVML event set) and its failed
    row remap fire at once; the power brake is pending its 5 minutes."""
    expected = {
        ("GpuEccUncorrectableErrors", "firing"), ("GpuXidErrors", "firing"),
        ("GpuRowRemapFailed", "firing"), ("GpuPowerThrottling", "pending"),
    }  # fmt: skip

    def alerts() -> list[dict[str, Any]]:
        return prometheus.get("/api/v1/alerts")["alerts"]  # type: ignore[no-any-return]

    def missing() -> list[tuple[str, str]]:
        return sorted(expected - {(a["labels"]["alertname"], a["state"]) for a in alerts()})

    assert not _until_settled(missing), f"{missing()}\n{prometheus.log_tail()}"
    health = {
        "GpuEccUncorrectableErrors",
        "GpuXidErrors",
        "GpuRowRemapFailed",
        "GpuPowerThrottling",
    }
    about = {(a["labels"]["instance"], a["labels"]["gpu"]) for a in alerts()
             if a["labels"]["alertname"] in health}  # fmt: skip
    assert len(about) == 1, about  # only the failing GPU; the healthy boards stay quiet
    (xid,) = [a for a in alerts() if a["labels"]["alertname"] == "GpuXidErrors"]
    assert xid["annotations"]["summary"].endswith("(last: Xid 48)")
