"""Silences the server refuses, and silences stored before those refusals existed.

A silence is admin input that every evaluation and every listing then runs or prints:
a backtracking regular expression froze the whole server (Python's ``re`` holds the
GIL), an end of 1e308 or Infinity broke `alerts silence list` and the /alerts page for
everyone, a NUL was a 500 on Postgres. Each is now a 422 in the documented list shape;
what is already stored is listed and never run.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from gpuwatch.server.alerts import dispatch, regex
from gpuwatch.server.alerts.models import SilenceRow
from gpuwatch.server.alerts.schemas import MAX_SILENCE_SECONDS
from server.factories import T0
from server.harness import Live

MATCH = [{"name": "hostname", "value": "host-1"}]
CATASTROPHIC = r"(\w|\w|\w)*X"
ADD = [sys.executable, "-m", "gpuwatch", "alerts", "silence", "add", "--match", "rule=x"]


def create(live: Live, **fields: Any) -> Any:
    silence = {"matchers": MATCH, "duration_seconds": 600, "created_by": "me"} | fields
    return live.client.post("/api/v1/silences", json=silence)


def problem(response: Any) -> dict[str, Any]:
    """The one problem of a 422, which has the documented list shape."""
    assert response.status_code == 422, response.text
    (first, *_) = response.json()["detail"]
    assert set(first) >= {"type", "loc", "msg"}
    return dict(first)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (CATASTROPHIC, "alternation inside a repeat"),
        (r"(a+)+b", "repeat inside a repeat"),
        (r"(a?){30}a{30}", "repeat inside a repeat"),
        (r"\w*\w*\w*\w*X", "at most 3 repeats"),
        (r"(a)\1", "backreferences"),
        (r"(?=a)\w+", "lookarounds"),
        ("a" * 300, "256"),
    ],
)
def test_a_regex_that_can_backtrack_for_minutes_is_refused(
    live: Live, pattern: str, why: str
) -> None:
    matcher = {"name": "rule", "value": pattern, "regex": True}
    started = time.monotonic()
    refused = problem(create(live, matchers=[matcher]))
    assert time.monotonic() - started < 5
    assert why in refused["msg"] and pattern not in refused["msg"]


def test_plain_regexes_are_still_taken_and_match_the_whole_value(live: Live) -> None:
    for pattern in (r"gpu_.*", r"host-(1|2|3)", r"(?i)GPU_FILLING_.*", r".*a.*b.*"):
        matcher = {"name": "rule", "value": pattern, "regex": True}
        assert create(live, matchers=[matcher]).status_code == 201
    host = dispatch.Matcher("hostname", r"host-(1|2)", regex=True)
    assert host.matches({"hostname": "host-2"}) and not host.matches({"hostname": "host-22"})


def test_a_stored_backtracking_regex_is_not_run(caplog: pytest.LogCaptureFixture) -> None:
    # Stored before patterns were checked: about 3 s on this value with re, 35 min on
    # "gpu_filling_up_warning"; each evaluation and GET /alerts ran it.
    regex.compiled.cache_clear()
    silence = dispatch.Silence(
        1, (dispatch.Matcher("rule", CATASTROPHIC, regex=True),), T0 - 60, T0 + 600
    )
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        muted = silence.mutes({"rule": "runaway_processes"}, T0)
        took = time.monotonic() - started
    assert took < 1.0 and not muted  # it mutes nothing: the alert is still sent
    assert "is not evaluated" in caplog.text and CATASTROPHIC not in caplog.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('"ends_at": Infinity', "ends_at"),
        ('"ends_at": 1e308', "ends_at"),
        ('"ends_at": 1e30', "ends_at"),
        ('"duration_seconds": true', "duration_seconds"),
        ('"duration_seconds": "60"', "duration_seconds"),
        ('"duration_seconds": 600, "starts_at": 1.7e308', "duration_seconds"),
    ],
)
def test_an_end_that_never_comes_or_is_not_a_number_is_refused(
    live: Live, body: str, field: str
) -> None:
    raw = '{"matchers": [{"name": "hostname", "value": "h"}], "created_by": "me", ' + body + "}"
    response = live.client.post(
        "/api/v1/silences", content=raw, headers={"content-type": "application/json"}
    )
    assert problem(response)["loc"][:2] == ["body", field]
    assert live.client.get("/api/v1/silences").json() == []


def test_a_silence_ends_within_a_year_as_the_command_line_allows(live: Live) -> None:
    now = live.clock()
    year = create(live, duration_seconds=None, ends_at=now + MAX_SILENCE_SECONDS)
    assert year.status_code == 201, year.text
    later = problem(create(live, duration_seconds=None, ends_at=now + MAX_SILENCE_SECONDS + 60))
    assert later["loc"] == ["body", "ends_at"] and "a year" in later["msg"]
    before = problem(create(live, duration_seconds=None, ends_at=now - 60))
    assert before["msg"] == "a silence must end after it starts"


@pytest.mark.parametrize(
    "fields",
    [
        {"created_by": "me\x00"},
        {"comment": "muted \x1b[31mred"},
        {"matchers": [{"name": "hostname", "value": "h\x00"}]},
        {"matchers": [{"name": "rule", "value": "x", "regex": "yes"}]},
        {"matchers": [{"name": "rule", "value": "x", "regex": 1}]},
    ],
)
def test_control_characters_and_lax_types_are_refused_on_both_databases(
    live: Live, fields: dict[str, Any]
) -> None:
    problem(create(live, **fields))


@pytest.mark.parametrize("raw", [b"\xff\xfe{", b"[" * 100_000, b"{"])
def test_a_body_that_is_not_json_is_a_422_json_invalid(live: Live, raw: bytes) -> None:
    response = live.client.post(
        "/api/v1/silences", content=raw, headers={"content-type": "application/json"}
    )
    assert problem(response)["type"] == "json_invalid"


def store(live: Live, **row: Any) -> None:
    values = {
        "matchers": MATCH,
        "starts_at": live.clock() - 60,
        "ends_at": live.clock() + 60,
        "created_by": "before",
        "comment": "stored before the checks",
        "created_at": live.clock() - 60,
    } | row
    with live.database.writer() as session, session.begin():
        session.add(SilenceRow(**values))


def test_silences_stored_out_of_range_still_list_on_the_api_page_and_command_line(
    live: Live,
) -> None:
    store(live, ends_at=1e308)
    store(live, matchers=[{"name": "rule", "value": CATASTROPHIC, "regex": True}])
    if live.database.dialect == "sqlite":
        store(live, ends_at=float("inf"))

    listed = live.client.get("/api/v1/silences")
    assert listed.status_code == 200, listed.text
    ends = sorted(s["ends_at"] for s in listed.json())
    assert ends[-1] == 2.0**33 and all(s["state"] == "active" for s in listed.json())
    assert live.client.get("/alerts").status_code == 200
    assert live.client.get("/api/v1/alerts").status_code == 200

    cli = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "alerts", "silence", "list", "--server", live.url],
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0, cli.stderr
    assert "2242-" in cli.stdout and CATASTROPHIC in cli.stdout


def test_until_past_a_year_is_one_line_and_exit_3_on_the_command_line(live: Live) -> None:
    for until in ("1e30", "1e12", str(time.time() + MAX_SILENCE_SECONDS + 3600)):
        cli = subprocess.run(
            [*ADD, "--until", until, "--comment", "x", "--server", live.url],
            env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 3, cli.stderr
        assert cli.stderr.count("\n") == 1 and "at most a year" in cli.stderr
    assert live.client.get("/api/v1/silences").json() == []
