"""The holders dashboard's idle panels, evaluated by promtool on an hour of series.

An idle holder is one seen for the whole hour with its SMs idle all of it. A dead PID
(NVML reads it at 0 SM) or an orphan is not also idle: the dashboard counts it under
"Held by dead processes" / "Held by orphans", as the server counts each byte once. The
stats read 0, not "No data", when nothing is idle.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

DASHBOARD = Path(__file__).resolve().parents[2] / "grafana" / "dashboards" / "gpuwatch-holders.json"
GIB = 2**30
# The panels: 5 "Held by idle processes", 8 "Idle holders", 9 "Idle memory by user",
# 10 "Idle holders over time".
STAT_TOTAL, TABLE, STAT_BY_USER, OVER_TIME = 5, 8, 9, 10


def _expr(panel_id: int) -> str:
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    (panel,) = [p for p in panels if p["id"] == panel_id]
    expr: str = panel["targets"][0]["expr"]
    return expr.replace('=~"$instance"', '=~".*"').replace('=~"$gpu"', '=~".*"')


def _process(pid: int, user: str, metric: str, values: str) -> dict[str, str]:
    labels = (
        f'job="gpuwatch-agent",instance="node:9402",gpu="0",uuid="GPU-0",gpu_instance_id="",'
        f'pid="{pid}",user="{user}",name="python",container="",pod="",slurm_job=""'
    )
    return {"series": f"{metric}{{{labels}}}", "values": values}


def _holder(pid: int, user: str, *, gib: int, sm: float, orphaned: int | None) -> list[dict]:
    """A holder listed for 90 minutes; ``orphaned`` None: an agent without that series."""
    series = [
        _process(pid, user, "gpuwatch_gpu_process_memory_used_bytes", f"{gib * GIB}x90"),
        _process(pid, user, "gpuwatch_gpu_process_sm_ratio", f"{sm}x90"),
        _process(pid, user, "gpuwatch_gpu_process_start_time_seconds", "1700000000x90"),
    ]
    if orphaned is not None:
        series.append(_process(pid, user, "gpuwatch_gpu_process_orphaned", f"{orphaned}x90"))
    return series


def _run(promtool: str, tmp_path: Path, series: list[dict], tests: list[dict[str, Any]]) -> None:
    path = tmp_path / "idle.test.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
            },
            sort_keys=False,
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _labels(pid: int, user: str) -> str:
    # Empty labels are no labels to Prometheus.
    return (
        f'{{__name__="gpuwatch_gpu_process_memory_used_bytes",gpu="0",instance="node:9402",'
        f'job="gpuwatch-agent",name="python",pid="{pid}",user="{user}",uuid="GPU-0"}}'
    )


def test_dead_and_orphaned_holders_are_not_idle_holders(promtool: str, tmp_path: Path) -> None:
    series = [
        *_holder(100, "alice", gib=10, sm=0.0, orphaned=0),  # idle: listed
        *_holder(200, "", gib=6, sm=0.0, orphaned=1),  # a dead PID: not idle
        *_holder(300, "bob", gib=4, sm=0.0, orphaned=1),  # reparented: an orphan
        *_holder(400, "carol", gib=8, sm=0.5, orphaned=0),  # busy
        *_holder(500, "dave", gib=2, sm=0.0, orphaned=None),  # an older agent: still judged
    ]
    at = "80m"
    listed = [
        {"labels": _labels(100, "alice"), "value": 10 * GIB},
        {"labels": _labels(500, "dave"), "value": 2 * GIB},
    ]
    _run(
        promtool,
        tmp_path,
        series,
        [
            {"expr": _expr(TABLE), "eval_time": at, "exp_samples": listed},
            {"expr": _expr(OVER_TIME), "eval_time": at, "exp_samples": listed},
            {"expr": _expr(STAT_TOTAL), "eval_time": at, "exp_samples": [{"value": 12 * GIB}]},
            {
                "expr": _expr(STAT_BY_USER),
                "eval_time": at,
                "exp_samples": [
                    {"labels": '{user="alice"}', "value": 10 * GIB},
                    {"labels": '{user="dave"}', "value": 2 * GIB},
                ],
            },
        ],
    )


def test_the_idle_stats_read_zero_when_nothing_is_idle(promtool: str, tmp_path: Path) -> None:
    series = [
        *_holder(200, "", gib=6, sm=0.0, orphaned=1),
        *_holder(400, "carol", gib=8, sm=0.5, orphaned=0),
    ]
    _run(
        promtool,
        tmp_path,
        series,
        [
            {"expr": _expr(STAT_TOTAL), "eval_time": "80m", "exp_samples": [{"value": 0}]},
            {"expr": _expr(STAT_BY_USER), "eval_time": "80m", "exp_samples": [{"value": 0}]},
        ],
    )
