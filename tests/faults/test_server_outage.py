"""The central service down for 5 minutes, 2 hours, and longer than the spool holds.

Real parts: the agent's reporter and spool on disk, the real server on SQLite over real
HTTP, with a cuttable TCP proxy between them. One fake clock is the agent's poll
cadence, its backoff timer and the server's "now", so two hours of outage take as long
as the requests do. The agent loop is played as the agent runs it: a poll every push
interval offers a snapshot, and the push thread drains when its backoff allows.

The promise checked after each outage, by counting rows in ``snapshots_seen``:
delivered + dropped-with-reason = collected, every delivered snapshot is stored, and
no snapshot is stored twice, including the one whose reply was lost on the way back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clock import FakeClock

from faults.central import (
    PUSH_INTERVAL,
    T0,
    Central,
    central,
    delivered,
    dropped,
    host_snapshot,
    reporter,
)
from faults.proxy import TcpProxy, proxy_to
from gpuwatch.agent.reporter import BACKOFF_MAX_SECONDS, Reporter

MINUTE = 60.0
HOUR = 3600.0
HEALTHY_BEFORE = 2 * MINUTE


class Agent:
    """The agent's loop at push cadence: offer a poll, then drain if the backoff allows."""

    def __init__(self, reporter: Reporter, clock: FakeClock) -> None:
        self.reporter, self.clock = reporter, clock
        self.collected = 0
        self.attempts_while_down = 0

    def run_for(self, seconds: float) -> int:
        """Poll and push for ``seconds``; the number of push attempts made."""
        attempts = 0
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.reporter.offer(host_snapshot(self.collected, self.clock.now))
            self.collected += 1
            if self.reporter.drain_once().stopped_by != "backoff":
                attempts += 1
            self.clock.advance(PUSH_INTERVAL)
        return attempts

    def drain(self, *, tries: int = 20) -> None:
        """Let the push thread retry (backoff honoured) until the spool is empty."""
        for _ in range(tries):
            result = self.reporter.drain_once()
            if result.stopped_by is None:
                return
            self.clock.advance(result.retry_in_seconds or 1.0)
        raise AssertionError(f"spool not drained: {self.reporter.stats()}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def server(tmp_path: Path, clock: FakeClock) -> Iterator[Central]:
    with central(f"sqlite:///{tmp_path / 'central.db'}", tmp_path, clock) as c:
        yield c


def outage(
    server: Central, tmp_path: Path, clock: FakeClock, *, down_for: float, spool_bytes: int
) -> tuple[Agent, TcpProxy]:
    """Two healthy minutes, ``down_for`` seconds unreachable, then back up (its first
    reply lost after it has stored the batch), drained, and a minute more."""
    with proxy_to(server.address) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"
        agent = Agent(
            reporter(url, server.token(), tmp_path / "spool", clock, max_bytes=spool_bytes), clock
        )
        try:
            agent.run_for(HEALTHY_BEFORE)
            assert agent.reporter.stats().pending == 0
            proxy.down()
            agent.attempts_while_down = agent.run_for(down_for)
            proxy.lose_replies = 1
            proxy.up()
            agent.drain()
            agent.run_for(MINUTE)
            agent.drain()
        finally:
            agent.reporter.close()
    return agent, proxy


@pytest.mark.parametrize("down_for", [5 * MINUTE, 2 * HOUR], ids=["5min", "2h"])
def test_an_outage_the_spool_holds_loses_nothing_and_stores_nothing_twice(
    server: Central, tmp_path: Path, clock: FakeClock, down_for: float
) -> None:
    agent, proxy = outage(server, tmp_path, clock, down_for=down_for, spool_bytes=64 * 2**20)
    stats = agent.reporter.stats()

    stored = server.stored()
    assert stats.pending == 0 and stats.dropped_total == {}
    assert delivered(stats) == agent.collected
    assert sorted(server.sequences()) == list(range(agent.collected))
    assert max(stored.values()) == 1  # the batch whose reply was lost is stored once...
    assert stats.pushed_total["duplicate"] > 0  # ...though it was sent twice
    assert proxy.lose_replies == 0
    # Backed off while down (equal jitter: at least half the 60 s cap between tries),
    # and kept trying (at most the cap between tries), so the return is noticed.
    tries = agent.attempts_while_down
    assert down_for / BACKOFF_MAX_SECONDS - 1 <= tries <= down_for / (BACKOFF_MAX_SECONDS / 2) + 8


def test_an_outage_longer_than_the_spool_drops_the_oldest_and_counts_them(
    server: Central, tmp_path: Path, clock: FakeClock
) -> None:
    # The smallest spool the settings allow (64 KiB) holds ~35 of these polls: under
    # 9 minutes. The server is away for 3 hours (720 polls).
    agent, _ = outage(server, tmp_path, clock, down_for=3 * HOUR, spool_bytes=2**16)
    stats = agent.reporter.stats()

    stored = server.stored()
    lost = sorted(set(range(agent.collected)) - server.sequences())
    assert stats.pending == 0
    assert delivered(stats) + dropped(stats) == agent.collected
    assert set(stats.dropped_total) == {"spool_full"}
    assert len(lost) == dropped(stats) > 650
    # Exactly the oldest of the outage went: the polls of the healthy minutes were
    # delivered before it, then one unbroken run of losses, then everything since.
    first_lost = HEALTHY_BEFORE / PUSH_INTERVAL
    assert lost == list(range(int(first_lost), int(first_lost) + len(lost)))
    assert max(stored.values()) == 1
    assert sum(stored.values()) == agent.collected - len(lost)
