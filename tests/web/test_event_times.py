"""One event dated long ago no longer ruins the events chart.

The audit posted an OOM with ``occurred_at`` 0 (an OOM's time is its sender's word,
and any local user can send one through the agent): the default events chart spanned
1970 to now, every real event was drawn in the same 2 pixels, and the axis had about
3,000 labels (14,202 with ``since=0&until=8589934592``). The server now refuses a
reported event older than its retention window, and the chart keeps at most 7 labels
whatever its span and starts at the events shown, less the oldest 5 %.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from server.harness import make_token
from sqlalchemy import select

from gpuwatch.server.events.schemas import EventOut
from gpuwatch.server.events.service import record_reported_event
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.web.charts import Mark, event_timeline
from gpuwatch.server.web.templates.events import events_table
from gpuwatch.server.web.templates.layout import Chrome
from gpuwatch.wire import ReportedEvent
from web.conftest import Site, running_site

DAY = 86400
HOST = "chart-host"


def oom(pid: int, at: float, host: str = HOST) -> dict[str, Any]:
    return {"kind": "oom", "hostname": host, "gpu_index": 0, "pid": pid,
            "summary": f"OOM {pid}", "evidence": {}, "occurred_at": at}  # fmt: skip


@pytest.fixture(scope="module")
def dated_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Site, str]]:
    with running_site(tmp_path_factory.mktemp("dated")) as site:
        yield site, make_token(site.database, HOST, site.clock())


def post(site: Site, token: str, event: dict[str, Any]) -> Any:
    return site.client.post(
        "/api/v1/events", json=event, headers={"Authorization": f"Bearer {token}"}
    )


def test_an_event_older_than_the_retention_window_is_refused(
    dated_site: tuple[Site, str],
) -> None:
    site, token = dated_site
    now, retention = site.clock(), site.settings.retention_days * DAY
    for at in (0.0, 1.0, now - retention - 1):
        refused = post(site, token, oom(11, at))
        assert refused.status_code == 422, refused.text
        (problem,) = refused.json()["detail"]
        assert problem["type"] == "clock_skew" and problem["loc"] == ["body", "occurred_at"]
        assert "retention_days" in problem["msg"]
    assert post(site, token, oom(12, now - retention + 60)).status_code == 200
    assert post(site, token, oom(13, now + 599)).status_code == 200
    assert post(site, token, oom(14, now + 601)).status_code == 422


def ticks(html: str) -> list[str]:
    """The time axis labels of the events page's chart."""
    chart = re.search(r'<svg class="chart timeline".*?</svg>', html, re.S)
    assert chart is not None
    return re.findall(r'<text class="tick"[^>]*>([^<]*)</text>', chart.group(0))


def test_one_event_from_1970_leaves_the_default_chart_to_the_others(
    dated_site: tuple[Site, str],
) -> None:
    """An event stored before the bound (an older server) or dated at the window's
    edge: the chart starts at the others, its labels stay few, the others spread."""
    site, _ = dated_site
    host, now = "chart-host-2", site.clock()
    token = make_token(site.database, host, now)
    old = post(site, token, oom(99, now - site.settings.retention_days * DAY + 60, host))
    assert old.status_code == 200
    for pid in range(100, 122):
        at = now - 3600 + (pid - 100) * 120
        assert post(site, token, oom(pid, at, host)).status_code == 200
    with site.database.writer() as session:
        host_id = session.scalars(select(Host.id).where(Host.hostname == host)).one()
        report = ReportedEvent.model_validate(oom(7, 0.0, host))
        record_reported_event(session=session, host_id=host_id, report=report, dialect="sqlite")
        session.commit()

    page = site.client.get("/events", params={"host": host}).text

    assert "1970-01-01 00:00:00Z" in page  # listed
    assert "the chart spans 1970" not in page
    assert "listed events lie outside it and are not drawn" in page
    assert 2 <= len(ticks(page)) <= 8
    xs = {float(x) for x in re.findall(r'<rect class="mark" x="([\d.]+)"', page)}
    assert len(xs) > 20  # each event in its place, not all in the same 2 pixels


def test_the_widest_filter_range_draws_a_few_labels_with_their_year(
    dated_site: tuple[Site, str],
) -> None:
    site, _ = dated_site
    page = site.client.get("/events", params={"since": "0", "until": str(2**33)})
    assert page.status_code == 200
    labels = ticks(page.text)
    assert 2 <= len(labels) <= 8 and all(re.fullmatch(r"\d{4}-\d\d-\d\d", t) for t in labels)
    assert len(page.text) < 200_000


@pytest.mark.parametrize("span", [60.0, 3600.0, 40 * DAY, 400 * DAY, 2.0**33])
def test_a_time_axis_has_at_most_seven_labels_whatever_its_span(span: float) -> None:
    until = 2.0**33
    svg = event_timeline(
        [(Mark("oom", until - span / 2, until - span / 2, "x", 1), "h")],
        since=until - span,
        until=until,
        width=1100,
    )
    assert 1 <= svg.count('<text class="tick"') <= 7


def _idle_event(*, started_at: float, last_seen_at: float, ended_at: float | None) -> EventOut:
    return EventOut(
        id=1, kind="idle", reason="idle", hostname=HOST, gpu_index=0, gpu_uuid="GPU-1",
        pid=42, user="dave", held_bytes=2**30, evidence={},
        summary="holds 1.0 GiB with no SM activity for 18 s",
        started_at=started_at, last_seen_at=last_seen_at, ended_at=ended_at,
        open=ended_at is None,
    )  # fmt: skip


def test_an_open_events_row_shows_how_long_it_has_lasted_and_when_its_summary_was_written() -> None:
    """The audit: an open idle event read "no SM activity for 3.3 min" while its
    process's flag said "idle 29 min": a summary's figures are as of the detector's
    last look, not now. The row says how long the event has been open, now, and, once
    its summary is over a minute old, when it was written."""
    now = 10_000.0
    chrome = Chrome(root="", now=now, firing=0, sign_out=False)
    stale = _idle_event(started_at=now - 1800, last_seen_at=now - 600, ended_at=None)
    fresh = _idle_event(started_at=now - 1800, last_seen_at=now - 15, ended_at=None)
    ended = _idle_event(started_at=now - 1800, last_seen_at=now - 600, ended_at=now - 600)
    cells = [
        re.findall(r"<td>(.*?)</td>", events_table(chrome, [ev], with_host=False))
        for ev in (stale, fresh, ended)
    ]
    lasted, summary = cells[0][1], cells[0][-1]
    assert lasted == '<span class="badge open">open</span> 30 min'
    assert summary.endswith("(as of 10 min ago)</span>")
    assert "as of" not in cells[1][-1] and "as of" not in cells[2][-1]
    assert cells[2][1] == "20 min"  # an ended event: how long it lasted
