"""`gpuwatch demo`'s lines name who holds the memory, as the README promises: the user
and, for a process still running, its command. Before, a piped line said only
`idle/idle: holds 20.0 GiB ...`, and the live view only the user."""

from __future__ import annotations

import io

import httpx
from rich.console import Console

from gpuwatch.cli.demo_output import _plain
from gpuwatch.cli.demo_watch import Seen, Watch, render

NOTEBOOK = "python -m ipykernel_launcher -f /run/user/1001/kernel-7.json"
IDLE = {
    "id": 1, "kind": "idle", "reason": "idle", "hostname": "gpu-b", "gpu_index": 0,
    "pid": 4242, "user": "alice", "summary": "holds 20.0 GiB with no SM activity for 32 s",
    "open": True,
}  # fmt: skip
DEAD = {
    **IDLE, "id": 2, "kind": "orphaned", "reason": "dead_pid", "hostname": "gpu-c", "pid": 77,
    "user": None, "summary": "process 77 is gone but its GPU context still holds 6.0 GiB",
}  # fmt: skip
HOST_B = {
    "hostname": "gpu-b",
    "gpus": [
        {
            "index": 0,
            "memory_used_bytes": 60 * 2**30,
            "memory_total_bytes": 80 * 2**30,
            "processes": [
                {"pid": 4242, "user": "alice", "command": NOTEBOOK, "name": "python"},
                {"pid": 5151, "user": "bob", "command": "python train.py", "name": "python"},
            ],
        }
    ],
}


class _Server(httpx.MockTransport):
    def __init__(self) -> None:
        def answer(request: httpx.Request) -> httpx.Response:
            path = request.url.path
            if path == "/api/v1/hosts/gpu-b":
                return httpx.Response(200, json=HOST_B)
            if path == "/api/v1/events":
                return httpx.Response(200, json={"items": [IDLE, DEAD], "next_cursor": None})
            if path == "/api/v1/alerts":
                return httpx.Response(200, json=[])
            return httpx.Response(404, json={"detail": "no such host"})

        super().__init__(answer)


class _Sink:
    rejected = 0

    def received(self) -> list[object]:
        return []


def _watch() -> Watch:
    watch = Watch("http://demo.invalid", _Sink(), ["gpu-b", "gpu-c"], started=0.0)  # type: ignore[arg-type]
    watch.client = httpx.Client(base_url="http://demo.invalid", transport=_Server())
    return watch


def test_a_found_line_names_the_user_and_the_command() -> None:
    watch = _watch()
    lines = [line for line in watch.refresh() if line["event"] == "found"]
    idle = next(line for line in lines if line["kind"] == "idle")
    assert idle["command"] == NOTEBOOK and idle["user"] == "alice"
    shown = _plain(idle)
    assert "idle/idle: alice (python -m ipykernel_launcher" in shown, shown
    # A dead PID has neither: the line is as before, with no empty "()".
    dead = _plain(next(line for line in lines if line["kind"] == "orphaned"))
    assert "dead_pid: process 77 is gone" in dead and "()" not in dead


def test_a_process_alert_line_names_its_user() -> None:
    line = {
        "event": "alert", "at": 48.7, "rule": "idle_holder",
        "labels": {"user": "alice", "hostname": "gpu-b"},
        "summary": "GPU 0 on gpu-b: holds 20.0 GiB with no SM activity for 37 s (for 12 s)",
    }  # fmt: skip
    assert "idle_holder: alice: GPU 0 on gpu-b" in _plain(line)


def test_the_live_view_names_the_command_too() -> None:
    watch = _watch()
    watch.refresh()
    console = Console(width=160, height=40, record=True, file=io.StringIO())
    console.print(render(watch, stories={}, width=160, height=40))
    text = console.export_text()
    assert "alice (python -m ipykernel" in text, text
    assert isinstance(watch.seen, Seen)
