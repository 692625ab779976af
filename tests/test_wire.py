"""The wire contract: one model per body, shared by both ends, its limits consistent."""

from __future__ import annotations

import subprocess
import sys
from typing import get_type_hints

import pytest
from pydantic import ValidationError
from support.snapshots import sample_snapshot

from gpuwatch import wire
from gpuwatch.snapshot import MAX_BYTES, MAX_PID
from gpuwatch.wire import (
    MAX_EVENT_SUMMARY_CHARS,
    MAX_INCIDENT_BODY,
    MAX_OOM_MESSAGE_CHARS,
    MAX_SNAPSHOTS_PER_REQUEST,
    MAX_TORCH_BODY,
    IngestRequest,
    IngestResponse,
    OomIncident,
    ReportedEvent,
    TorchReport,
    ingest_request_json,
)


@pytest.mark.parametrize("dropped", [0, 7, 2**62])
@pytest.mark.parametrize("count", [1, 3])
def test_the_prebuilt_batch_is_exactly_the_models_json(count: int, dropped: int) -> None:
    snapshots = [
        sample_snapshot().model_copy(update={"sequence": n, "hostname": f"h\u00e9-{n}"})
        for n in range(count)
    ]
    prebuilt = ingest_request_json([s.model_dump_json().encode() for s in snapshots], dropped)
    model = IngestRequest(snapshots=snapshots, spool_dropped_total=dropped)
    assert prebuilt == model.model_dump_json().encode()
    assert IngestRequest.model_validate_json(prebuilt) == model


def test_the_batch_is_bounded() -> None:
    too_many = [sample_snapshot()] * (MAX_SNAPSHOTS_PER_REQUEST + 1)
    with pytest.raises(ValidationError):
        IngestRequest(snapshots=too_many)
    with pytest.raises(ValidationError):
        IngestRequest(snapshots=[])


def test_answers_ignore_fields_a_newer_server_adds() -> None:
    answer = b'{"accepted": 1, "duplicate": 0, "results": ["accepted"], "new": true}'
    assert IngestResponse.model_validate_json(answer).accepted == 1


def test_bodies_refuse_unknown_fields_and_out_of_range_values() -> None:
    with pytest.raises(ValidationError):
        OomIncident.model_validate({"pid": 1, "message": "oom", "extra": 1})
    with pytest.raises(ValidationError):
        OomIncident(pid=1, message="x" * (MAX_OOM_MESSAGE_CHARS + 1))
    with pytest.raises(ValidationError):
        TorchReport.model_validate(
            {"pid": 0, "device_index": 0, "allocated_bytes": 0, "reserved_bytes": 0,
             "reserved_unallocated_bytes": 0, "peak_allocated_bytes": 0, "reported_at": 1.0}
        )  # fmt: skip
    with pytest.raises(ValidationError):
        ReportedEvent(
            kind="oom", hostname="h", summary="x" * (MAX_EVENT_SUMMARY_CHARS + 1), occurred_at=1
        )
    with pytest.raises(ValidationError):
        ReportedEvent.model_validate(
            {"kind": "idle", "hostname": "h", "summary": "", "occurred_at": 1}
        )


def test_the_largest_valid_bodies_fit_their_size_limits() -> None:
    # A valid body must never be refused by the agent's byte limit: a longest message
    # of 4-byte characters, with a diagnosis, still fits.
    incident = OomIncident(
        pid=MAX_PID,
        device_index=63,
        message="\U0001f525" * MAX_OOM_MESSAGE_CHARS,
        explanation={"recognized": True, "diagnoses": [{"fix": "x" * 200}] * 50},
        occurred_at=2.0**33,
    )
    assert len(incident.model_dump_json().encode()) < MAX_INCIDENT_BODY
    report = TorchReport(
        pid=MAX_PID, device_index=63, allocated_bytes=MAX_BYTES, reserved_bytes=MAX_BYTES,
        reserved_unallocated_bytes=MAX_BYTES, peak_allocated_bytes=MAX_BYTES, reported_at=2.0**33,
    )  # fmt: skip
    assert len(report.model_dump_json().encode()) < MAX_TORCH_BODY


def test_the_server_serves_the_wire_paths_with_the_wire_models() -> None:
    from gpuwatch.server.events import views as events_views
    from gpuwatch.server.ingest import views as ingest_views

    ingest = {route.path: route for route in ingest_views.router.routes}  # type: ignore[attr-defined]
    assert wire.SNAPSHOTS_PATH in ingest
    events = {
        (route.path, tuple(route.methods)): route  # type: ignore[attr-defined]
        for route in events_views.router.routes
    }
    post = events[(wire.EVENTS_PATH, ("POST",))]
    hints = get_type_hints(post.endpoint)  # type: ignore[attr-defined]
    assert hints["body"] is ReportedEvent and hints["return"] is wire.ReportedEventResult


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        # Loaded in every process that speaks the contract: nothing beyond pydantic, and
        # the leaf of units whose bounds the scenario files share.
        (
            "gpuwatch.wire",
            {"gpuwatch", "gpuwatch.quantities", "gpuwatch.snapshot", "gpuwatch.wire"},
        ),
        # Loaded inside training processes: nothing of the server or the agent.
        ("gpuwatch.torch", None),
    ],
)
def test_the_contract_pulls_in_no_side(module: str, allowed: set[str] | None) -> None:
    code = f"""
import sys, {module}
loaded = set(sys.modules)
heavy = {{"fastapi", "starlette", "sqlalchemy", "alembic", "uvicorn", "torch"}}
assert not heavy & {{m.split(".")[0] for m in loaded}}, sorted(heavy & loaded)
assert not [m for m in loaded if m.startswith(("gpuwatch.server", "gpuwatch.agent"))]
allowed = {allowed!r}
if allowed is not None:
    assert {{m for m in loaded if m.startswith("gpuwatch")}} <= allowed
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
