"""An OOM incident from gpuwatch.torch, through the agent, to the server's events API.

Both hops speak the wire models: the exporter validates the incident as an
``OomIncident``, the agent builds a ``ReportedEvent``, and the body the ServerSink
posts is one the server would read as a ``ReportedEvent``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.agent_sink import RecordingSink
from support.snapshots import sample_snapshot

from agent.answering import answering
from gpuwatch.agent.push import ServerSink
from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.settings import AgentSettings, load
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import (
    EVENTS_PATH,
    INCIDENTS_OOM_PATH,
    MAX_EVENT_SUMMARY_CHARS,
    ReportedEvent,
)

NOW = 1_700_010_100.0


class NeverPolled:
    def poll(self) -> HostSnapshot:
        raise AssertionError("these tests do not poll")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Agent, RecordingSink]]:
    sink = RecordingSink()
    state = AgentState()
    state.record_poll(sample_snapshot())
    running = Agent(
        load(AgentSettings, listen="127.0.0.1:0", spool_dir=tmp_path),
        sampler=NeverPolled(),
        state=state,
        torch_reports=TorchReports(),
        sink=sink,
        clock=lambda: NOW,
    )
    running.exporter.start()
    yield running, sink
    running.exporter.stop()


def test_an_incident_is_forwarded_as_a_reported_event_with_who_was_there(agent) -> None:
    running, sink = agent
    message = "CUDA out of memory. " + "x" * 5000
    response = httpx.post(
        running.exporter.url + INCIDENTS_OOM_PATH,
        json={
            "pid": 5151,
            "device_index": 0,
            "message": message,
            "explanation": {"recognized": True},
            "occurred_at": 1_700_010_000.0,
        },
    )
    assert response.status_code == 202
    (event,) = sink.events
    assert event.kind == "oom" and event.pid == 5151 and event.gpu_index == 0
    assert event.hostname == sample_snapshot().hostname
    assert event.summary == message[:MAX_EVENT_SUMMARY_CHARS]
    assert event.occurred_at == 1_700_010_000.0
    assert event.evidence["explanation"] == {"recognized": True}
    assert {p["pid"] for p in event.evidence["gpu"]["processes"]} >= {5151}
    assert event.evidence["reported_by"] == "agent-local"


def test_an_incident_without_a_time_gets_the_agents(agent) -> None:
    running, sink = agent
    httpx.post(running.exporter.url + INCIDENTS_OOM_PATH, json={"pid": 7, "message": "oom"})
    (event,) = sink.events
    assert event.occurred_at == NOW and event.gpu_index is None


def test_the_server_sink_posts_the_event_model(tmp_path: Path) -> None:
    event = ReportedEvent(
        kind="oom", hostname="gpu-box", pid=42, summary="CUDA out of memory", occurred_at=NOW
    )
    with answering(lambda r: (201, b'{"id": 1, "duplicate": false}')) as server:
        settings = load(AgentSettings, server_url=server.url, token="t0ken", spool_dir=tmp_path)
        sink = ServerSink(settings)
        sink.send_event(event).join(timeout=10)
        sink.reporter.close()
    (request,) = server.received
    assert request.path == EVENTS_PATH
    assert request.headers["authorization"] == "Bearer t0ken"
    assert request.headers["content-type"] == "application/json"
    assert ReportedEvent.model_validate_json(request.body) == event
    assert json.loads(request.body)["kind"] == "oom"


GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def test_an_incident_naming_its_gpu_by_uuid_lands_on_that_gpu(agent) -> None:
    # PyTorch's device 0 under CUDA_VISIBLE_DEVICES=1: the ordinal says 0, the UUID
    # (as torch prints it: no "GPU-") says NVML's GPU 1.
    running, sink = agent
    body = {"pid": 7, "message": "oom", "device_index": 0, "device_uuid": GPU1[4:]}
    assert httpx.post(running.exporter.url + INCIDENTS_OOM_PATH, json=body).status_code == 202
    unknown = {**body, "device_uuid": "GPU-not-on-this-host"}
    assert httpx.post(running.exporter.url + INCIDENTS_OOM_PATH, json=unknown).status_code == 202
    found, lost = sink.events
    assert found.gpu_index == 1 and found.evidence["gpu"]["uuid"] == GPU1
    assert found.evidence["device_uuid"] == GPU1[4:]
    assert lost.gpu_index is None and lost.evidence["gpu"] is None
