"""One rule for the exit code of a bad command line (docs/exit-codes.md): a bad option
or argument VALUE is 3, whether typer's parser refuses it (a type, a range, a
callback) or the command's own code does; 2 is left to usage errors proper (an
unknown option or command, a missing argument or value, no command).

Before: the parser's refusals exited 2 with pydantic's words ("Input should be
greater than or equal to 1"), so ``demo --duration 0`` gave 2 and ``demo --duration
999999`` gave 3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from doctor.cli_run import run

from gpuwatch import cli


@pytest.fixture(autouse=True)
def _no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", "/dev/null")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))


def _error_line(args: list[str], capsys: pytest.CaptureFixture[str], code: int) -> str:
    got, out, err = run(args, capsys)
    assert got == code, err
    assert out == "" and err.count("\n") == 1 and err.startswith("gpuwatch: error: "), err
    return err.strip()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["demo", "--duration", "0"], "--duration '0': must be at least 1"),
        (["fit", "--params", "8B", "--context", "0"], "--context '0': must be at least 1"),
        (["fit", "--params", "8B", "--batch", "1e3"], "--batch '1e3': must be a whole number"),
        (["fit", "--params", "8B", "--mode", "lora", "--lora-rank=0"], "--lora-rank '0'"),
        (["history", "events", "--gpu", "64"], "--gpu '64': must be at most 63"),
        (["history", "events", "--kind", "bogus"], "--kind 'bogus': one of orphaned"),
        (["reap", "--pid", "1"], "--pid '1': must be at least 2"),
        (["agent", "--poll-interval", "soon"], "--poll-interval 'soon': must be a number"),
        (["--log-level", "loud", "status"], "--log-level 'loud': use debug, info"),
        (["--log-level", "loud", "agent"], "--log-level 'loud'"),
        (["alerts", "silence", "expire", "abc"], "ID 'abc': must be a whole number"),
        (["token", "create", "a b"], "HOST 'a b': a host name"),
    ],
)
def test_a_value_the_parser_refuses_is_exit_3_naming_the_option_and_value(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error_line(args, capsys, 3)
    assert says in line, line
    assert "Input should" not in line and "Invalid value" not in line, line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["history", "events", "--nosuch"], "No such option: --nosuch"),
        (["history", "events", "--limit"], "'--limit' requires an argument"),
        (["agent", "--collector.processes=1"], "does not take a value"),
        (["nosuchcommand"], "No such command"),
        (["alerts", "silence", "expire"], "Missing argument"),
        (["reap", "--dry-run"], "give --idle DURATION, or --pid PID"),
        (["fake-nvml", "stop"], "give a SCENARIO, or --all"),
    ],
)
def test_a_usage_error_stays_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _error_line(args, capsys, 2)


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, command


def _ranged_parameters() -> list[tuple[list[str], str]]:
    """Every ranged option and argument of the whole command line, with a value just
    below its range (or above, where it has no lower bound)."""
    cli._register_all()
    found = []
    for path, command in _commands(typer.main.get_command(cli._app()), []):
        for param in command.params:
            low, high = getattr(param, "min", None), getattr(param, "max", None)
            if low is not None:
                bad = str(low - 1)
            elif high is not None:
                bad = str(high + 1)
            else:
                continue
            given = [param.opts[0], bad] if param.param_type_name == "option" else [bad]
            found.append(([*path, *given], bad))
    return found


RANGED = _ranged_parameters()


def test_the_command_line_has_ranged_parameters_to_check() -> None:
    assert len(RANGED) >= 10  # the walk finds them (fit, history, reap, demo, alerts)


@pytest.mark.parametrize(("args", "bad"), RANGED, ids=[" ".join(a) for a, _ in RANGED])
def test_every_value_out_of_its_range_is_exit_3_in_gpuwatch_words(
    args: list[str], bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error_line(args, capsys, 3)
    assert f"'{bad}': must be at" in line, line
