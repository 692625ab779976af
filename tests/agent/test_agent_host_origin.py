"""The agent's port against a web page in a browser on the same host.

Before the fix the agent looked at neither ``Host`` nor ``Origin``: a page whose name
re-resolved to 127.0.0.1 (DNS rebinding) read every user's command lines from
``/snapshot`` and ``/reaper/history``, and a page from any other origin POSTed a
``text/plain`` OOM incident (no CORS preflight for that) that the agent forwarded as the
browser's user's. Real HTTP against a real agent (``Agent`` from its settings), and,
where chromium is installed, a real browser.
"""

from __future__ import annotations

import http.server
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.agent_sink import RecordingSink
from support.headless import chromium_binary, dump_dom
from support.snapshots import sample_snapshot

from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.settings import AgentSettings, load
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import INCIDENTS_OOM_PATH, TORCH_PATH

NOW = 1_700_010_100.0
INCIDENT = {"pid": 5151, "device_index": 0, "message": "CUDA out of memory. forged"}
# The audit's page: another origin on this host (rebind_csrf.html).
OTHER_ORIGIN = "http://127.0.0.2:18080"


class NeverPolled:
    def poll(self) -> HostSnapshot:
        raise AssertionError("these tests do not poll")


@contextmanager
def running_agent(tmp_path: Path, **settings: Any) -> Iterator[tuple[Agent, RecordingSink, int]]:
    sink = RecordingSink()
    state = AgentState()
    state.record_poll(sample_snapshot())
    agent = Agent(
        load(AgentSettings, spool_dir=tmp_path, **{"listen": "127.0.0.1:0", **settings}),
        sampler=NeverPolled(),
        state=state,
        torch_reports=TorchReports(),
        sink=sink,
        clock=lambda: NOW,
    )
    agent.exporter.start()
    try:
        yield agent, sink, agent.exporter._server.server_address[1]
    finally:
        agent.exporter.stop()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Agent, RecordingSink, int]]:
    with running_agent(tmp_path) as running:
        yield running


def _get(port: int, path: str, host: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Host": host}, timeout=10)


def _post(port: int, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", timeout=10, **kwargs)


# -- DNS rebinding: a foreign Host on a loopback listener -----------------------------------


@pytest.mark.parametrize("path", ["/snapshot", "/reaper/history", "/metrics", "/healthz"])
def test_a_foreign_host_name_is_refused_on_loopback(agent, path: str) -> None:
    _, _, port = agent
    refused = _get(port, path, f"evil.test:{port}")
    assert refused.status_code == 421
    assert "evil.test" in refused.json()["error"] and "allowed_hosts" in refused.json()["error"]
    assert "python" not in refused.text and "5151" not in refused.text  # no command lines


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST.", "[::1]"])
def test_loopback_names_are_answered(agent, host: str) -> None:
    _, _, port = agent
    response = _get(port, "/snapshot", host.format(port=port))
    assert response.status_code == 200 and response.json()["hostname"]
    assert _get(port, "/reaper/history", host.format(port=port)).status_code == 200


def test_a_rebound_post_is_refused_before_it_is_forwarded(agent) -> None:
    _, sink, port = agent
    response = _post(
        port,
        INCIDENTS_OOM_PATH,
        json=INCIDENT,
        headers={"Host": f"evil.test:{port}", "Origin": f"http://evil.test:{port}"},
    )
    assert response.status_code == 421
    assert sink.events == []


def test_a_configured_name_is_answered(tmp_path: Path) -> None:
    with running_agent(tmp_path, allowed_hosts=["GPU-Node-01.example.org"]) as (_, sink, port):
        assert _get(port, "/snapshot", f"gpu-node-01.example.org:{port}").status_code == 200
        assert _get(port, "/snapshot", "gpu-node-01.example.org").status_code == 200
        assert _get(port, "/snapshot", f"evil.test:{port}").status_code == 421
        same_name = _post(
            port,
            INCIDENTS_OOM_PATH,
            json=INCIDENT,
            headers={
                "Host": f"gpu-node-01.example.org:{port}",
                "Origin": f"http://gpu-node-01.example.org:{port}",
            },
        )
        assert same_name.status_code == 202 and len(sink.events) == 1


def test_a_wildcard_listener_answers_any_host_unless_names_are_set(tmp_path: Path) -> None:
    # Reached by real names (Prometheus from elsewhere): tokens and the network guard it.
    with running_agent(tmp_path, listen="0.0.0.0:0") as (_, _, port):
        assert _get(port, "/metrics", f"gpu-node-01:{port}").status_code == 200
    with running_agent(tmp_path, listen="0.0.0.0:0", allowed_hosts=["gpu-node-01"]) as (
        _,
        _,
        port,
    ):
        assert _get(port, "/metrics", f"gpu-node-01:{port}").status_code == 200
        assert _get(port, "/metrics", f"10.1.2.3:{port}").status_code == 200  # by address
        assert _get(port, "/metrics", f"evil.test:{port}").status_code == 421


def test_a_dual_stack_listener_takes_local_ipv4_clients_as_local(tmp_path: Path) -> None:
    """On ``[::]`` a local IPv4 client arrives as ``::ffff:127.0.0.1``: before the fix
    the agent refused it /snapshot and gpuwatch.torch's OOM reports (403)."""
    if not socket.has_dualstack_ipv6():
        pytest.skip("this kernel has no dual-stack IPv6 sockets")
    with running_agent(tmp_path, listen="[::]:0") as (_, sink, port):
        assert _get(port, "/snapshot", f"127.0.0.1:{port}").status_code == 200
        assert _post(port, INCIDENTS_OOM_PATH, json=INCIDENT).status_code == 202
        [event] = sink.events
        assert event.evidence["reporter_uid"] == os.getuid()


# -- cross-site POSTs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": OTHER_ORIGIN},
        {"Origin": "null"},
        {"Origin": "http://127.0.0.1:1"},  # the same host, another port: another origin
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ],
    ids=["other-origin", "null-origin", "other-port", "cross-site", "same-site"],
)
def test_a_cross_site_post_is_refused(agent, headers: dict[str, str]) -> None:
    _, sink, port = agent
    response = _post(port, INCIDENTS_OOM_PATH, json=INCIDENT, headers=headers)
    assert response.status_code == 403 and "cross" in response.json()["error"]
    torch = _post(port, TORCH_PATH, json={"pid": 1}, headers=headers)
    assert torch.status_code == 403
    assert sink.events == []


def test_the_audits_forged_incident_is_refused(agent) -> None:
    """What rebind_csrf.html's fetch sends: text/plain, from another origin."""
    _, sink, port = agent
    response = _post(
        port,
        INCIDENTS_OOM_PATH,
        content=b'{"pid": 1, "device_index": 0, "message": "CUDA out of memory. forged"}',
        headers={
            "Content-Type": "text/plain;charset=UTF-8",
            "Origin": OTHER_ORIGIN,
            "Sec-Fetch-Site": "cross-site",
            "Sec-Fetch-Mode": "no-cors",
        },
    )
    assert response.status_code == 403
    assert sink.events == []


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"],
)
def test_an_incident_that_is_not_sent_as_json_is_refused(agent, content_type: str | None) -> None:
    # Without an Origin (an old browser, or a page that strips it): a browser can send
    # these three to any origin without asking; application/json it must ask about.
    _, sink, port = agent
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = b'{"pid": 5151, "device_index": 0, "message": "CUDA out of memory"}'
    response = _post(port, INCIDENTS_OOM_PATH, content=body, headers=headers)
    assert response.status_code == 415 and "application/json" in response.json()["error"]
    assert sink.events == []


def test_a_same_origin_json_incident_is_forwarded_as_its_posters(agent) -> None:
    """gpuwatch.torch's request (no Origin), and one with this agent's own origin, are
    still taken, and the poster's uid is still the kernel's (/proc/net/tcp)."""
    _, sink, port = agent
    plain = _post(port, INCIDENTS_OOM_PATH, json=INCIDENT)
    assert plain.status_code == 202
    own = _post(
        port,
        INCIDENTS_OOM_PATH,
        content=b'{"pid": 5151, "device_index": 0, "message": "CUDA out of memory"}',
        headers={
            "Content-Type": "application/json; charset=utf-8",
            "Origin": f"http://127.0.0.1:{port}",
            "Sec-Fetch-Site": "same-origin",
        },
    )
    assert own.status_code == 202
    assert len(sink.events) == 2
    for event in sink.events:
        assert event.evidence["reported_by"] == "agent-local"
        assert event.evidence["reporter_uid"] == os.getuid()


def test_a_refused_post_closes_its_connection(agent) -> None:
    """Its body was never read: on a kept-alive connection it would be parsed as the
    next request."""
    _, sink, port = agent
    body = b"GET /snapshot HTTP/1.1\r\nHost: evil.test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /incidents/oom HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        reply = b"".join(iter(lambda: conn.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 415") and reply.count(b"HTTP/1.1") == 1
    assert sink.events == []


# -- in a real browser ----------------------------------------------------------------------

_CSRF_PAGE = """<!doctype html><title>evil</title><pre id=o>waiting</pre><script>
fetch("http://127.0.0.1:%d/incidents/oom", {method: "POST", mode: "no-cors",
  headers: {"Content-Type": "text/plain"},
  body: JSON.stringify({pid: 5151, device_index: 0,
    message: "CUDA out of memory. Tried to allocate 20.00 GiB (forged by a web page)"})})
 .then(() => { document.getElementById("o").textContent = "sent"; })
 .catch(e => { document.getElementById("o").textContent = "error " + e; });
</script>
"""


@contextmanager
def _page_server(html: str, address: str) -> Iterator[str]:
    """``html`` served at ``/`` from ``address`` (another origin than the agent's)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((address, 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{address}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_from_another_origin_cannot_post_an_incident(agent, tmp_path: Path) -> None:
    """The audit's rebind_csrf.html, in chromium: the request reaches the agent (the
    page says "sent": no-cors hides the answer) and is refused."""
    chromium_binary()
    _, sink, port = agent
    with _page_server(_CSRF_PAGE % port, "127.0.0.2") as page:
        dom = dump_dom(page, tmp_path / "chromium")
    assert "sent" in dom, dom[-300:]
    assert sink.events == []


def test_a_rebound_name_cannot_read_the_snapshot_in_a_browser(agent, tmp_path: Path) -> None:
    """The audit's rebind_demo.sh: chromium resolves evil.test to 127.0.0.1, as a
    rebinding DNS server makes it; the page at evil.test reads its own origin."""
    chromium_binary()
    _, _, port = agent
    dom = dump_dom(
        f"http://evil.test:{port}/snapshot",
        tmp_path / "chromium",
        "--host-resolver-rules=MAP evil.test 127.0.0.1",
    )
    assert "Host 'evil.test:" in dom and "hostname" not in dom, dom[-300:]
