"""The server's /metrics has every known label value at 0 before anything happened, and a
host's held memory and the fleet's open events go back to 0 (not absent) once cleared,
so Prometheus sees a first increment as an increase and a cleared condition as 0."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database
from gpuwatch.server.events.models import EVENT_KINDS
from gpuwatch.server.metrics import INGEST_RESULTS, JOB_RESULTS, SNAPSHOT_RESULTS
from gpuwatch.server.scheduler import job_specs
from gpuwatch.settings import ServerSettings
from server.factories import GIB, body, gpu, process, snapshot
from server.harness import FakeClock, Live, serve

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def scrape(client: httpx.Client) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def by_label(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    """The samples of ``name``, keyed by their label values (in label-name order)."""
    return {
        tuple(value for _, value in labels): v for (n, labels), v in samples.items() if n == name
    }


def test_a_fresh_server_exports_every_known_series_at_zero(live: Live) -> None:
    samples = scrape(live.client)

    assert by_label(samples, "gpuwatch_server_ingest_requests_total") == {
        (result,): 0 for result in INGEST_RESULTS
    }
    assert by_label(samples, "gpuwatch_server_ingest_snapshots_total") == {
        (result,): 0 for result in SNAPSHOT_RESULTS
    }
    assert by_label(samples, "gpuwatch_server_events_opened_total") == {
        (kind,): 0 for kind in EVENT_KINDS
    }
    assert by_label(samples, "gpuwatch_fleet_open_events") == {(kind,): 0 for kind in EVENT_KINDS}
    # No host yet: the per-host families are empty, not a made-up host at 0.
    assert by_label(samples, "gpuwatch_fleet_orphaned_memory_bytes") == {}


def test_held_memory_and_open_events_fall_back_to_zero_when_cleared(live: Live) -> None:
    token = live.token("host-1")
    live.push(token, body(snapshot(0, [gpu(0, [process(2)])])))

    clean = scrape(live.client)
    live.push(token, body(snapshot(1, [gpu(0, [process(1, used_gib=30, orphaned=True)])])))
    orphaned = scrape(live.client)
    live.push(token, body(snapshot(2, [gpu(0, [process(2)])])))  # the orphan is gone
    cleared = scrape(live.client)

    for samples, held, open_orphaned in ((clean, 0, 0), (orphaned, 30 * GIB, 1), (cleared, 0, 0)):
        assert by_label(samples, "gpuwatch_fleet_orphaned_memory_bytes") == {("host-1",): held}
        assert by_label(samples, "gpuwatch_fleet_idle_memory_bytes") == {("host-1",): 0}
        assert by_label(samples, "gpuwatch_fleet_agent_silent") == {("host-1",): 0}
        open_events = by_label(samples, "gpuwatch_fleet_open_events")
        assert open_events == {(kind,): 0 for kind in EVENT_KINDS} | {("orphaned",): open_orphaned}
    assert by_label(cleared, "gpuwatch_server_events_opened_total")[("orphaned",)] == 1


def test_declared_jobs_start_at_zero_for_every_result(app: FastAPI, live: Live) -> None:
    app.state.gpuwatch.stats.expect_jobs(["retention", "agent_silent"])

    runs = by_label(scrape(live.client), "gpuwatch_server_job_runs_total")

    # Keyed in label-name order: result, scheduled_job.
    assert runs == {
        (result, job): 0 for job in ("agent_silent", "retention") for result in JOB_RESULTS
    }


def test_a_server_running_the_scheduler_exports_its_jobs_at_zero(
    database: Database, settings: ServerSettings, clock: FakeClock
) -> None:
    settings = settings.model_copy(update={"scheduler": True})
    app = create_app(settings, clock=clock, engine=database.engine)

    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        runs = by_label(scrape(client), "gpuwatch_server_job_runs_total")

    specs = job_specs(settings, app.state.gpuwatch.alerts)
    assert "alerts" in {spec.name for spec in specs}
    assert runs == {(result, spec.name): 0 for spec in specs for result in JOB_RESULTS}
