"""A fleet whose agents push at different intervals: each host's silence is counted in
its own agent's interval (``Gpuwatch-Push-Interval``), over real HTTP on both databases.

Before, every host was judged by the server's ``agent_push_interval_seconds``: an agent
pushing every minute beside 15-second ones was silent between every two of its pushes
(flapping ``agent_silent``), and one set to push faster was judged at the slow pace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwatch.agent.reporter import Reporter
from gpuwatch.server.jobs import close_stale_lifetimes, detect_silent_agents
from gpuwatch.settings import AgentSettings, ServerSettings
from gpuwatch.wire import PUSH_INTERVAL_HEADER, push_interval_of
from server.factories import T0, body, gpu, process, snapshot
from server.harness import Live

# The server's default: 15 s, silent after 4 of them (60 s).
SETTINGS = ServerSettings(agent_push_interval_seconds=15, agent_silent_intervals=4)
_tokens: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _fresh_tokens() -> None:
    _tokens.clear()  # each test has a database of its own


def _push(live: Live, hostname: str, seq: int, interval: str | None) -> httpx.Response:
    """One snapshot of ``hostname`` (a token made for it on first use), collected at T0
    plus ``seq`` seconds, with ``interval`` in the header (None: no header)."""
    headers = {"Authorization": f"Bearer {_tokens.setdefault(hostname, live.token(hostname))}"}
    if interval is not None:
        headers[PUSH_INTERVAL_HEADER] = interval
    pushed = snapshot(seq, [gpu(0, [process(7)])], hostname=hostname, at=T0 + seq)
    return live.client.post("/api/v1/snapshots", json=body(pushed), headers=headers)


def _silent_hosts(live: Live, now: float) -> set[str]:
    detect_silent_agents(database=live.database, settings=SETTINGS, now=now)
    events = live.client.get("/api/v1/events", params={"kind": "agent_silent", "open": "true"})
    assert events.status_code == 200, events.text
    return {e["hostname"] for e in events.json()["items"]}


def _flagged_silent(live: Live) -> dict[str, Any]:
    hosts = live.client.get("/api/v1/hosts").json()
    return {h["hostname"]: h["silent"] for h in hosts}


def test_each_host_is_silent_after_its_own_intervals(live: Live) -> None:
    pushes = {"every-minute": "60", "every-15s": "15", "says-nothing": None, "every-5s": "5"}
    for hostname, interval in pushes.items():
        response = _push(live, hostname, 0, interval)
        assert response.status_code == 200, response.text

    # 30 s: only the 5-second agent has missed four pushes.
    assert _silent_hosts(live, T0 + 30) == {"every-5s"}
    # 90 s: the 15-second ones (told or by default) too; the one-minute agent has
    # missed one push, not four.
    assert _silent_hosts(live, T0 + 90) == {"every-5s", "every-15s", "says-nothing"}
    live.clock.now = T0 + 90
    assert _flagged_silent(live) == {
        "every-minute": False,
        "every-15s": True,
        "says-nothing": True,
        "every-5s": True,
    }
    # Four minutes and more: everyone.
    assert _silent_hosts(live, T0 + 241) == set(pushes)


def test_a_value_outside_the_agents_range_is_ignored(live: Live) -> None:
    # Not refused (the snapshots are stored), and the server's interval applies.
    for n, interval in enumerate(["0", "-15", "3601", "nan", "inf", "soon", ""]):
        response = _push(live, f"host-{n}", 0, interval)
        assert response.status_code == 200, (interval, response.text)
    assert _silent_hosts(live, T0 + 61) == {f"host-{n}" for n in range(7)}


def test_the_latest_interval_reported_wins(live: Live) -> None:
    assert _push(live, "host-1", 0, "300").status_code == 200
    assert _push(live, "host-1", 1, "15").status_code == 200  # the agent was reconfigured
    assert _silent_hosts(live, T0 + 61) == {"host-1"}


def test_stale_lifetimes_wait_for_a_slow_hosts_own_silence(live: Live) -> None:
    # A host pushing every 10 minutes holds its processes open between its pushes;
    # one at the default interval has them ended after five minutes of silence.
    assert _push(live, "slow", 0, "600").status_code == 200
    assert _push(live, "fast", 0, None).status_code == 200
    closed = close_stale_lifetimes(database=live.database, settings=SETTINGS, now=T0 + 301)
    assert closed == 1
    processes = live.client.get("/api/v1/processes", params={"open": "true"}).json()["items"]
    assert {p["hostname"] for p in processes} == {"slow"}
    assert close_stale_lifetimes(database=live.database, settings=SETTINGS, now=T0 + 2401) == 1


def test_the_agent_reports_its_interval_to_the_server(live: Live, tmp_path: Path) -> None:
    # The real reporter, pushing to the real server: the host is judged in the agent's
    # 60 s from its first push on.
    settings = AgentSettings(
        server_url=live.url,
        token=live.token("host-1"),
        push_interval_seconds=60,
        spool_dir=tmp_path / "spool",
    )
    reporter = Reporter(settings, wall_clock=lambda: T0)
    try:
        reporter.offer(snapshot(0, [gpu(0, [process(7)])], at=T0))
        assert reporter.drain_once().delivered == 1
    finally:
        reporter.close()
    assert _silent_hosts(live, T0 + 61) == set()
    assert _silent_hosts(live, T0 + 241) == {"host-1"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("15", 15.0),
        (" 60 ", 60.0),
        ("0.5", 0.5),
        ("3600", 3600.0),
        ("0", None),
        ("3600.5", None),
        ("nan", None),
        ("-inf", None),
        ("1e309", None),
        ("fifteen", None),
        (None, None),
    ],
)
def test_the_header_value_is_a_number_of_seconds_in_range(
    value: str | None, expected: float | None
) -> None:
    assert push_interval_of(value) == expected
