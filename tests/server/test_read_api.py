"""Read-side surface: /metrics, /healthz, OpenAPI, and the optional read token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database
from gpuwatch.settings import ServerSettings
from server.factories import GIB, body, gpu, process, snapshot
from server.harness import FakeClock, Live, make_token, serve


def scrape(
    client: httpx.Client, **kwargs: object
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics", **kwargs)  # type: ignore[arg-type]
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


class TestMetrics:
    @pytest.fixture
    def database_url(self, sqlite_url: str) -> str:
        return sqlite_url

    def test_fleet_and_server_metrics(self, live: Live) -> None:
        token = live.token("host-1")
        orphan = process(1, used_gib=30, orphaned=True)
        live.push(token, body(snapshot(0, [gpu(0, [orphan, process(2)])]), spool_dropped_total=7))
        live.push(token, body(snapshot(0, [gpu(0, [orphan])])))  # a retry
        live.client.post("/api/v1/snapshots", json={})  # no token

        metrics = scrape(live.client)

        assert metrics[("gpuwatch_fleet_open_events", (("kind", "orphaned"),))] == 1
        assert metrics[("gpuwatch_fleet_orphaned_memory_bytes", (("host", "host-1"),))] == 30 * GIB
        assert metrics[("gpuwatch_fleet_agent_spool_dropped_total", (("host", "host-1"),))] == 7
        assert metrics[("gpuwatch_fleet_agent_silent", (("host", "host-1"),))] == 0
        assert metrics[("gpuwatch_server_ingest_requests_total", (("result", "ok"),))] == 2
        assert (
            metrics[("gpuwatch_server_ingest_requests_total", (("result", "unauthorized"),))] == 1
        )
        assert metrics[("gpuwatch_server_ingest_snapshots_total", (("result", "accepted"),))] == 1
        assert metrics[("gpuwatch_server_ingest_snapshots_total", (("result", "duplicate"),))] == 1
        assert metrics[("gpuwatch_server_events_opened_total", (("kind", "orphaned"),))] == 1
        assert metrics[("gpuwatch_fleet_gpus", (("fullness", "25-50%"),))] == 1  # 34 of 80 GiB
        assert metrics[("gpuwatch_server_database_up", ())] == 1
        # One request at a time: no writer waited for its turn (SQLite).
        assert metrics[("gpuwatch_server_write_turn_wait_seconds_total", ())] < 1
        assert metrics[("gpuwatch_server_write_turn_held_seconds_total", ())] > 0  # the pushes

    def test_openapi_lists_the_answers_a_token_or_the_database_can_give(self, live: Live) -> None:
        spec = live.client.get("/openapi.json").json()
        for path in ("/api/v1/hosts", "/api/v1/fleet", "/api/v1/processes", "/metrics"):
            assert {"401", "403"} <= set(spec["paths"][path]["get"]["responses"]), path
        assert {"401", "403"} <= set(spec["paths"]["/api/v1/silences"]["post"]["responses"])
        assert "503" in spec["paths"]["/healthz"]["get"]["responses"]
        metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        assert list(metrics) == [live.client.get("/metrics").headers["content-type"]]

    def test_openapi_documents_every_route_with_a_summary(self, live: Live) -> None:
        spec = live.client.get("/openapi.json").json()

        operations = [op for path in spec["paths"].values() for op in path.values()]
        assert {"/api/v1/snapshots", "/api/v1/events", "/api/v1/fleet", "/metrics"} <= set(
            spec["paths"]
        )
        assert all(op.get("summary") for op in operations)
        assert "413" in spec["paths"]["/api/v1/snapshots"]["post"]["responses"]

    def test_healthz(self, live: Live) -> None:
        assert live.client.get("/healthz").json() == {"status": "ok", "database": "sqlite"}


@pytest.fixture
def guarded(
    tmp_path: Path, clock: FakeClock, sqlite_url: str
) -> Iterator[tuple[httpx.Client, str]]:
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade

    database: Database = create_database(sqlite_url)
    upgrade(database)
    settings = ServerSettings(data_dir=tmp_path, scheduler=False, read_token="reader-secret")
    token = make_token(database, "host-1")
    with (
        serve(create_app(settings, clock=clock, engine=database.engine)) as url,
        httpx.Client(base_url=url) as client,
    ):
        yield client, token
    database.dispose()


@pytest.mark.parametrize("path", ["/api/v1/hosts", "/api/v1/events", "/api/v1/fleet", "/metrics"])
def test_a_read_token_guards_reads(guarded: tuple[httpx.Client, str], path: str) -> None:
    client, agent_token = guarded

    assert client.get(path).status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get(path, headers={"Authorization": f"Bearer {agent_token}"}).status_code == 403
    assert client.get(path, headers={"Authorization": "Bearer reader-secret"}).status_code == 200


def test_a_read_token_does_not_guard_ingest_or_health(guarded: tuple[httpx.Client, str]) -> None:
    client, agent_token = guarded

    pushed = client.post(
        "/api/v1/snapshots",
        json=body(snapshot(0, [gpu(0)])),
        headers={"Authorization": f"Bearer {agent_token}"},
    )

    assert pushed.status_code == 200
    assert client.get("/healthz").status_code == 200
