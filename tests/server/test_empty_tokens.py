"""Tokens the server must refuse at start: empty, blank, or one token for both roles.

An empty ``GPUWATCH_SERVER_READ_TOKEN=`` (the example env file's line uncommented)
used to count as a token that an empty credential matched, opening the dashboard to
anyone. ``gpuwatch server`` now exits 3 with one line, before touching the database.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.settings import ServerSettings

GPUWATCH = [sys.executable, "-m", "gpuwatch"]


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"GPUWATCH_SERVER_READ_TOKEN": ""}, "read_token is empty"),
        ({"GPUWATCH_SERVER_READ_TOKEN": "  "}, "read_token is empty"),
        ({"GPUWATCH_SERVER_ADMIN_TOKEN": "\t"}, "admin_token is empty"),
        (
            {"GPUWATCH_SERVER_READ_TOKEN": "s3cret", "GPUWATCH_SERVER_ADMIN_TOKEN": " s3cret "},
            "admin_token equals read_token",
        ),
    ],
    ids=["empty-read", "blank-read", "blank-admin", "same-token"],
)
def test_the_server_refuses_to_start_with_exit_3_and_one_line(
    tmp_path: Path, variables: dict[str, str], said: str
) -> None:
    database = tmp_path / "never.db"
    env = {
        **os.environ,
        "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_SERVER_DATABASE_URL": f"sqlite:///{database}",
        **variables,
    }
    result = subprocess.run(
        [*GPUWATCH, "server", "--listen", "127.0.0.1:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    (line,) = result.stderr.strip().splitlines()
    assert said in line and "Traceback" not in result.stderr
    assert not database.exists()


def test_a_token_is_kept_without_the_spaces_a_credential_is_stripped_of() -> None:
    settings = ServerSettings(read_token=SecretStr(" s3cret\n"))
    assert settings.read_token is not None
    assert settings.read_token.get_secret_value() == "s3cret"


def test_cookies_are_secure_behind_an_https_external_url_unless_told_otherwise() -> None:
    behind_tls = AlertSettings.model_validate({"external_url": "https://gpus.example.org/"})
    plain = AlertSettings.model_validate({"external_url": "http://gpus.lan/"})
    assert ServerSettings(alerts=behind_tls).cookies_secure()
    assert not ServerSettings(alerts=plain).cookies_secure()
    assert not ServerSettings().cookies_secure()
    assert ServerSettings(alerts=plain, cookie_secure=True).cookies_secure()
    assert not ServerSettings(alerts=behind_tls, cookie_secure=False).cookies_secure()
