"""The CLI's client of the server API: what each bad --server and each odd answer
becomes. A URL no request can use is an option error (exit 3) before any request; a 404
that no route gave (a wrong base path) is not "no such silence"; a 2xx page that is not
JSON says so, whatever status the call expected."""

from __future__ import annotations

import httpx
import pytest

from gpuwatch.errors import ConfigError, NotFound, RemoteError
from gpuwatch.server.alerts.schemas import MatcherIn, SilenceIn
from gpuwatch.server.client import AlertsClient, HistoryClient
from server.harness import Live


@pytest.mark.parametrize(
    "url",
    ["ftp://host", "127.0.0.1:9403", "", "  ", "http://", "http://127.0.0.1:99999", "http://[::1"],
)
def test_a_server_url_no_request_can_use_is_refused_before_any_request(url: str) -> None:
    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    transport = httpx.MockTransport(record)
    for client in (HistoryClient, AlertsClient):
        with pytest.raises(ConfigError, match="--server"):
            client(url, transport=transport)
    assert sent == []


def test_filters_that_are_not_utf8_are_refused_by_their_option_name() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(500))
    with HistoryClient("http://server", transport=transport) as client:
        with pytest.raises(ConfigError, match=r"^--host is not valid UTF-8 text"):
            client.processes(limit=1, host="\udcff\udcfe")
        with pytest.raises(ConfigError, match=r"^--user is not valid UTF-8 text"):
            client.events(limit=1, user="\udcff")
    with (
        AlertsClient("http://server", transport=transport) as alerts,
        pytest.raises(ConfigError, match=r"^the receiver name is not valid UTF-8 text"),
    ):
        alerts.test_receiver("\udcff")


def _answering(status: int, body: bytes, content_type: str) -> httpx.MockTransport:
    return httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"Content-Type": content_type})
    )


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        (404, b'{"detail":"Not Found"}', "application/json"),  # FastAPI: no such route
        (404, b"<html>404 Not Found</html>", "text/html"),  # a proxy's page
    ],
)
def test_a_404_no_route_gave_is_not_no_such_silence(
    status: int, body: bytes, content_type: str
) -> None:
    transport = _answering(status, body, content_type)
    with AlertsClient("http://server/gpuwatch", transport=transport) as client:
        with pytest.raises(RemoteError) as expired:
            client.expire_silence(1)
        with pytest.raises(RemoteError) as tested:
            client.test_receiver("team-a")
    for raised in (expired, tested):
        assert not isinstance(raised.value, NotFound)
        assert "has no API route" in str(raised.value)
        assert "is --server the gpuwatch server's base URL?" in str(raised.value)


def test_a_routes_own_404_is_not_found() -> None:
    transport = _answering(404, b'{"detail":"no silence 1"}', "application/json")
    with (
        AlertsClient("http://server", transport=transport) as client,
        pytest.raises(NotFound, match="no silence 1"),
    ):
        client.expire_silence(1)


def test_a_2xx_page_that_is_not_json_says_so_whatever_status_was_expected() -> None:
    silence = SilenceIn(
        matchers=[MatcherIn(name="hostname", value="h", regex=False)],
        starts_at=None,
        ends_at=None,
        duration_seconds=60.0,
        created_by="me",
        comment="c",
    )
    transport = _answering(200, b"<html>Welcome to nginx!</html>", "text/html")
    with AlertsClient("http://server", transport=transport) as client:
        # Before: "answered HTTP 200: OK", since create expects a 201.
        with pytest.raises(
            RemoteError, match=r"did not answer JSON \(HTTP 200\); is it a gpuwatch"
        ):
            client.create_silence(silence)
        with pytest.raises(RemoteError, match="did not answer JSON"):
            client.silences()


def test_against_a_real_server_a_wrong_base_path_is_told_apart_from_a_missing_silence(
    live: Live,
) -> None:
    with AlertsClient(live.url + "/gpuwatch") as wrong, pytest.raises(RemoteError) as raised:
        wrong.expire_silence(1)
    assert not isinstance(raised.value, NotFound)
    assert "has no API route /api/v1/silences/1" in str(raised.value)
    with AlertsClient(live.url) as right, pytest.raises(NotFound, match="no silence 1"):
        right.expire_silence(1)
