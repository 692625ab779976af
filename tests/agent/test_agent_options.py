"""``gpuwatch agent``'s options read without typer (the daemon's start) against the
typer command built from the same table (help and errors): for what the fast reader
accepts it must give exactly what typer gives; the rest it must leave to typer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gpuwatch.cli.agent import OPTIONS, parse_fast, typer_command


def _typer_reads(args: list[str]) -> tuple[int, dict[str, Any] | None, str]:
    """Exit code, the values the typer command was called with (None: not called), output."""
    called: list[dict[str, Any]] = []
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="agent")(typer_command(called.append))
    result = CliRunner().invoke(app, args)
    return result.exit_code, (called[0] if called else None), result.output


NOTHING_GIVEN = {option.name: None for option in OPTIONS}

READ = [
    ([], {}),
    (["--listen", "127.0.0.1:0"], {"listen": "127.0.0.1:0"}),
    (["--listen=127.0.0.1:0", "--listen", "[::1]:9400"], {"listen": "[::1]:9400"}),
    (["--fake-gpus", "h100x8", "--server", "http://s:8080"], {"fake_gpus": "h100x8", "server_url": "http://s:8080"}),
    (["--token", "-starts-with-a-dash"], {"token": "-starts-with-a-dash"}),
    (["--token="], {"token": ""}),
    (["--fake-gpus=a=b.toml"], {"fake_gpus": "a=b.toml"}),
    (["--listen", "--help"], {"listen": "--help"}),
    (["--poll-interval", "2"], {"poll_interval_seconds": 2.0}),
    (["--poll-interval=0.25"], {"poll_interval_seconds": 0.25}),
    (["--collector.processes"], {"process_metrics": True}),
    (["--collector.processes", "--no-collector.processes"], {"process_metrics": False}),
    (["--no-dcgm-compat", "--dcgm-compat"], {"dcgm_compat": True}),
    (["--config", "/etc/gpuwatch/other.toml"], {"config": Path("/etc/gpuwatch/other.toml")}),
    (["--config="], {"config": Path("")}),
]  # fmt: skip


@pytest.mark.parametrize(("args", "given"), READ)
def test_what_it_reads_it_reads_as_typer_does(args: list[str], given: dict[str, Any]) -> None:
    code, typer_values, output = _typer_reads(args)
    assert code == 0, output
    assert parse_fast(args) == typer_values == {**NOTHING_GIVEN, **given}
    for name, value in (parse_fast(args) or {}).items():
        assert type(value) is type(typer_values[name] if typer_values else None)


LEFT_TO_TYPER_ERRORS = [
    ["--bogus"],
    ["--listen"],
    ["--listen=127.0.0.1:0", "--bogus=3"],
    ["--poll-interval", "abc"],
    ["--poll-interval"],
    ["--collector.processes=1"],
    ["extra"],
    ["-x"],
    [""],
    ["--log-level", "info"],
]


@pytest.mark.parametrize("args", LEFT_TO_TYPER_ERRORS)
def test_mistakes_are_left_to_typer_which_exits_2(args: list[str]) -> None:
    assert parse_fast(args) is None
    code, called, _ = _typer_reads(args)
    assert (code, called) == (2, None)


@pytest.mark.parametrize(
    "args", [["--help"], ["-h"], ["--listen", "x", "--help"], ["--poll-interval", "1e3"], ["--"]]
)
def test_help_and_unusual_forms_are_left_to_typer(args: list[str]) -> None:
    assert parse_fast(args) is None


def test_the_typer_command_has_the_options_of_the_table() -> None:
    app = typer.Typer(add_completion=False)
    app.command(name="agent")(typer_command(print))
    command = typer.main.get_command(app)
    shown = [
        "/".join(param.opts + param.secondary_opts)
        for param in command.params
        if "--help" not in param.opts
    ]
    assert shown == [option.flags for option in OPTIONS]
