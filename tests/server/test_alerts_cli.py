"""`gpuwatch alerts` as a person runs it: the real command line against a live server.

Alerts come from real ingest (a GPU that falls off the bus, a GPU filling up), the
engine runs at instants of the fake clock, and notifications go over HTTP to local
receivers. Each command runs as a subprocess, so exit codes and stderr are the ones
a shell sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from support.sink import Sink, sink

from gpuwatch.settings import ServerSettings
from server.factories import T0, body, gpu, process, snapshot
from server.harness import FakeClock, Live

GPUWATCH = [sys.executable, "-m", "gpuwatch"]
READ = "read-token-for-cli-tests"
ADMIN = "admin-token-for-cli-tests"


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture
def hook(clock: FakeClock) -> Iterator[Sink]:
    with sink(clock) as s:
        yield s


@pytest.fixture
def gone(clock: FakeClock) -> Iterator[Sink]:
    """A receiver endpoint that no longer exists: every POST is answered 404."""
    with sink(clock) as s:
        s.status = 404
        yield s


@pytest.fixture
def settings(tmp_path: Path, database_url: str, hook: Sink, gone: Sink) -> ServerSettings:
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "agent_push_interval_seconds": 15,
            "read_token": READ,
            "admin_token": ADMIN,
            "receivers": [
                {"name": "hook", "type": "webhook", "url": hook.url, "secret": "s1"},
                {"name": "gone", "type": "webhook", "url": gone.url, "secret": "s2"},
            ],
            "alerts": {
                "group_wait": "30s",
                "routes": [{"receiver": "hook"}],
                # Fire at once: these tests are about the command line, not timers.
                "rules": {
                    "gpu_filling_up_warning": {"for": "0s"},
                    "runaway_process": {"for": "0s"},
                },
            },
        }
    )


def gw(live: Live, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``gpuwatch alerts ARGS`` with the tokens in the environment, as an operator's
    shell would have them, and ``--server`` unless GPUWATCH_SERVER_LISTEN is given."""
    server = [] if "GPUWATCH_SERVER_LISTEN" in env else ["--server", live.url]
    return subprocess.run(
        [*GPUWATCH, "alerts", *args, *server],
        env={
            **os.environ,
            "GPUWATCH_CONFIG": "/dev/null",
            "GPUWATCH_SERVER_READ_TOKEN": READ,
            "GPUWATCH_SERVER_ADMIN_TOKEN": ADMIN,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.lstrip().startswith("[") else result.stdout


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with ``code`` and said why in one line, without a traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.startswith("gpuwatch: error: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


def run_engine(app: FastAPI, settings: ServerSettings, live: Live, at: float) -> None:
    live.clock.now = max(live.clock.now, at)
    app.state.gpuwatch.alerts.run(database=live.database, settings=settings, now=at)


def lose_gpu(live: Live, host: str, at: float) -> None:
    token = live.token(host)
    lost = gpu(1, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    response = live.push(
        token, body(snapshot(0, [gpu(0, [process(7)]), lost], hostname=host, at=at))
    )
    assert response.status_code == 200, response.text


def fill_gpu(live: Live, host: str) -> None:
    """40 minutes of pid 31 (erin) growing 1 GiB/min beside a flat job: filling_up."""
    token = live.token(host)
    snaps = [
        snapshot(
            seq,
            [
                gpu(
                    0,
                    [
                        process(31, used_gib=10 + seq / 4, sm=0.9, user="erin"),
                        process(32, used_gib=20, sm=0.5, user="frank"),
                    ],
                )
            ],
            hostname=host,
        )
        for seq in range(160)
    ]
    for i in range(0, len(snaps), 80):
        response = live.push(token, body(*snaps[i : i + 80]))
        assert response.status_code == 200, response.text


def test_list_shows_firing_alerts_most_severe_first_with_their_culprits(
    live: Live, app: FastAPI, settings: ServerSettings
) -> None:
    fill_gpu(live, "host-1")
    lose_gpu(live, "host-2", at=live.clock())
    run_engine(app, settings, live, live.clock())

    alerts = ok(gw(live, "list", "--json"))
    table = ok(gw(live, "list"))

    assert [a["severity"] for a in alerts] == ["critical", "warning", "warning"]
    assert alerts[0]["rule"] == "gpu_lost" and alerts[0]["labels"]["hostname"] == "host-2"
    by_rule = {a["rule"]: a for a in alerts}
    filling = by_rule["gpu_filling_up_warning"]
    assert filling["state"] == "firing" and filling["silenced_by"] == []
    (culprit,) = filling["culprits"]
    assert (culprit["pid"], culprit["user"]) == (31, "erin")
    assert culprit["command"] == "python train.py --run 31"
    assert culprit["memory_bytes"] > 40 * 2**30 and culprit["slope_bytes_per_second"] > 0
    assert by_rule["runaway_process"]["culprits"][0]["pid"] == 31
    # The table: one row per culprit, growth per minute, the command in full.
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["ID", "SEVERITY", "STATE", "RULE"]
    assert lines[1].split()[1:4] == ["critical", "firing", "gpu_lost"]
    filling_line = next(line for line in lines if "gpu_filling_up_warning" in line)
    assert "erin" in filling_line and "GiB/min" in filling_line
    assert filling_line.endswith("python train.py --run 31")
    # The server URL from GPUWATCH_SERVER_LISTEN, as `gpuwatch history` finds it.
    listen = live.url.removeprefix("http://")
    assert ok(gw(live, "list", "--json", GPUWATCH_SERVER_LISTEN=listen)) == alerts
    assert ok(gw(live, "list", "--state", "pending", "--json")) == []
    assert ok(gw(live, "list", "--state", "resolved")).strip() == "no resolved alerts"


def test_a_cut_list_says_so_on_stderr_and_json_stays_the_list(
    live: Live, app: FastAPI, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill_gpu(live, "host-1")
    lose_gpu(live, "host-2", at=live.clock())
    run_engine(app, settings, live, live.clock())
    monkeypatch.setattr("gpuwatch.server.alerts.service.MAX_ALERTS", 2)

    listed = gw(live, "list", "--json")

    assert [a["severity"] for a in ok(listed)] == ["critical", "warning"]
    assert listed.stderr.splitlines() == [
        "gpuwatch: showing 2 of 3 active alerts, the most severe and oldest first"
        " (the server lists at most 1,000; narrow with --state)"
    ]
    response = live.client.get("/api/v1/alerts", headers={"Authorization": f"Bearer {READ}"})
    assert response.headers["X-Total-Count"] == "3" and len(response.json()) == 2
    monkeypatch.setattr("gpuwatch.server.alerts.service.MAX_ALERTS", 3)
    whole = gw(live, "list", "--json")
    assert len(ok(whole)) == 3 and whole.stderr == ""


def test_silence_add_list_and_expire_round_trip(
    live: Live, app: FastAPI, settings: ServerSettings, hook: Sink
) -> None:
    lose_gpu(live, "host-1", at=T0)
    lose_gpu(live, "host-2", at=T0)
    run_engine(app, settings, live, T0)

    added = gw(
        live,
        *("silence", "add", "--match", "hostname=host-1", "--match", "rule=~gpu_.*"),
        *("--for", "2h", "--comment", "driver upgrade", "--json"),
        USER="sre-on-call",
    )
    (created,) = ok(added)
    sid = created["id"]
    assert created["state"] == "active" and created["created_by"] == "sre-on-call"
    assert created["ends_at"] == T0 + 7200
    assert created["matchers"] == [
        {"name": "hostname", "value": "host-1", "regex": False},
        {"name": "rule", "value": "gpu_.*", "regex": True},
    ]
    assert [s["id"] for s in ok(gw(live, "silence", "list", "--json"))] == [sid]
    listed = ok(gw(live, "silence", "list"))
    assert "hostname=host-1, rule=~gpu_.*" in listed and "driver upgrade" in listed
    silenced = {a["labels"]["hostname"]: a["silenced_by"] for a in ok(gw(live, "list", "--json"))}
    assert silenced == {"host-1": [sid], "host-2": []}

    run_engine(app, settings, live, T0 + 30)
    assert [d.body["group_labels"]["hostname"] for d in hook.deliveries] == ["host-2"]

    expired = ok(gw(live, "silence", "expire", str(sid)))
    assert expired.startswith(f"silence {sid} (hostname=host-1, rule=~gpu_.*) ended")
    assert ok(gw(live, "silence", "list", "--json")) == []
    (old,) = ok(gw(live, "silence", "list", "--expired", "--json"))
    assert (old["id"], old["state"]) == (sid, "expired")
    assert all(a["silenced_by"] == [] for a in ok(gw(live, "list", "--json")))
    run_engine(app, settings, live, T0 + 60)
    run_engine(app, settings, live, T0 + 90)
    assert [d.body["group_labels"]["hostname"] for d in hook.deliveries] == ["host-2", "host-1"]

    assert "no silence 999" in one_line_error(gw(live, "silence", "expire", "999"), 8)


def test_silence_until_a_time_and_by_a_name(live: Live) -> None:
    added = gw(
        live,
        *("silence", "add", "--match", "user=", "--until", str(T0 + 600)),
        *("--comment", "empty value matches a missing label", "--by", "ann"),
    )

    assert ok(added).startswith("silence 1 mutes user= until ")
    (made,) = ok(gw(live, "silence", "list", "--json"))
    assert (made["ends_at"], made["created_by"]) == (T0 + 600, "ann")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--match", "hostname", "--for", "1h"], "expected LABEL=VALUE or LABEL=~REGEX"),
        (["--match", "=x", "--for", "1h"], "expected LABEL=VALUE"),
        (["--match", "host=x", "--for", "1h"], "unknown label 'host'"),
        (["--match", "rule=~gpu_(", "--for", "1h"], "bad regular expression"),
        (["--match", "gpu=0", "--for", "2 hours"], "--for '2 hours'"),
        (["--match", "gpu=0", "--for", "0s"], "more than 0 seconds"),
        (["--match", "gpu=0"], "exactly one of --for"),
        (["--match", "gpu=0", "--for", "1h", "--until", "1"], "exactly one of --for"),
        (["--match", "gpu=0", "--until", "tomorrow"], "--until 'tomorrow'"),
        (["--match", "gpu=0", "--for", "1h", "--by", ""], "--by: String should have at least"),
        (["--match", "gpu=0", "--for", "1h", "--comment", "c" * 1100], "--comment: String should"),
    ],
)
def test_bad_silences_are_one_line_and_exit_3(live: Live, args: list[str], says: str) -> None:
    result = gw(live, "silence", "add", "--comment", "x", *args)

    assert says in one_line_error(result, 3)


def test_a_silence_the_server_refuses_is_one_line_and_exit_3(live: Live) -> None:
    # Ends before the server's now: only the server can tell.
    result = gw(
        live, "silence", "add", "--match", "gpu=0", "--until", str(T0 - 60), "--comment", "x"
    )

    assert "the server refused the silence: ends_at: a silence must end after it starts" in (
        one_line_error(result, 3)
    )
    assert ok(gw(live, "silence", "list", "--expired", "--json")) == []


def test_test_receiver_sent_refused_and_unknown(live: Live, hook: Sink, gone: Sink) -> None:
    sent = gw(live, "test-receiver", "hook")
    refused = gw(live, "test-receiver", "gone")
    unknown = gw(live, "test-receiver", "nope")

    assert ok(sent).startswith("test notification sent: webhook receiver 'hook': HTTP 200")
    (delivery,) = hook.deliveries
    assert delivery.body["alerts"][0]["rule"] == "test"
    message = one_line_error(refused, 9)
    assert "refused for good: webhook receiver 'gone': HTTP 404" in message
    assert gone.url not in message and "/hook" not in message
    assert len(gone.deliveries) == 1
    assert "no receiver 'nope'" in one_line_error(unknown, 8)


def test_a_receiver_found_broken_by_a_test_shows_broken(live: Live) -> None:
    one_line_error(gw(live, "test-receiver", "gone"), 9)

    receivers = live.client.get(
        "/api/v1/receivers", headers={"Authorization": f"Bearer {READ}"}
    ).json()

    assert {r["name"]: r["status"] for r in receivers}["gone"] == "broken"


def test_tokens_and_an_unreachable_server_are_one_line_and_exit_5(live: Live) -> None:
    wrong_read = gw(live, "list", GPUWATCH_SERVER_READ_TOKEN="nope")
    no_token = gw(live, "silence", "list", GPUWATCH_SERVER_READ_TOKEN="")
    read_for_write = gw(
        live,
        *("silence", "add", "--match", "gpu=0", "--for", "1h", "--comment", "x"),
        *("--token", READ),
    )
    flag_wins = gw(live, "list", "--token", READ, GPUWATCH_SERVER_READ_TOKEN="nope")
    unreachable = subprocess.run(
        [*GPUWATCH, "alerts", "list", "--server", "http://127.0.0.1:1"],
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert "(HTTP 403: wrong read token)" in one_line_error(wrong_read, 5)
    assert "(HTTP 401: missing bearer read token)" in one_line_error(no_token, 5)
    assert "(HTTP 403: wrong admin token)" in one_line_error(read_for_write, 5)
    assert flag_wins.returncode == 0, flag_wins.stderr
    assert "cannot reach the gpuwatch server" in one_line_error(unreachable, 5)
    assert "--state 'on'" in one_line_error(gw(live, "list", "--state", "on"), 3)


SECRET_PATH = "SECRETPATH123"
SECRET_KEY = "SECRETKEY456"


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ("[server.alerts]\nevaluation_intervall = '15s'\n", "alerts.evaluation_intervall"),
        ("[server.alerts]\ngroup_wait = '30 seconds'\n", "alerts.group_wait"),
        (
            "[server.alerts]\nexternal_url = 'gpuwatch.example.internal'\n",
            "external_url must be an absolute http:// or https:// URL",
        ),
        (
            "[server.alerts.rules.gpu_lost]\nfor = 'soon'\n",
            "alerts.rules.gpu_lost.for",
        ),
        (
            "[server.alerts]\nroutes = [{receiver = 'nobody'}]\n",
            "unknown receiver(s) nobody",
        ),
        (
            "[[server.receivers]]\nname = 'ops'\ntype = 'webhook'\n"
            f"url = 'https://hooks.example.com/{SECRET_PATH}'\n",
            "webhook receiver 'ops': a webhook receiver needs a secret",
        ),
        (
            "[[server.receivers]]\nname = 'ops'\ntype = 'slack'\n"
            f"url = 'https://hooks.example.com/{SECRET_PATH}'\nsecret = '{SECRET_KEY}'\n",
            "secret is only for webhook receivers",
        ),
    ],
)
def test_server_refuses_a_bad_alert_config_in_one_line(
    tmp_path: Path, config: str, names: str
) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(config)
    result = subprocess.run(
        [*GPUWATCH, "server", "--listen", "127.0.0.1:0"],
        env={
            **os.environ,
            "GPUWATCH_CONFIG": str(path),
            "GPUWATCH_SERVER_DATABASE_URL": f"sqlite:///{tmp_path / 'cli.db'}",
            "GPUWATCH_SERVER_SCHEDULER": "false",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )

    message = one_line_error(result, 3)
    assert names in message, message
    assert SECRET_PATH not in message and SECRET_KEY not in message
