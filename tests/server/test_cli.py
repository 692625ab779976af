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
