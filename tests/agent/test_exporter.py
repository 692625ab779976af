"""The exporter, scraped over real HTTP; the exposition linted by promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.exposition import generate_latest
from support.snapshots import GiB, sample_snapshot

from gpuwatch.agent.collectors.agent import AgentCollector, PushStats
from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.collectors.registry import ScrapeRenderer, build_registry
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import OomIncident

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"


def _state() -> AgentState:
    state = AgentState()
    state.record_poll(sample_snapshot())
    state.nvml_errors.add("nvmlDeviceGetPowerUsage", "not_supported")
    return state


def _registry(
    state: AgentState, *, processes: bool = True, max_series: int = 100, dcgm: bool = True
):
    source = lambda: state.latest  # noqa: E731
    dcgm_collectors = [DcgmCompatCollector(source)] if dcgm else []
    return build_registry(
        [
            GpuCollector(source),
            ProcessCollector(source, enabled=processes, max_series=max_series),
            AgentCollector(
                state,
                torch_reports_total=lambda: 3,
                push_stats=_push_stats,
            ),
            *dcgm_collectors,
        ]
    )


def _push_stats() -> PushStats:
    return PushStats(
        batches={"success": 5},
        dropped={"spool_full": 1},
        pending=2,
        last_success_time=1.7e9,
        pushed={"accepted": 9},
    )


def _normalise(text: str) -> str:
    """Drop what legitimately varies between runs: durations and the Python version."""
    text = re.sub(
        r"(gpuwatch_scrape_collector_duration_seconds\{[^}]*\}) \S+", r"\1 <duration>", text
    )
    return re.sub(r'python_version="[^"]*"', 'python_version="<python>"', text)


def _renderer(state: AgentState, calls: list[str] | None = None) -> ScrapeRenderer:
    source = lambda: state.latest  # noqa: E731

    class Counting(GpuCollector):
        def collect(self):
            if calls is not None:
                calls.append("gpu")
            return super().collect()

    return ScrapeRenderer(
        [
            Counting(source),
            ProcessCollector(source, enabled=True, max_series=100),
            DcgmCompatCollector(source),
        ],
        [
            AgentCollector(
                state,
                torch_reports_total=lambda: 3,
                push_stats=_push_stats,
            )
        ],
        sequence=lambda: state.latest.sequence if state.latest else None,
    )


def test_metrics_match_golden_file() -> None:
    body, content_type = _renderer(_state()).render("")
    assert content_type.startswith("text/plain; version=0.0.4")
    text = _normalise(body.decode())
    if not GOLDEN.exists():
        GOLDEN.write_text(text)
        pytest.fail("golden file was missing and has been written: review it and commit")
    assert text == GOLDEN.read_text(), (
        "exposition changed: review and update tests/agent/golden/metrics.txt"
    )


def test_snapshot_part_is_encoded_once_per_poll() -> None:
    state = _state()
    calls: list[str] = []
    renderer = _renderer(state, calls)
    first, _ = renderer.render("")
    second, _ = renderer.render("")
    assert calls == ["gpu"]  # the second scrape reused the encoded snapshot part
    assert _normalise(first.decode()) == _normalise(second.decode())
    state.record_poll(sample_snapshot().model_copy(update={"sequence": 8}))
    renderer.render("")
    assert calls == ["gpu", "gpu"]


def test_openmetrics_document_has_one_eof() -> None:
    body, content_type = _renderer(_state()).render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    assert b"gpuwatch_scrape_collector_success" in body


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_accepts_native_exposition() -> None:
    result = _promtool(generate_latest(_registry(_state(), dcgm=False)))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""
    # And what the exporter actually serves, snapshot part plus live part, in one document.
    state = _state()
    source = lambda: state.latest  # noqa: E731
    renderer = ScrapeRenderer(
        [GpuCollector(source), ProcessCollector(source, enabled=True, max_series=10)],
        [AgentCollector(state)],
        sequence=lambda: 1,
    )
    result = _promtool(renderer.render("")[0])
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    assert result.stdout.strip() == b"" and result.stderr.strip() == b""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_finds_only_dcgms_own_label_style_in_compat_set() -> None:
    # dcgm-exporter's names and camelCase labels (modelName) are the point of the compat
    # set; promtool's style lint on them is the one finding we accept.
    result = _promtool(generate_latest(_registry(_state())))
    findings = [line for line in result.stderr.decode().splitlines() if line.strip()]
    assert findings, "expected promtool to flag dcgm-exporter's camelCase labels"
    assert all(f.startswith("DCGM_FI_DEV_FB_") and "camelCase" in f for f in findings), findings


def _promtool(body: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )


def test_unavailable_value_is_absent_not_zero() -> None:
    registry = _registry(_state())
    # GPU 1 is lost: it reports up=0 and lost=1, and no memory series at all.
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_up", {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"}
        )
        == 0
    )
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_lost", {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_memory_used_bytes",
            {"gpu": "1", "uuid": "GPU-11111111-1111-1111-1111-111111111111"},
        )
        is None
    )


def test_dead_and_orphaned_memory_are_flagged() -> None:
    registry = _registry(_state())
    labels = {"gpu": "0", "uuid": "GPU-00000000-0000-0000-0000-000000000000"}
    assert registry.get_sample_value("gpuwatch_gpu_memory_dead_process_bytes", labels) == 2 * GiB
    # The notebook kernel's server is gone: its 20 GiB counts as orphaned.
    assert registry.get_sample_value("gpuwatch_gpu_memory_orphaned_bytes", labels) == 20 * GiB
    assert registry.get_sample_value("DCGM_FI_DEV_FB_USED", {**_dcgm_labels()}) == 53 * 1024


def _dcgm_labels() -> dict[str, str]:
    return {
        "gpu": "0",
        "UUID": "GPU-00000000-0000-0000-0000-000000000000",
        "pci_bus_id": "00000000:07:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "Hostname": "gpu-box",
    }


def test_process_series_are_capped_largest_first() -> None:
    registry = _registry(_state(), max_series=1)
    assert registry.get_sample_value("gpuwatch_gpu_process_series_dropped", {}) == 2
    text = generate_latest(registry).decode()
    assert 'pid="5151"' in text  # the 30 GiB trainer is kept
    assert 'pid="4242"' not in text


def test_torch_figures_exported_even_without_process_metrics() -> None:
    text = generate_latest(_registry(_state(), processes=False)).decode()
    assert "gpuwatch_gpu_process_torch_reserved_unallocated_bytes{" in text
    assert "gpuwatch_gpu_process_memory_used_bytes{" not in text


def test_a_failing_collector_does_not_empty_the_scrape() -> None:
    class Broken:
        name = "broken"

        def collect(self):
            raise RuntimeError("boom")

    state = _state()
    registry = build_registry([Broken(), GpuCollector(lambda: state.latest)])
    assert (
        registry.get_sample_value("gpuwatch_scrape_collector_success", {"collector": "broken"}) == 0
    )
    assert registry.get_sample_value("gpuwatch_scrape_collector_success", {"collector": "gpu"}) == 1
    assert (
        registry.get_sample_value(
            "gpuwatch_gpu_memory_total_bytes",
            {"gpu": "0", "uuid": "GPU-00000000-0000-0000-0000-000000000000"},
        )
        == 80 * GiB
    )


@pytest.fixture
def exporter():
    state = _state()
    reports = TorchReports()
    incidents: list[OomIncident] = []
    source = lambda: state.latest  # noqa: E731
    renderer = ScrapeRenderer(
        [GpuCollector(source), ProcessCollector(source, enabled=True, max_series=100)],
        [AgentCollector(state)],
        sequence=lambda: state.latest.sequence if state.latest else None,
    )
    exp = Exporter(
        ("127.0.0.1", 0),
        render_metrics=renderer.render,
        state=state,
        torch_reports=reports,
        poll_interval_seconds=5,
        on_oom=incidents.append,
        clock=lambda: 1_700_010_001.0,
    )
    exp.start()
    yield exp, reports, incidents
    exp.stop()


def test_scrape_over_http(exporter) -> None:
    exp, _, _ = exporter
    response = httpx.get(f"{exp.url}/metrics", headers={"Accept-Encoding": "gzip"})
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip"
    assert "gpuwatch_gpu_memory_total_bytes{" in response.text
    openmetrics = httpx.get(
        f"{exp.url}/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    assert openmetrics.text.rstrip().endswith("# EOF")
    snap = httpx.get(f"{exp.url}/snapshot").json()
    assert snap["gpus"][0]["processes"][0]["pid"] == 4242
    assert httpx.get(f"{exp.url}/healthz").status_code == 200
    assert httpx.get(f"{exp.url}/nope").status_code == 404


def test_torch_report_is_validated_and_recorded(exporter) -> None:
    exp, reports, _ = exporter
    body = {
        "pid": 5151, "device_index": 0, "allocated_bytes": 1, "reserved_bytes": 2,
        "reserved_unallocated_bytes": 1, "peak_allocated_bytes": 1, "reported_at": 1.7e9,
    }  # fmt: skip
    assert httpx.post(f"{exp.url}/torch", json=body).status_code == 204
    assert reports.get(5151, 0, start_time=None) is not None
    bad = httpx.post(f"{exp.url}/torch", json={**body, "extra": 1})
    assert bad.status_code == 422 and "extra" in bad.json()["error"]
    assert httpx.post(f"{exp.url}/torch", content=b"{not json").status_code == 400
    huge = httpx.post(f"{exp.url}/torch", content=b"x" * (17 * 1024))
    assert huge.status_code == 413


def test_oom_incident_is_handed_to_the_agent(exporter) -> None:
    exp, _, incidents = exporter
    response = httpx.post(
        f"{exp.url}/incidents/oom",
        json={"pid": 1, "device_index": 0, "message": "CUDA out of memory"},
    )
    assert response.status_code == 202
    assert incidents == [OomIncident(pid=1, device_index=0, message="CUDA out of memory")]
    assert json.loads(httpx.post(f"{exp.url}/incidents/oom", json=[1]).text)["error"]
    unknown = httpx.post(f"{exp.url}/incidents/oom", json={"pid": 1, "message": "x", "extra": 1})
    assert unknown.status_code == 422 and "extra" in unknown.json()["error"]
    assert len(incidents) == 1
