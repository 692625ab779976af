"""The agent's reporter against the real server: the two sides agree on the protocol."""

from __future__ import annotations

from pathlib import Path

from pydantic import SecretStr

from gpuwatch.agent.reporter import Reporter
from gpuwatch.settings import AgentSettings
from server.factories import gpu, process, snapshot
from server.harness import Live


def test_a_resent_snapshot_is_acknowledged_as_a_duplicate(live: Live, tmp_path: Path) -> None:
    token = live.token("host-1")
    settings = AgentSettings(
        server_url=live.url,
        token=SecretStr(token),
        spool_dir=tmp_path / "spool",
        push_interval_seconds=1,
    )
    reporter = Reporter(settings)
    try:
        first = snapshot(1, [gpu(0, [process(7)])])
        live.clock.now = first.collected_at
        reporter.offer(first)
        reporter.drain_once()
        reporter.offer(first)  # e.g. re-sent after a response was lost
        reporter.drain_once()
        stats = reporter.stats()
    finally:
        reporter.close()
    assert stats.pushed_total == {"accepted": 1, "duplicate": 1}
    assert stats.dropped_total == {} and stats.pending == 0
