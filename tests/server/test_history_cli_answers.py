"""`gpuwatch history` says when --limit cut its list, and tells an unknown host from a
quiet one."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from typing import get_args

import pytest

from gpuwatch.cli import history
from gpuwatch.server.events.schemas import EventKind
from server.factories import body, gpu, process, snapshot
from server.harness import Live


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


def run(live: Live, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "history", *args, "--server", live.url],
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_cut_list_says_more_rows_match(live: Live) -> None:
    token = live.token("host-a")
    orphans = [process(pid, orphaned=True) for pid in (1, 2, 3)]
    live.push(token, body(snapshot(0, [gpu(0, orphans)], hostname="host-a")))

    cut = run(live, "events", "--limit", "2", "--json")

    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.count('"kind"') == 2
    assert "showing the newest 2 events; more match" in cut.stderr


def test_an_unknown_or_wrong_case_host_is_exit_8_not_a_quiet_host(live: Live) -> None:
    live.token("host-a")  # known, and nothing happened there yet

    quiet = run(live, "processes", "--host", "host-a")
    wrong_case = run(live, "events", "--host", "HOST-A")

    assert quiet.returncode == 0 and "no matching processes" in quiet.stdout
    assert wrong_case.returncode == 8
    assert wrong_case.stderr.strip().endswith(
        "the server has no host named 'HOST-A' (did you mean host-a?)"
    )


def test_the_kind_option_lists_every_kind() -> None:
    option = inspect.signature(history.events).parameters["kind"].default
    assert all(kind in option.help for kind in get_args(EventKind))
