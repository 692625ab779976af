"""A real local HTTP server standing in for the gpuwatch agent, and a snapshot for it.

The server is ``http.server`` on an ephemeral port in a thread: ``GET /snapshot``
answers with whatever the test put in ``agent.snapshot`` (a HostSnapshot, raw bytes,
or an HTTP status), and every POST body is recorded per path.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

GIB = 2**30
COLLECTED_AT = 1_700_010_000.0


def shared_gpu_snapshot() -> HostSnapshot:
    """One 24 GiB GPU: a forgotten notebook (20 GiB, idle) and a small trainer."""
    notebook = GpuProcess(
        pid=4242,
        used_bytes=20 * GIB,
        sm_ratio=0.0,
        name="python",
        command="python -m ipykernel_launcher -f kernel-1.json",
        start_time=COLLECTED_AT - 3 * 3600 - 300,
        jupyter_kernel=True,
        owner=ProcessOwner(user="alice", uid=1000),
    )
    trainer = GpuProcess(
        pid=5151,
        used_bytes=2 * GIB,
        sm_ratio=0.9,
        name="python",
        command="python train.py",
        start_time=COLLECTED_AT - 600,
        owner=ProcessOwner(user="bob", uid=1001),
    )
    return HostSnapshot(
        agent_id="agent-1",
        hostname="gpu-box",
        boot_id="boot-1",
        sequence=3,
        collected_at=COLLECTED_AT,
        gpus=[
            Gpu(
                index=0,
                uuid="GPU-0",
                name="NVIDIA GeForce RTX 4090",
                memory_total_bytes=24 * GIB,
                memory_used_bytes=22 * GIB,
                memory_free_bytes=2 * GIB,
                processes=[trainer, notebook],
            )
        ],
    )


@dataclass
class FakeAgent:
    """State of the running server; tests set ``snapshot`` and read ``posts``."""

    url: str = ""
    snapshot: HostSnapshot | bytes | int = field(default_factory=shared_gpu_snapshot)
    posts: dict[str, list[Any]] = field(default_factory=dict)
    received: threading.Event = field(default_factory=threading.Event)


def _handler(agent: FakeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/snapshot":
                self.send_error(404)
                return
            body = agent.snapshot
            if isinstance(body, int):
                self.send_error(body)
                return
            payload = body.model_dump_json().encode() if isinstance(body, HostSnapshot) else body
            self._reply(200, payload)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            agent.posts.setdefault(self.path, []).append(json.loads(self.rfile.read(length)))
            agent.received.set()
            self._reply(202, b"{}")

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    return Handler


def start(state: FakeAgent) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve ``state`` on an ephemeral 127.0.0.1 port; sets ``state.url``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    return server, thread
