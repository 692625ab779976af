"""``gpuwatch token create`` refuses the host names "." and "..": a browser resolves
such a path segment away (``/hosts/..`` opens ``/``), so no dashboard link of the
form ``/hosts/NAME`` could reach the host. Pages of such a host an older database
holds are reached by ``/hosts/?name=..`` (tests/web/test_host_addresses.py), and
``revoke`` still takes its name."""

from __future__ import annotations

from pathlib import Path

import pytest
from doctor.cli_run import run


@pytest.fixture
def database_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    url = f"sqlite:///{tmp_path / 'tokens.db'}"
    assert run(["db", "upgrade", "--database-url", url], capsys)[0] == 0
    return url


@pytest.mark.parametrize("name", [".", ".."])
def test_a_dot_segment_is_refused_as_a_host_name_in_one_line(
    name: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["token", "create", name, "--database-url", database_url], capsys)
    assert code == 3  # a bad argument value (docs/exit-codes.md)
    assert out == "" and err.count("\n") == 1 and "cannot be a host name" in err
    listed = run(["token", "list", "--database-url", database_url], capsys)[1]
    assert f" {name} " not in listed


@pytest.mark.parametrize("name", ["...", "./a", "a/..", ".hidden"])
def test_names_that_only_hold_dots_are_taken(
    name: str, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["token", "create", name, "--database-url", database_url], capsys)
    assert code == 0 and out.strip().splitlines()[-1]


def test_revoke_still_takes_a_dot_name_a_database_holds(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuwatch.server.auth.service import create_token
    from gpuwatch.server.database import create_database

    database = create_database(database_url)
    try:
        with database.writer() as session:
            create_token(session=session, hostname="..", now=0.0)
            session.commit()
    finally:
        database.dispose()
    code, _, err = run(["token", "revoke", "..", "--database-url", database_url], capsys)
    assert code == 0, err
