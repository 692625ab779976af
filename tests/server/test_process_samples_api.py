"""``GET /api/v1/processes/{id}/samples``: a lifetime's coarse buckets, as ingest wrote them.

Snapshots are pushed through the real ingest API to a live server on both databases;
the buckets read back are what the downsampling made of them (floor, peak, busiest
SM), and :class:`~gpuwatch.server.client.HistoryClient` reads them the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from gpuwatch.errors import AuthError, NotFound
from gpuwatch.server.app import create_app
from gpuwatch.server.client import HistoryClient
from gpuwatch.server.database import Database
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.ingest.apply import host_bucket
from gpuwatch.settings import ServerSettings
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import FakeClock, Live, make_token, serve

START = T0 - 5000.0


def _first_bucket(live: Live, hostname: str = "host-1") -> float:
    """The start of the host's bucket holding T0: buckets follow the host's own phase."""
    with live.database.reader() as session:
        host_id = session.scalars(select(Host.id).where(Host.hostname == hostname)).one()
    start = host_bucket(T0, host_id=host_id, interval=60)
    assert T0 - 60 < start <= T0
    return start


def _push_minutes(live: Live, token: str, sm_by_minute: list[float | None]) -> float:
    """One snapshot every 15 s from the start of the host's first bucket; return that
    start. ``sm_by_minute[m]`` is pid 7's SM in bucket m, its memory 4 GiB, then 6 GiB
    at the last poll of each bucket."""
    first = _first_bucket(live)
    snaps = []
    for i in range(len(sm_by_minute) * 4 + 1):
        minute = min(i // 4, len(sm_by_minute) - 1)
        used = 6 if i % 4 == 3 else 4
        proc = process(7, used_gib=used, sm=sm_by_minute[minute], start_time=START)
        snaps.append(snapshot(i, [gpu(0, [proc])], at=first + 15 * i))
    assert live.push(token, body(*snaps)).status_code == 200
    return first


def _lifetime_id(live: Live) -> int:
    (item,) = live.client.get("/api/v1/processes", params={"host": "host-1"}).json()["items"]
    assert item["pid"] == 7 and item["start_time"] == START
    return int(item["id"])


def test_buckets_come_back_oldest_first_with_floor_peak_and_busiest_sm(live: Live) -> None:
    token = live.token("host-1")
    first = _push_minutes(live, token, [0.0, 0.0, 0.3, None, 0.0])
    lifetime_id = _lifetime_id(live)

    got = live.client.get(f"/api/v1/processes/{lifetime_id}/samples")

    assert got.status_code == 200, got.text
    page = got.json()
    assert page["lifetime"]["pid"] == 7 and page["lifetime"]["gpu_index"] == 0
    assert page["sample_interval_seconds"] == 60
    assert page["truncated"] is False
    samples = page["samples"]
    # Five closed minutes; the sixth (one poll so far) is still being filled.
    assert [s["t"] for s in samples] == [first + 60 * m for m in range(5)]
    assert [s["sm_ratio"] for s in samples] == [0.0, 0.0, 0.3, None, 0.0]
    assert {(s["used_bytes"], s["peak_bytes"]) for s in samples} == {(4 * GIB, 6 * GIB)}


def test_since_until_and_limit_keep_the_newest(live: Live) -> None:
    first = _push_minutes(live, live.token("host-1"), [0.0] * 6)
    url = f"/api/v1/processes/{_lifetime_id(live)}/samples"

    window = live.client.get(url, params={"since": first + 60, "until": first + 240}).json()
    newest = live.client.get(url, params={"limit": 2}).json()

    assert [s["t"] for s in window["samples"]] == [first + 60, first + 120, first + 180]
    assert window["truncated"] is False
    assert [s["t"] for s in newest["samples"]] == [first + 240, first + 300]
    assert newest["truncated"] is True


def test_unknown_lifetime_is_404_and_bad_values_422(live: Live) -> None:
    assert live.client.get("/api/v1/processes/99/samples").status_code == 404
    assert live.client.get("/api/v1/processes/0/samples").status_code == 422
    assert live.client.get("/api/v1/processes/1/samples?limit=0").status_code == 422


def test_history_client_reads_samples(live: Live) -> None:
    first = _push_minutes(live, live.token("host-1"), [0.0, 0.5])
    lifetime_id = _lifetime_id(live)

    with HistoryClient(live.url) as client:
        page = client.process_samples(lifetime_id, since=first)
        with pytest.raises(NotFound):
            client.process_samples(lifetime_id + 100)

    assert page.lifetime.id == lifetime_id
    assert [(s.t, s.sm_ratio) for s in page.samples] == [(first, 0.0), (first + 60, 0.5)]


@pytest.fixture
def guarded(tmp_path: Path, clock: FakeClock, sqlite_url: str) -> Iterator[tuple[str, str]]:
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade

    database: Database = create_database(sqlite_url)
    upgrade(database)
    settings = ServerSettings(data_dir=tmp_path, scheduler=False, read_token="reader-secret")
    token = make_token(database, "host-1")
    with serve(create_app(settings, clock=clock, engine=database.engine)) as url:
        yield url, token
    database.dispose()


def test_the_read_token_guards_samples_and_an_agent_token_cannot_read(
    guarded: tuple[str, str],
) -> None:
    url, agent_token = guarded
    path = "/api/v1/processes/1/samples"

    assert httpx.get(url + path).status_code == 401
    assert (
        httpx.get(url + path, headers={"Authorization": f"Bearer {agent_token}"}).status_code == 403
    )
    # Authorised, and there is no lifetime 1 yet.
    assert (
        httpx.get(url + path, headers={"Authorization": "Bearer reader-secret"}).status_code == 404
    )
    with HistoryClient(url, token=agent_token) as client, pytest.raises(AuthError):
        client.process_samples(1)
