"""Counters with a known set of label values are on the agent's /metrics at 0 from the
first scrape, so Prometheus sees a single burst as an increase (a series born at its
first increment shows none to rate() or increase()). And the known sets are complete:
every value the reporter and the spool really count under is among them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from support.clock import FakeClock
from support.snapshots import sample_snapshot

from agent.answering import Received, answering
from gpuwatch.agent.collectors.agent import (
    BATCH_RESULTS,
    DROP_REASONS,
    POLL_RESULTS,
    PUSH_RESULTS,
)
from gpuwatch.agent.push import ServerSink
from gpuwatch.agent.reporter import Reporter
from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Every counter with a finite set of label values, and that set.
KNOWN = {
    "gpuwatch_agent_polls_total": ("result", POLL_RESULTS),
    "gpuwatch_agent_snapshots_pushed_total": ("result", PUSH_RESULTS),
    "gpuwatch_agent_push_batches_total": ("result", BATCH_RESULTS),
    "gpuwatch_agent_snapshots_dropped_total": ("reason", DROP_REASONS),
}


class StubSampler:
    """The seam below the agent: a poll returns a fixed snapshot, numbered in turn."""

    def __init__(self) -> None:
        self.sequence = 0

    def poll(self) -> HostSnapshot:
        self.sequence += 1
        return sample_snapshot().model_copy(update={"sequence": self.sequence})


def _settings(tmp_path: Path, **overrides: object) -> AgentSettings:
    values: dict[str, object] = {
        "listen": "127.0.0.1:0",
        # Nothing listens on the discard port: the server is away for the whole test.
        "server_url": "http://127.0.0.1:9",
        "token": SecretStr("t" * 32),
        "spool_dir": tmp_path / "spool",
    }
    return AgentSettings(**{**values, **overrides})  # type: ignore[arg-type]


@dataclass
class Running:
    agent: Agent
    monotonic: FakeClock
    push_interval_seconds: float


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    """The agent as `gpuwatch agent` builds it (exporter, renderer, server sink, spool),
    serving /metrics, with its poll loop and push thread not started."""
    monotonic = FakeClock(0.0)
    settings = _settings(tmp_path, spool_max_bytes=2**16)
    agent = Agent(
        settings,
        sampler=StubSampler(),
        state=AgentState(),
        torch_reports=TorchReports(),
        sink=ServerSink(settings),
        monotonic=monotonic,
    )
    agent.exporter.start()
    yield Running(agent, monotonic, settings.push_interval_seconds)
    agent.exporter.stop()


def _scrape(agent: Agent) -> Samples:
    response = httpx.get(f"{agent.exporter.url}/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _counter(samples: Samples, name: str) -> dict[str, float]:
    label, _ = KNOWN[name]
    return {dict(labels)[label]: value for (n, labels), value in samples.items() if n == name}


def test_before_anything_happened_every_known_series_is_there_at_zero(running: Running) -> None:
    samples = _scrape(running.agent)

    for name, (_, values) in KNOWN.items():
        assert _counter(samples, name) == dict.fromkeys(values, 0.0), name
    assert samples[("gpuwatch_agent_torch_reports_total", ())] == 0
    # Gauges that stand for "not known yet" stay absent, not 0.
    assert ("gpuwatch_agent_last_push_success_timestamp_seconds", ()) not in samples
    assert ("gpuwatch_agent_last_poll_timestamp_seconds", ()) not in samples


def test_one_spool_overflow_moves_its_series_up_from_zero(running: Running) -> None:
    """What GpuwatchAgentDroppingSnapshots sees: 0 on every scrape, then a single burst."""
    agent = running.agent
    before = _scrape(agent)
    # The server is away; a poll every push interval fills the 64 KiB spool.
    polls = 0
    while _counter(_scrape(agent), "gpuwatch_agent_snapshots_dropped_total")["spool_full"] == 0:
        agent.poll_once()
        running.monotonic.advance(running.push_interval_seconds)
        polls += 1
        assert polls < 1000, "the spool never overflowed"
    after = _scrape(agent)

    dropped = _counter(after, "gpuwatch_agent_snapshots_dropped_total")
    assert _counter(before, "gpuwatch_agent_snapshots_dropped_total")["spool_full"] == 0
    assert dropped["spool_full"] >= 1
    assert {r: n for r, n in dropped.items() if r != "spool_full"} == dict.fromkeys(
        set(DROP_REASONS) - {"spool_full"}, 0.0
    )
    assert _counter(after, "gpuwatch_agent_polls_total") == {"success": polls, "failure": 0}


# --- the known sets are the ones the code counts under ------------------------------------


def _answer(status: int | str, request: Received) -> tuple[int, bytes]:
    """The server's answer to one push: a status, or a 200 saying which it had already."""
    if isinstance(status, int):
        return status, b"{}"
    if status == "clock_skew":  # refused as from the server's future: the agent keeps it
        problem = {"detail": [{"type": "clock_skew", "loc": ["body", "snapshots", 0]}]}
        return 422, json.dumps(problem).encode()
    sent = len(json.loads(request.body)["snapshots"])
    duplicate = sent if status == "duplicate" else 0
    body = {"accepted": sent - duplicate, "duplicate": duplicate, "results": [status] * sent}
    return 200, json.dumps(body).encode()


def test_the_reporter_counts_batches_and_pushes_only_under_known_results(
    tmp_path: Path,
) -> None:
    answers: list[int | str] = [
        "accepted", "duplicate", "late", "deferred", 401, 403, 413, 422, 429, 500, 503, 418,
        "clock_skew",
    ]  # fmt: skip
    batches: set[str] = set()
    pushed: set[str] = set()
    for answer in [*answers, "unreachable"]:
        with answering(lambda r, a=answer: _answer(a, r)) as server:  # type: ignore[misc]
            # "unreachable": the default URL, where nothing listens.
            url = {} if answer == "unreachable" else {"server_url": server.url}
            reporter = Reporter(_settings(tmp_path / str(answer), **url))
            try:
                reporter.offer(sample_snapshot())
                reporter.drain_once()
                stats = reporter.stats()
            finally:
                reporter.close()
        batches |= set(stats.batches_total)
        pushed |= set(stats.pushed_total)
    assert batches == set(BATCH_RESULTS)
    assert pushed == set(PUSH_RESULTS)


def test_the_reporter_and_spool_drop_only_under_known_reasons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write the spool refuses waits in memory; with no room there it is dropped.
    monkeypatch.setattr("gpuwatch.agent.reporter.MEMORY_QUEUE_SNAPSHOTS", 0)
    dropped: set[str] = set()
    for status in (413, 422):  # one snapshot the server refuses: too_large, rejected
        with answering(lambda r, s=status: (s, b"{}")) as server:  # type: ignore[misc]
            reporter = Reporter(_settings(tmp_path / str(status), server_url=server.url))
            try:
                reporter.offer(sample_snapshot())
                reporter.drain_once()
                dropped |= set(reporter.stats().dropped_total)
            finally:
                reporter.close()

    # A snapshot spooled under another name, then the host renamed: hostname_changed.
    renamed_dir = tmp_path / "renamed"
    earlier = Reporter(_settings(tmp_path, spool_dir=renamed_dir))
    try:
        earlier.offer(sample_snapshot().model_copy(update={"hostname": "old-name"}))
    finally:
        earlier.close()
    with answering(lambda r: (503, b"{}")) as server:
        reporter = Reporter(_settings(tmp_path, spool_dir=renamed_dir, server_url=server.url))
        try:
            reporter.offer(sample_snapshot())
            reporter.drain_once()
            dropped |= set(reporter.stats().dropped_total)
        finally:
            reporter.close()

    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / f"{7:020d}.tmp").write_bytes(b"{")  # a write a crash cut short: corrupt
    # Nothing is sent: offers only spool, and no drain runs.
    reporter = Reporter(_settings(tmp_path, spool_max_bytes=2**16))
    try:
        (spool_dir / f"{0:020d}.tmp").mkdir()  # the next record's temp name is taken
        reporter.offer(sample_snapshot())  # write_failed
        for sequence in range(1, 100):  # the server is away: spool_full
            reporter.offer(sample_snapshot().model_copy(update={"sequence": sequence}))
        dropped |= set(reporter.stats().dropped_total)
    finally:
        reporter.close()

    assert dropped == set(DROP_REASONS)
