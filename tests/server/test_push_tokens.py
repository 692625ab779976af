"""A token read from a file or the environment usually ends in a newline. The clients
(``gpuwatch history`` / ``alerts`` and the agent's pushes) strip it; one that still
cannot be a header value is refused up front; and no error ever shows the token (it
was printed whole, and reported as "cannot reach the server", since httpx and urllib
refuse the header quoting it)."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from gpuwatch.agent.http_post import Poster, Unreachable
from gpuwatch.agent.push import ServerSink
from gpuwatch.agent.reporter import Reporter
from gpuwatch.bearer import without_secrets
from gpuwatch.errors import ConfigError, RemoteError
from gpuwatch.server.client import AlertsClient, HistoryClient
from gpuwatch.settings import AgentSettings
from server.factories import gpu, process, snapshot
from server.harness import Live

SECRET = "gwt_SECRETSECRET"


@pytest.mark.parametrize("given", [SECRET + "\n", f"  {SECRET}\r\n", "\t" + SECRET])
def test_the_history_client_strips_the_token(given: str) -> None:
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Authorization"])
        return httpx.Response(200, json={"items": [], "next_cursor": None})

    with HistoryClient("http://server", token=given, transport=httpx.MockTransport(answer)) as c:
        assert c.events(limit=10) == []

    assert seen == [f"Bearer {SECRET}"]


@pytest.mark.parametrize("given", [f"gwt_A\nB{SECRET}", f"gwt_A B{SECRET}", f"t\u00f6ken{SECRET}"])
def test_a_token_that_cannot_be_a_header_is_refused_without_showing_it(given: str) -> None:
    for client in (HistoryClient, AlertsClient):
        with pytest.raises(ConfigError) as raised:
            client("http://server", token=given)
        assert SECRET not in str(raised.value)
        assert "never has" in str(raised.value)


def test_a_transport_error_quoting_the_header_does_not_show_the_token() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.LocalProtocolError(f"Illegal header value b'Bearer {SECRET}'")

    client = AlertsClient("http://server", token=SECRET, transport=httpx.MockTransport(refuse))
    with client, pytest.raises(RemoteError) as raised:
        client.alerts()

    assert SECRET not in str(raised.value)
    assert raised.value.__cause__ is None  # nor in a chained traceback


def test_the_agent_pushes_with_a_token_read_with_its_newline(
    live: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = live.token("host-1")
    sent = snapshot(1, [gpu(0, [process(100)])])
    live.clock.now = sent.collected_at
    settings = AgentSettings(
        server_url=live.url, token=SecretStr(token + "\n"), spool_dir=tmp_path / "spool"
    )
    caplog.set_level(logging.DEBUG)
    reporter = Reporter(settings)
    try:
        reporter.offer(sent)
        drained = reporter.drain_once()
    finally:
        reporter.close()

    assert drained.stopped_by is None and drained.pending == 0
    assert token not in caplog.text
    assert live.client.get("/api/v1/hosts/host-1").status_code == 200


def test_the_agent_refuses_at_startup_a_token_that_cannot_be_a_header(tmp_path: Path) -> None:
    settings = AgentSettings(
        server_url="http://127.0.0.1:9",
        token=SecretStr(f"gwt_A\x01{SECRET}"),
        spool_dir=tmp_path / "spool",
    )
    for sink in (Reporter, ServerSink):
        with pytest.raises(ConfigError) as raised:
            sink(settings)
        assert SECRET not in str(raised.value)


def test_the_posters_errors_never_quote_the_authorization_header() -> None:
    headers = {"Authorization": f"Bearer {SECRET}\n"}
    with pytest.raises(Unreachable) as raised:
        Poster(timeout_seconds=1).post("http://127.0.0.1:9/x", b"{}", headers)
    assert SECRET not in str(raised.value)
    assert raised.value.__cause__ is None
    assert SECRET not in without_secrets(f"b'Bearer {SECRET}\\n'", headers)
