"""Who may fill the agent's store of allocator reports (``POST /torch``).

The figures are shown as a process's own, in the snapshot and the metrics, under its
owner's name: only that owner or root may send them, and no one poster may push
everyone else's reports out of the bounded store. The poster's uid is the kernel's
(``/proc/net/tcp``), as for OOM incidents.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from reaper.rig import ALICE, BOB, Victim, victims_fixture
from support.snapshots import sample_snapshot

from gpuwatch.agent import exporter as exporter_module
from gpuwatch.agent import torch_reports
from gpuwatch.agent.collectors.agent import AgentCollector
from gpuwatch.agent.collectors.registry import ScrapeRenderer
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.incident_origin import IncidentOrigin
from gpuwatch.agent.procinfo import process_uid
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import TORCH_PATH, TorchReport

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="posting as other uids needs root and setpriv",
)


def _body(pid: int, at: float | None = None) -> dict[str, object]:
    return {
        "pid": pid, "device_index": 0, "allocated_bytes": 1, "reserved_bytes": 2,
        "reserved_unallocated_bytes": 1, "peak_allocated_bytes": 1,
        "reported_at": time.time() if at is None else at,
    }  # fmt: skip


@pytest.fixture
def served() -> Iterator[tuple[Exporter, TorchReports]]:
    state = AgentState()
    state.record_poll(sample_snapshot())
    reports = TorchReports()
    renderer = ScrapeRenderer([], [AgentCollector(state)], sequence=lambda: 1)
    exp = Exporter(
        ("127.0.0.1", 0),
        render_metrics=renderer.render,
        state=state,
        torch_reports=reports,
        poll_interval_seconds=5,
    )
    exp.start()
    yield exp, reports
    exp.stop()


@pytest.fixture
def victims() -> Iterator[Callable[..., Victim]]:
    yield from victims_fixture()


_POST = (
    "import sys, httpx; "
    "r = httpx.post(sys.argv[1], content=sys.argv[2], "
    "headers={'content-type': 'application/json'}); print(r.status_code, r.text)"
)


def post_as(uid: int, url: str, body: dict[str, object]) -> tuple[int, str]:
    """POST ``body`` from a process running as ``uid`` (as ``curl`` would)."""
    command = [sys.executable, "-c", _POST, url + TORCH_PATH, json.dumps(body)]
    if uid != os.geteuid():
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
    status, _, text = done.stdout.strip().partition(" ")
    assert status.isdigit(), done.stderr
    return int(status), text


@NEEDS_ROOT
def test_only_the_owner_or_root_may_report_on_a_process(
    served: tuple[Exporter, TorchReports], victims: Callable[..., Victim]
) -> None:
    exp, reports = served
    alices = victims(uid=ALICE)
    status, text = post_as(BOB, exp.url, _body(alices.pid))  # the audit's forgery
    assert status == 403
    assert f"pid {alices.pid} belongs to uid {ALICE}" in json.loads(text)["error"]
    assert reports.get(alices.pid, 0, start_time=None) is None
    assert post_as(ALICE, exp.url, _body(alices.pid))[0] == 204
    assert post_as(0, exp.url, _body(alices.pid))[0] == 204  # root speaks for anyone
    assert reports.get(alices.pid, 0, start_time=None) is not None


def test_a_poster_who_is_not_the_owner_is_refused(
    served: tuple[Exporter, TorchReports], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without root: the kernel's answer for the poster is replaced, the owner is real
    # (this test process).
    exp, reports = served
    stranger = IncidentOrigin("127.0.0.1:1", os.getuid() + 4343, None)
    monkeypatch.setattr(exporter_module.IncidentOrigin, "of_peer", lambda *a, **k: stranger)
    response = httpx.post(exp.url + TORCH_PATH, json=_body(os.getpid()))
    assert response.status_code == 403 and "neither its owner nor root" in response.text
    assert reports.get(os.getpid(), 0, start_time=None) is None
    unknown = IncidentOrigin("127.0.0.1:1", None, None)  # the kernel could not say
    monkeypatch.setattr(exporter_module.IncidentOrigin, "of_peer", lambda *a, **k: unknown)
    assert httpx.post(exp.url + TORCH_PATH, json=_body(os.getpid())).status_code == 403


def test_process_uid_reads_the_real_uid(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "status").write_text("Name:\tpython\nUid:\t4242\t0\t0\t0\n")
    assert process_uid(77, proc_root=tmp_path) == 4242  # the real uid, not the effective
    assert process_uid(78, proc_root=tmp_path) is None
    assert process_uid(os.getpid()) == os.getuid()


def test_one_posters_flood_evicts_only_its_own_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    store = TorchReports()
    store.record(TorchReport.model_validate(_body(10)), poster_uid=ALICE)
    for pid in range(1000, 1000 + torch_reports.MAX_ENTRIES):  # the audit's 4,096 made-up pids
        store.record(TorchReport.model_validate(_body(pid)), poster_uid=BOB)
    assert store.get(10, 0, start_time=None) is not None
    kept = [
        p for p in range(1000, 1000 + torch_reports.MAX_ENTRIES) if store.get(p, 0, start_time=None)
    ]
    assert len(kept) == torch_reports.MAX_ENTRIES_PER_POSTER
    assert kept[-1] == 1000 + torch_reports.MAX_ENTRIES - 1  # its newest


def test_a_full_store_evicts_from_its_largest_poster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_reports, "MAX_ENTRIES", 6)
    monkeypatch.setattr(torch_reports, "MAX_ENTRIES_PER_POSTER", 4)
    store = TorchReports()
    for pid in (1, 2):
        store.record(TorchReport.model_validate(_body(pid)), poster_uid=ALICE)
    for pid in range(100, 110):
        store.record(TorchReport.model_validate(_body(pid)), poster_uid=BOB)
    for pid in (3, 4, 5):
        store.record(TorchReport.model_validate(_body(pid)), poster_uid=0)
    alive = {p for p in [1, 2, 3, 4, 5, *range(100, 110)] if store.get(p, 0, start_time=None)}
    # Bob held 4 (his quota) and gave way twice; then root held the most (3) and lost
    # its oldest: each poster keeps its newest, alice's untouched.
    assert alive == {1, 2, 4, 5, 108, 109}


def test_the_flood_through_the_endpoint_keeps_others_reports(
    served: tuple[Exporter, TorchReports], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_reports, "MAX_ENTRIES_PER_POSTER", 4)
    exp, reports = served
    with httpx.Client() as client:
        assert client.post(exp.url + TORCH_PATH, json=_body(os.getpid())).status_code == 204
        flooder = IncidentOrigin("127.0.0.1:1", os.getuid() + 4343, None)
        monkeypatch.setattr(exporter_module.IncidentOrigin, "of_peer", lambda *a, **k: flooder)
        for pid in range(4_000_000, 4_000_020):  # PIDs that run nothing: taken, as its own
            assert client.post(exp.url + TORCH_PATH, json=_body(pid)).status_code == 204
    assert reports.get(os.getpid(), 0, start_time=None) is not None
    assert (
        sum(reports.get(p, 0, start_time=None) is not None for p in range(4_000_000, 4_000_020))
        == 4
    )


def test_a_report_dated_in_the_future_cannot_pass_for_a_later_process() -> None:
    # Sent for a PID before another process takes it, dated an hour ahead: the PID-reuse
    # check (reported before the process started) must still see it as older.
    store = TorchReports()
    store.record(TorchReport.model_validate(_body(10, at=time.time() + 3600)))
    started_later = time.time() + 1
    assert store.get(10, 0, start_time=started_later) is None
