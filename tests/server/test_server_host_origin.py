"""The server against a web page in a browser on the same host.

Before the fix, with the default settings (listen on 127.0.0.1, no read or admin
token), a page whose name re-resolved to 127.0.0.1 (DNS rebinding) read the fleet's
history and created a year-long silence of every alert, and a page from another
origin could POST to it. Real HTTP against a real server (uvicorn), and chromium where
it is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.headless import dump_dom

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database
from gpuwatch.settings import ServerSettings
from server.harness import FakeClock, serve

SILENCE = {
    "matchers": [{"name": "hostname", "value": ".*", "regex": True}],
    "duration_seconds": 31_000_000,
    "created_by": "evil",
    "comment": "mute everything",
}
OTHER_ORIGIN = "http://127.0.0.2:18080"
READ_TOKEN = "read-" + "r" * 40


@contextmanager
def running(
    settings: ServerSettings, database: Database, clock: FakeClock, **overrides: Any
) -> Iterator[tuple[str, int]]:
    configured = ServerSettings(
        data_dir=settings.data_dir,
        database_url=settings.database_url,
        scheduler=False,
        **overrides,
    )
    app = create_app(configured, clock=clock, engine=database.engine)
    with serve(app) as url:
        yield url, int(url.rsplit(":", 1)[1])


def _silences(url: str) -> list[Any]:
    silences: list[Any] = httpx.get(f"{url}/api/v1/silences", timeout=10).json()
    return silences


# -- DNS rebinding: a foreign Host on a loopback listener -----------------------------------


@pytest.mark.parametrize(
    "path", ["/api/v1/processes", "/api/v1/hosts", "/api/v1/silences", "/", "/healthz"]
)
def test_a_foreign_host_name_is_refused_on_loopback(live, path: str) -> None:
    port = live.url.rsplit(":", 1)[1]
    refused = live.client.get(path, headers={"Host": f"evil.test:{port}"})
    assert refused.status_code == 421
    assert "evil.test" in refused.json()["detail"]
    assert "allowed_hosts" in refused.json()["detail"]
    ok = live.client.get(path, headers={"Host": f"localhost:{port}"})
    assert ok.status_code == 200


def test_a_rebound_page_cannot_silence_every_alert(live) -> None:
    """The audit's request: same-origin for the page, whose name now means 127.0.0.1."""
    port = live.url.rsplit(":", 1)[1]
    response = live.client.post(
        "/api/v1/silences",
        json=SILENCE,
        headers={"Host": f"evil.test:{port}", "Origin": f"http://evil.test:{port}"},
    )
    assert response.status_code == 421
    assert _silences(live.url) == []


def test_a_configured_name_is_answered(settings, database, clock) -> None:
    with running(settings, database, clock, allowed_hosts=["GPUWATCH.example.org"]) as (
        url,
        port,
    ):
        named = httpx.get(
            f"{url}/api/v1/processes", headers={"Host": "gpuwatch.example.org"}, timeout=10
        )
        assert named.status_code == 200
        assert (
            httpx.get(
                f"{url}/api/v1/processes", headers={"Host": f"evil.test:{port}"}, timeout=10
            ).status_code
            == 421
        )
        # Behind a TLS proxy that passes the browser's Host, and one that rewrites it.
        for host in ("gpuwatch.example.org", f"127.0.0.1:{port}"):
            created = httpx.post(
                f"{url}/api/v1/silences",
                json={**SILENCE, "duration_seconds": 60},
                headers={"Host": host, "Origin": "https://gpuwatch.example.org"},
                timeout=10,
            )
            assert created.status_code == 201, created.text
        assert len(_silences(url)) == 2


def test_a_wildcard_listener_answers_any_host_unless_names_are_set(
    settings, database, clock
) -> None:
    with running(settings, database, clock, listen="0.0.0.0:9403") as (url, _):
        response = httpx.get(f"{url}/api/v1/hosts", headers={"Host": "gpuwatch-1"}, timeout=10)
        assert response.status_code == 200
    with running(settings, database, clock, listen="0.0.0.0:9403", allowed_hosts=["gw"]) as (
        url,
        _,
    ):
        assert httpx.get(f"{url}/healthz", headers={"Host": "gw:80"}, timeout=10).status_code == 200
        assert (
            httpx.get(f"{url}/healthz", headers={"Host": "10.0.0.7"}, timeout=10).status_code == 200
        )
        refused = httpx.get(f"{url}/healthz", headers={"Host": "evil.test"}, timeout=10)
        assert refused.status_code == 421


# -- cross-site changes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": OTHER_ORIGIN},
        {"Origin": "null"},
        {"Origin": "http://127.0.0.1:1"},  # same host, another port: another origin
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ],
    ids=["other-origin", "null-origin", "other-port", "cross-site", "same-site"],
)
def test_a_cross_site_change_is_refused(live, headers: dict[str, str]) -> None:
    response = live.client.post("/api/v1/silences", json=SILENCE, headers=headers)
    assert response.status_code == 403 and "cross" in response.json()["detail"]
    # A "simple" request, as a page's form or no-cors fetch sends it.
    simple = live.client.post(
        "/api/v1/silences",
        content=b'{"matchers": [], "duration_seconds": 60}',
        headers={**headers, "Content-Type": "text/plain"},
    )
    assert simple.status_code == 403
    assert _silences(live.url) == []


def test_same_origin_changes_and_agents_still_work(live) -> None:
    port = live.url.rsplit(":", 1)[1]
    own = live.client.post(
        "/api/v1/silences",
        json=SILENCE,
        headers={"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"},
    )
    assert own.status_code == 201, own.text
    plain = live.client.post("/api/v1/silences", json=SILENCE)  # gpuwatch's CLI: no Origin
    assert plain.status_code == 201
    assert len(_silences(live.url)) == 2
    # An agent's push (httpx, no Origin) is unaffected.
    token = live.token("host-1")
    push = live.client.post(
        "/api/v1/snapshots",
        json={"snapshots": []},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert push.status_code not in (403, 421), push.text


def test_the_dashboard_login_works_from_its_own_page_only(settings, database, clock) -> None:
    with running(settings, database, clock, read_token=READ_TOKEN) as (url, port):
        browser_headers = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
        with httpx.Client(base_url=url, timeout=10, follow_redirects=False) as client:
            signed_in = client.post(
                "/login", data={"token": READ_TOKEN, "next": "/"}, headers=browser_headers
            )
            assert signed_in.status_code == 303
            assert client.get("/").status_code == 200  # the cookie works
            out = client.post("/logout", headers=browser_headers)
            assert out.status_code in (200, 303)
        with httpx.Client(base_url=url, timeout=10, follow_redirects=False) as client:
            forged = client.post(
                "/login",
                data={"token": READ_TOKEN, "next": "/"},
                headers={"Origin": OTHER_ORIGIN, "Sec-Fetch-Site": "cross-site"},
            )
            assert forged.status_code == 403 and "set-cookie" not in forged.headers


# -- in a real browser ----------------------------------------------------------------------


def test_a_rebound_name_cannot_read_the_history_in_a_browser(live, tmp_path: Path) -> None:
    """rebind_demo.sh: chromium resolves evil.test to 127.0.0.1, as a rebinding DNS
    server makes it after the attacker's page has loaded."""
    port = live.url.rsplit(":", 1)[1]
    dom = dump_dom(
        f"http://evil.test:{port}/api/v1/processes?limit=2",
        tmp_path / "chromium",
        "--host-resolver-rules=MAP evil.test 127.0.0.1",
    )
    assert "Host 'evil.test:" in dom and '"items"' not in dom, dom[-300:]
