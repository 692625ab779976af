"""`gpuwatch history` against a live server, and its time expressions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta

import pytest
import typer

from gpuwatch.cli.history import parse_when
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import Live

GPUWATCH = [sys.executable, "-m", "gpuwatch"]
NOW = datetime(2026, 12, 1, 10, 0, 0).astimezone()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", NOW - timedelta(days=7)),
        ("12h", NOW - timedelta(hours=12)),
        ("90s", NOW - timedelta(seconds=90)),
        ("09:30", NOW.replace(hour=9, minute=30)),
        ("14:05", NOW.replace(hour=14, minute=5) - timedelta(days=1)),  # the latest past 14:05
        ("2026-11-30T08:15", datetime(2026, 11, 30, 8, 15).astimezone()),
        ("now", NOW),
    ],
)
def test_time_expressions(text: str, expected: datetime) -> None:
    assert parse_when(text, now=NOW) == expected.timestamp()


def test_a_duration_further_back_than_1970_means_everything() -> None:
    # Not a negative time the server would refuse ("since: greater than or equal to 0").
    assert parse_when("99999999999d", now=NOW) == 0.0


def test_epoch_seconds_pass_through() -> None:
    assert parse_when("1800000000.5", now=NOW) == 1800000000.5


@pytest.mark.parametrize("text", ["yesterday", "25:00", "7x", ""])
def test_bad_time_expressions_are_refused(text: str) -> None:
    with pytest.raises(typer.BadParameter):
        parse_when(text, now=NOW)


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def run(live: Live, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUWATCH_CONFIG": "/dev/null"}
    return subprocess.run(
        [*GPUWATCH, "history", *args, "--server", live.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_history_commands(live: Live) -> None:
    token = live.token("host-3")
    early = [snapshot(s, [gpu(2, [process(100, user="ann")])], hostname="host-3") for s in range(4)]
    late = [
        snapshot(
            s, [gpu(2, [process(200, used_gib=30, user="bob", orphaned=True)])], hostname="host-3"
        )
        for s in range(4, 8)
    ]
    live.push(token, body(*early, *late))
    at = datetime.fromtimestamp(T0 + 30).isoformat()

    table = run(live, "processes", "--host", "host-3", "--gpu", "2", "--at", at)
    as_json = run(live, "events", "--kind", "orphaned", "--since", "3650d", "--json")
    refused = run(live, "events", "--kind", "bogus")

    assert table.returncode == 0, table.stderr
    assert "ann" in table.stdout and "bob" not in table.stdout
    assert "4.0 GiB" in table.stdout
    assert as_json.returncode == 0, as_json.stderr
    (event,) = json.loads(as_json.stdout)
    assert (event["user"], event["held_bytes"]) == ("bob", 30 * GIB)
    assert refused.returncode == 3  # a bad option value (docs/exit-codes.md)


def test_unreachable_server_is_one_line_and_exit_5(live: Live) -> None:
    result = subprocess.run(
        [*GPUWATCH, "history", "top-idle", "--server", "http://127.0.0.1:1"],
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 5
    assert (
        result.stderr.startswith("gpuwatch: error: cannot reach") and result.stderr.count("\n") == 1
    )


HOSTILE = "python \x1b]0;owned\x07\x1b[2J[bold red]x[/] train.py\r\nFIX: sudo gpuwatch reap --pid 1"


def test_history_shows_another_user_s_control_characters_escaped(live: Live) -> None:
    # A command line is another user's text: printed raw, its ESC sequences set the
    # window title and cleared the screen, and a CR/LF forged a line of output.
    token = live.token("host-4")
    hostile = process(300, user="mallory").model_copy(update={"command": HOSTILE})
    live.push(token, body(*[snapshot(s, [gpu(0, [hostile])], hostname="host-4") for s in range(3)]))
    at = datetime.fromtimestamp(T0 + 2).isoformat()
    table = run(live, "processes", "--host", "host-4", "--at", at)
    as_json = run(live, "processes", "--host", "host-4", "--at", at, "--json")

    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and "\r" not in table.stdout
    assert "\\x1b]0;owned\\x07\\x1b[2J[bold red]x[/] train.py\\r\\nFIX" in table.stdout
    assert not any(line.startswith("FIX") for line in table.stdout.splitlines())
    (row,) = json.loads(as_json.stdout)
    assert row["command"] == HOSTILE  # the data itself is kept exactly
