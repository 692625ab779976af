"""`gpuwatch server`, `gpuwatch db` and `gpuwatch token` as an operator runs them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.factories import body, gpu, process, snapshot

GPUWATCH = [sys.executable, "-m", "gpuwatch"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_SERVER_DATABASE_URL": f"sqlite:///{tmp_path / 'cli.db'}",
        "GPUWATCH_SERVER_SCHEDULER": "false",
    }


def gw(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*GPUWATCH, *args], env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def server(env: dict[str, str]) -> Iterator[str]:
    proc = subprocess.Popen(
        [*GPUWATCH, "server", "--listen", "127.0.0.1:0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # migrations run first, then the address is printed
    match = re.search(r"listening on (http://\S+)", line)
    assert match, line
    url = match.group(1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        proc.stderr.close()


def test_db_upgrade_and_current(env: dict[str, str]) -> None:
    empty = gw(env, "db", "current", check=False)
    assert empty.stdout.startswith("none (empty database")
    assert empty.returncode == 7  # not migrated: a script can branch on it

    upgraded = gw(env, "db", "upgrade")

    assert upgraded.stdout.strip().endswith("(head)")
    assert gw(env, "db", "current").stdout.strip().endswith("(head)")


def test_token_commands_need_a_migrated_database(env: dict[str, str]) -> None:
    result = gw(env, "token", "create", "host-1", check=False)

    assert result.returncode == 7
    assert result.stderr.count("\n") == 1 and "gpuwatch db upgrade" in result.stderr


def test_unreachable_database_is_one_line_and_exit_7(env: dict[str, str]) -> None:
    result = gw(
        env,
        "db",
        "current",
        "--database-url",
        "postgresql+psycopg://postgres@127.0.0.1:1/test",
        check=False,
    )

    assert result.returncode == 7
    assert result.stderr.startswith("gpuwatch: error: ") and result.stderr.count("\n") == 1


def test_a_retired_host_ends_its_events_leaves_the_fleet_and_comes_back_with_a_token(
    env: dict[str, str], server: str
) -> None:
    from gpuwatch.server.database import create_database
    from gpuwatch.server.jobs import detect_silent_agents
    from gpuwatch.settings import ServerSettings

    token = gw(env, "token", "create", "gpu-old").stdout.strip().splitlines()[-1]
    orphan = process(41, orphaned=True)
    push = body(snapshot(0, [gpu(0, [orphan])], hostname="gpu-old", at=time.time()))
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{server}/api/v1/snapshots", json=push, headers=headers).status_code == 200
    opened = httpx.get(f"{server}/api/v1/events", params={"host": "gpu-old", "open": True})
    assert [e["kind"] for e in opened.json()["items"]] == ["orphaned"]
    assert 'gpuwatch_fleet_agent_silent{host="gpu-old"} 0.0' in httpx.get(f"{server}/metrics").text

    retired = gw(env, "token", "revoke", "gpu-old", "--retire")

    assert retired.stdout.strip() == (
        "revoked 1 token(s) of gpu-old and retired it: ended 1 process lifetime(s) and "
        "1 open event(s); its history stays"
    )
    assert httpx.post(f"{server}/api/v1/snapshots", json=push, headers=headers).status_code == 403
    events = httpx.get(f"{server}/api/v1/events", params={"host": "gpu-old"}).json()["items"]
    assert [(e["kind"], e["ended_at"] is not None) for e in events] == [("orphaned", True)]
    (host,) = httpx.get(f"{server}/api/v1/hosts").json()
    assert host["retired_at"] is not None and host["silent"] is False
    fleet = httpx.get(f"{server}/api/v1/fleet").json()
    assert fleet["hosts"] == 0 and fleet["gpus"] == 0 and fleet["silent_hosts"] == []
    assert "gpu-old" not in httpx.get(f"{server}/metrics").text
    assert "gpu-old" not in httpx.get(f"{server}/").text  # the fleet page
    # Silent for a day: a retired host is not judged.
    url = env["GPUWATCH_SERVER_DATABASE_URL"]
    database, settings = create_database(url), ServerSettings(database_url=url)

    def silent_after_a_day() -> int:
        return detect_silent_agents(database=database, settings=settings, now=time.time() + 86400)

    assert silent_after_a_day() == 0
    missing = gw(env, "token", "revoke", "no-such-host", "--retire", check=False)
    assert missing.returncode == 8 and missing.stderr.count("\n") == 1

    gw(env, "token", "create", "gpu-old")  # back in service
    (host,) = httpx.get(f"{server}/api/v1/hosts").json()
    assert host["retired_at"] is None and host["silent"] is False
    assert httpx.get(f"{server}/api/v1/fleet").json()["hosts"] == 1
    try:
        assert silent_after_a_day() == 1  # watched again
    finally:
        database.dispose()


def test_token_lifecycle_against_a_running_server(env: dict[str, str], server: str) -> None:
    """create -> push -> list -> revoke -> 403; then a second server on the same port."""
    created = gw(env, "token", "create", "host-1")
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("gwt_")

    listing = gw(env, "token", "list").stdout
    assert "host-1" in listing and token not in listing and "-" in listing

    push = body(snapshot(0, [gpu(0, [process(1)])], at=time.time()))
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{server}/api/v1/snapshots", json=push, headers=headers).status_code == 200

    assert "revoked 1 token(s) of host-1" in gw(env, "token", "revoke", "host-1").stdout
    assert httpx.post(f"{server}/api/v1/snapshots", json=push, headers=headers).status_code == 403
    assert token not in gw(env, "token", "list").stdout

    again = gw(env, "token", "revoke", "host-1", check=False)
    assert again.returncode == 8 and "no active token" in again.stderr

    port = server.rsplit(":", 1)[1]
    busy = gw(env, "server", "--listen", f"127.0.0.1:{port}", check=False)
    assert busy.returncode == 3 and "cannot listen on 127.0.0.1" in busy.stderr


def one_line_exit_7(result: subprocess.CompletedProcess[str]) -> str:
    """The command failed as a database problem: exit 7, one line, no "(a bug)"."""
    assert result.returncode == 7, result.stderr
    assert result.stderr.startswith("gpuwatch: error: ") and result.stderr.count("\n") == 1
    assert "(a bug)" not in result.stderr and "Traceback" not in result.stderr
    return result.stderr


def test_a_revision_from_a_newer_gpuwatch_says_upgrade_gpuwatch(env: dict[str, str]) -> None:
    import sqlite3

    gw(env, "db", "upgrade")
    path = env["GPUWATCH_SERVER_DATABASE_URL"].removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'ffffffffffff'")
    conn.close()

    commands = (["db", "current"], ["db", "upgrade"], ["token", "list"])
    for command in (*commands, ["server", "--listen", "127.0.0.1:0"]):
        message = one_line_exit_7(gw(env, *command, check=False))
        assert "revision ffffffffffff, which this gpuwatch does not know" in message, command
        assert "upgrade gpuwatch" in message and "db upgrade" not in message, command


def test_a_read_only_database_is_refused_by_upgrade_and_server(
    env: dict[str, str], tmp_path: Path
) -> None:
    gw(env, "db", "upgrade")
    # SQLite opens a file it may not write read-only (a read-only mount, file mode or
    # `chattr +i`): reads work, every write fails. mode=ro does the same as any user.
    read_only = {
        **env,
        "GPUWATCH_SERVER_DATABASE_URL": f"sqlite:///file:{tmp_path / 'cli.db'}?mode=ro&uri=true",
    }

    upgraded = gw(read_only, "db", "upgrade", check=False)
    served = subprocess.run(
        [*GPUWATCH, "server", "--listen", "127.0.0.1:0"],
        env=read_only,
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert "cannot be written" in one_line_exit_7(upgraded)
    assert "cannot be written" in one_line_exit_7(served)
    assert "listening" not in served.stderr


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres:S3CRETpw@127.0.0.1:notaport/test",
        "postgresql+psycopg://postgres:S3CRETpw@[::1/test",
    ],
)
def test_a_bad_port_in_the_url_is_unusable_with_its_password_masked(
    env: dict[str, str], url: str
) -> None:
    for command in (["db", "current"], ["db", "upgrade"], ["token", "list"]):
        result = gw(env, *command, "--database-url", url, check=False)

        # A configuration mistake (exit 3), not an outage the units would retry (7).
        assert result.returncode == 3, result.stderr
        message = result.stderr
        assert message.startswith("gpuwatch: error: ") and message.count("\n") == 1
        assert "unusable database URL postgresql+psycopg://postgres:***@" in message
        assert "S3CRETpw" not in message


def test_read_only_commands_never_create_the_database(env: dict[str, str], tmp_path: Path) -> None:
    typo = tmp_path / "typo.db"
    in_no_dir = tmp_path / "no-such-dir" / "typo.db"

    for path in (typo, in_no_dir):
        url = f"sqlite:///{path}"
        current = gw(env, "db", "current", "--database-url", url, check=False)
        listed = gw(env, "token", "list", "--database-url", url, check=False)

        assert current.returncode == 7
        assert f"no database at {path}" in current.stdout
        assert f"no database at {path}" in one_line_exit_7(listed)
        assert not path.exists()

    # An upgrade creates a new database (a new install), in a directory that exists.
    missing_dir = gw(env, "db", "upgrade", "--database-url", f"sqlite:///{in_no_dir}", check=False)
    assert f"no directory {in_no_dir.parent}" in one_line_exit_7(missing_dir)
    gw(env, "db", "upgrade", "--database-url", f"sqlite:///{typo}")
    assert gw(env, "token", "list", "--database-url", f"sqlite:///{typo}").returncode == 0
