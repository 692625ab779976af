"""A heavy host's detail (the API's and the dashboard pages') is bounded, and keeps
every GPU's big holders: on SQLite and Postgres.

Audit findings: GET /api/v1/hosts/{name} listed every open process (8.7 MiB and 5-8 s
for 64 GPUs x 300 processes; the one-GPU page read them all); and the host page's
2,000-lifetime limit was the page's, not each chart's, so one GPU's short jobs left
another GPU's chart without the process that filled it.
"""

from __future__ import annotations

import pytest
from server.factories import T0, gpu, process, snapshot

from gpuwatch.server.database import Database
from gpuwatch.server.hosts import service as host_service
from gpuwatch.server.web import service
from gpuwatch.server.web.templates.detail import gpu_page, host_page
from gpuwatch.server.web.templates.layout import Chrome
from gpuwatch.settings import ServerSettings
from web import test_service

NOW = T0 + 3600
CHROME = Chrome(root="", now=NOW, firing=0, sign_out=False)
# The dashboard service tests' fixtures (both databases) and their way to store a push.
database = test_service.database
settings = test_service.settings
push = test_service.push


def test_each_gpu_chart_keeps_its_own_holders_whatever_another_gpu_ran(
    database: Database, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small limits, so the test stores few rows: five lifetimes a chart.
    monkeypatch.setattr(service, "MAX_LIFETIMES", 5)
    monkeypatch.setattr(service, "MAX_PAGE_LIFETIMES", 10, raising=False)
    monkeypatch.setattr(service, "MIN_CHART_LIFETIMES", 5, raising=False)
    long_job = process(4242, used_gib=30, start_time=T0 - 10)
    snaps = [
        # GPU 0: a short job a minute; GPU 1: one process that fills it throughout.
        snapshot(n, [gpu(0, [process(1000 + n, used_gib=1)]), gpu(1, [long_job])], at=T0 + 60 * n)
        for n in range(12)
    ]
    push(database, settings, snaps)

    with database.reader() as session:
        gpus = service.host_gpus(session=session, hostname="host-1")
        charts = service.histories(
            session=session, gpus=gpus, until=T0 + 720, seconds=3600, interval=60, columns=60
        )

    by_index = {g.gpu_index: charts[g.id] for g in gpus}
    assert [layer.pid for layer in by_index[1].layers] == [4242]
    assert len(by_index[0].layers) == 5


def test_a_host_detail_lists_each_gpus_largest_processes_and_counts_the_rest(
    database: Database, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_service, "MAX_PROCESSES_SHOWN", 3, raising=False)
    crowded = [process(100 + n, used_gib=1 + n) for n in range(5)]
    push(database, settings, [snapshot(1, [gpu(0, crowded), gpu(1, [process(7)])], at=NOW)])

    with database.reader() as session:
        detail = host_service.get_host(
            session=session, hostname="host-1", settings=settings, now=NOW
        )
        one_gpu = host_service.get_host(
            session=session, hostname="host-1", settings=settings, now=NOW, gpu_index=1
        )

    assert detail is not None and one_gpu is not None
    first, second = detail.gpus
    assert [p.pid for p in first.processes] == [104, 103, 102]  # the largest first
    assert (first.processes_total, first.processes_truncated) == (5, True)
    assert [p.pid for p in second.processes] == [7]
    assert (second.processes_total, second.processes_truncated) == (1, False)
    # A GPU's page reads only its GPU; the host still counts them all.
    assert [g.index for g in one_gpu.gpus] == [1] and one_gpu.gpu_count == 2

    host_html = host_page(CHROME, detail, {}, [], range_key="1h")
    assert "The 4 largest of 6 open processes" in host_html
    assert "5 processes" in host_html
    gpu_html = gpu_page(CHROME, detail, first, _empty_history(), [], range_key="1h")
    assert "The 3 largest of 5 open processes" in gpu_html
    assert "/api/v1/processes?host=host-1&amp;open=true&amp;gpu=0" in gpu_html


def _empty_history() -> service.History:
    return service.History(since=NOW - 3600, step=60, layers=[], used=[None] * 61, total_bytes=None)
