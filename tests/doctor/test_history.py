"""The server's last hour on a GPU, as `gpuwatch explain` asks for it: best effort, never an error."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from doctor.cli_run import run
from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.history import WINDOW_SECONDS, fetch_gpu_history
from gpuwatch.doctor.report import render

EVENT = {
    "id": 1, "kind": "idle", "reason": "idle", "hostname": "box", "gpu_index": 0, "gpu_uuid": "GPU-0",
    "pid": 4242, "user": "alice", "held_bytes": 20 * 2**30, "summary": "alice's kernel holds 20 GiB, idle 3h",
    "evidence": {}, "started_at": 100.0, "last_seen_at": 200.0, "ended_at": None, "open": True,
}  # fmt: skip


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    seen: list[dict[str, list[str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            seen.append(parse_qs(url.query))
            answers = {"/api/v1/events": {"items": [EVENT], "next_cursor": None}}
            body = json.dumps(answers.get(url.path, {"items": 5} if "odd" in url.path else [1]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def test_asks_for_this_gpu_over_the_last_hour(server) -> None:
    url, seen = server
    events = fetch_gpu_history(url, hostname="box", gpu_index=0, now=10_000.0)
    assert events is not None and events[0].user == "alice"
    assert seen[0]["host"] == ["box"] and seen[0]["gpu"] == ["0"]
    assert float(seen[0]["since"][0]) == 10_000.0 - WINDOW_SECONDS


def test_no_server_means_no_history_not_an_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    assert (
        fetch_gpu_history(f"http://127.0.0.1:{port}", hostname="box", gpu_index=0, now=1.0) is None
    )


@pytest.mark.parametrize("path", ["/elsewhere", "/odd"], ids=["a-list", "items-not-a-list"])
def test_an_answer_that_is_not_an_event_page_is_ignored(server, path: str) -> None:
    url, _ = server
    assert fetch_gpu_history(url + path, hostname="box", gpu_index=0, now=1.0) is None


def test_report_shows_the_history(server) -> None:
    url, _ = server
    explanation = explain(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 1.12 GiB is free."
    )
    explanation.history = fetch_gpu_history(url, hostname="box", gpu_index=0, now=1.0)
    text = render(explanation)
    assert "In the last hour on this GPU" in text and "alice's kernel holds 20 GiB" in text


def test_a_message_from_another_host_asks_the_server_nothing(
    server, capsys: pytest.CaptureFixture[str]
) -> None:
    url, seen = server
    text = "node-elsewhere-9:311:312 [1] NCCL WARN Cuda failure 'out of memory'"
    code, _, _ = run(["explain", "--text", text, "--no-live", "--server", url], capsys)
    assert code == 0
    assert seen == []  # this host's history is not that host's
    # The same text printed on this host is asked about.
    here = text.replace("node-elsewhere-9", socket.gethostname())
    code, _, _ = run(["explain", "--text", here, "--no-live", "--server", url], capsys)
    assert code == 0 and seen and seen[0]["gpu"] == ["1"]
