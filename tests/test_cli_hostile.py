"""Hostile input through the real command line: each case must end in ONE line on
stderr and a documented exit code (docs/exit-codes.md), never a traceback, and never a
setting dropped without a word. Every case but `fake-nvml exec`'s (which boots its
scenario before it runs CMD) fails before any GPU, fake or real, is used.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.errors import EXIT_CODES
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.runtime_state import default_runtime_dir

GPUWATCH = [sys.executable, "-m", "gpuwatch"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    environ |= {
        "GPUWATCH_CONFIG": "/dev/null",
        "HOME": str(tmp_path),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_RUNTIME_DIR": str(tmp_path),
    }
    yield environ
    # `fake-nvml exec` boots its scenario and leaves it running (it becomes CMD): stop
    # what the test booted, as `gpuwatch fake-nvml stop --all` would.
    stop_all(default_runtime_dir(environ))


def run(env: dict[str, str], *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*GPUWATCH, *args],
        env=env,
        cwd=env["HOME"],  # a private directory: relative names mean nothing here
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode in EXIT_CODES, (result.returncode, result.stderr)
    return result


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The error line, checked to be the only one and to come with ``code``."""
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: error: "), result.stderr
    return lines[0]


def test_a_failure_nothing_translated_is_one_line_and_exit_1(env: dict[str, str]) -> None:
    # A command that fails the way a bug does, run through the real entry point.
    program = (
        "import gpuwatch.cli as cli\n"
        "def register():\n"
        "    @cli._app().command('boom')\n"
        "    def boom() -> None:\n"
        "        raise TypeError(\"'int' object is not iterable\")\n"
        "cli._register_all = register\n"
        "import sys; sys.argv[1:] = LEVEL + ['boom']\n"
        "cli.main()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program.replace("LEVEL", "[]")],
        env=env, cwd=env["HOME"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "Traceback" not in result.stderr
    line = one_line_error(result, 1)
    assert "unexpected TypeError: 'int' object is not iterable" in line
    assert "--log-level debug" in line
    debug = subprocess.run(
        [sys.executable, "-c", program.replace("LEVEL", "['--log-level', 'debug']")],
        env=env, cwd=env["HOME"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and ", in boom" in debug.stderr


def test_closed_stdin_reads_as_empty_not_a_crash(env: dict[str, str]) -> None:
    result = run(env, "explain", "--no-live", preexec_fn=lambda: os.close(0))
    assert "nothing to explain: the input is empty" in one_line_error(result, 3)


@pytest.mark.parametrize(
    "command",
    [
        ["token", "list"],
        ["reap", "--idle", "1h", "--dry-run"],
        ["agent", "--listen", "127.0.0.1:0"],
    ],
)
@pytest.mark.parametrize(
    ("where", "problem"), [("absent.toml", "does not exist"), (".", "is a directory")]
)
def test_a_config_file_named_on_the_command_line_must_be_a_file(
    env: dict[str, str], tmp_path: Path, command: list[str], where: str, problem: str
) -> None:
    # Before: the file was skipped, and the command ran on defaults without a word.
    result = run(env, *command, "--config", str(tmp_path / where))
    assert one_line_error(result, 3).endswith(problem)


def test_gpuwatch_config_naming_a_directory_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    result = run(env | {"GPUWATCH_CONFIG": str(tmp_path)}, "token", "list")
    assert one_line_error(result, 3).endswith(f"{tmp_path}: is a directory")


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("GPUWATCH_SERVER_RETENTION_DAYS", "inf", ["token", "list"]),  # was accepted
        ("GPUWATCH_AGENT_POLL_INTERVAL_SECONDS", "nan", ["status", "--fake-gpus", "/"]),
    ],
)
def test_settings_refuse_nan_and_infinity(
    env: dict[str, str], variable: str, value: str, command: list[str]
) -> None:
    result = run(env | {variable: value}, *command)
    assert one_line_error(result, 3).endswith("Input should be a finite number")


@pytest.mark.parametrize(
    ("extra_env", "args"),
    [
        # `--database-url "$URL"` with URL unset: it used to mean the default SQLite file,
        # so a fleet's server would have started on an empty local database.
        ({}, ["server", "--database-url", ""]),
        ({}, ["db", "upgrade", "--database-url", ""]),
        ({"GPUWATCH_SERVER_DATABASE_URL": ""}, ["token", "list"]),
    ],
)
def test_an_empty_database_url_is_refused_not_read_as_the_default(
    env: dict[str, str], extra_env: dict[str, str], args: list[str]
) -> None:
    result = run(env | extra_env, *args)
    assert "database_url" in one_line_error(result, 3)
    assert not (Path(env["XDG_DATA_HOME"]) / "gpuwatch").exists()


@pytest.mark.parametrize(
    ("scenario", "says"),
    [
        ("a" * 5000, "cannot be read: File name too long"),
        ("/", "is a directory"),
        ("/dev/null", "is not a regular file"),
    ],
)
def test_a_scenario_path_that_is_no_file_says_what_it_is(
    env: dict[str, str], scenario: str, says: str
) -> None:
    result = run(env, "status", "--fake-gpus", scenario)
    assert one_line_error(result, 3).endswith(says)


@pytest.mark.parametrize(
    "listen", ["\u00fc\u202e\U0001f600:0", "a" * 300 + ":0", "h:" + "9" * 5000]
)
def test_a_listen_host_no_socket_can_bind_is_a_setting_error(
    env: dict[str, str], listen: str
) -> None:
    result = run(env, "agent", "--listen", listen)
    assert "invalid agent setting listen: expected HOST:PORT" in one_line_error(result, 3)


@pytest.mark.parametrize("listen", ["nope", "127.0.0.1:65536"])
def test_demo_listen_is_checked_before_anything_starts(env: dict[str, str], listen: str) -> None:
    result = run(env, "demo", "--listen", listen)
    # An option's value, as for `gpuwatch server --listen` (docs/exit-codes.md: 3).
    assert "--listen" in one_line_error(result, 3)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--server", "http://[::1"], "--server 'http://[::1' is not a URL"),
        (["--server", "http://" + "a" * 70000], "is not a URL: URL too long"),
        (["--token", "t\u00f6ken"], "the token has characters a gpuwatch token never has"),
    ],
)
def test_a_malformed_server_url_or_token_is_an_option_error(
    env: dict[str, str], args: list[str], says: str
) -> None:
    result = run(env, "history", "processes", "--server", "http://127.0.0.1:1", *args)
    line = one_line_error(result, 3)
    assert says in line and "t\u00f6ken" not in line  # a token is never quoted


@pytest.mark.parametrize("at", ["nan", "inf", "1e309", "0001-01-01T00:00"])
def test_history_refuses_times_that_are_not_times(env: dict[str, str], at: str) -> None:
    # Before: nan/inf went to the server; year 1 (local) overflowed in a traceback.
    result = run(env, "history", "processes", "--server", "http://127.0.0.1:1", "--at", at)
    assert "--at: " in (line := one_line_error(result, 3)) and "is not a time" in line


@pytest.mark.parametrize("until", ["nan", "1e309", "9" * 400])
def test_a_silence_until_no_time_is_refused(env: dict[str, str], until: str) -> None:
    result = run(
        env, "alerts", "silence", "add", "--match", "hostname=x", "--until", until,
        "--comment", "c", "--server", "http://127.0.0.1:1",
    )  # fmt: skip
    assert "use epoch seconds or a time" in one_line_error(result, 3)


def test_fake_nvml_exec_of_an_empty_command_is_a_usage_error(env: dict[str, str]) -> None:
    result = run(env, "fake-nvml", "exec", "workstation", "--", "")
    assert result.returncode == 2 and "missing the command to run" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--params", "1" + "0" * 400, "--gpu", "24GiB"], "beyond any model"),
        (["--params", "1001T", "--gpu", "24GiB"], "beyond any model"),
        (["--params", "8B", "--gpu", "9" * 400 + "GiB"], "more memory than any device"),
        (["--params", "8B", "--gpu", "2EiB"], "more memory than any device"),
    ],
    ids=["params-400-digits", "params-past-1000T", "size-400-digits", "size-exbibytes"],
)
def test_fit_with_numbers_past_any_model_or_device_is_an_option_error(
    env: dict[str, str], args: list[str], says: str
) -> None:
    # Before: an OverflowError from the float arithmetic after them.
    assert says in one_line_error(run(env, "fit", *args), 3)


def test_explain_reads_a_message_with_a_size_past_what_a_float_holds(env: dict[str, str]) -> None:
    huge = "1" + "0" * 400
    message = (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {huge} GiB"
        " (GPU 0; 23.65 GiB total capacity; 1 GiB already allocated)"
    )

    result = run(env, "explain", "--no-live", input=message)

    assert result.returncode == 0, result.stderr
    assert "23.65 GiB" in result.stdout


@pytest.mark.parametrize(
    "name",
    ["gpu\u202e4-tsoh", "gpu\u200b1", "host\x07", "host\udcff"],
    ids=["right-to-left-override", "zero-width-space", "bell", "lone-surrogate"],
)
def test_token_create_refuses_host_names_that_could_read_as_another(
    env: dict[str, str], name: str
) -> None:
    database = f"sqlite:///{env['HOME']}/central.db"
    result = run(env, "token", "create", name, "--database-url", database)
    said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())  # the usage box
    assert result.returncode == 3 and "control or format characters" in said, said


def test_a_reader_that_goes_away_is_exit_141_and_silent(env: dict[str, str]) -> None:
    # `gpuwatch --help | head -1`, with the reader gone before the first write (a pipe
    # whose read end is closed), so every write fails whatever its timing.
    for args in (["--help"], ["fake-nvml", "list"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = subprocess.run(
                [*GPUWATCH, *args], env=env, cwd=env["HOME"], stdout=write_end,
                stderr=subprocess.PIPE, timeout=60, check=False,
            )  # fmt: skip
        finally:
            os.close(write_end)
        assert result.returncode == 141, (args, result.stderr)
        assert result.stderr == b""


def test_a_command_fake_nvml_exec_cannot_run_is_126_and_one_missing_127(
    env: dict[str, str], tmp_path: Path
) -> None:
    not_runnable = run(env, "fake-nvml", "exec", "workstation", "--", str(tmp_path))
    assert one_line_error(not_runnable, 126).startswith("gpuwatch: error: cannot run")
    missing = run(env, "fake-nvml", "exec", "workstation", "--", "no-such-command-here")
    assert one_line_error(missing, 127).startswith("gpuwatch: error: cannot run")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["history", "events", "--nosuch"], "--nosuch"),
        (["nosuchcommand"], "nosuchcommand"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(
    env: dict[str, str], args: list[str], names: str
) -> None:
    line = one_line_error(run(env, *args), 2)
    assert names in line and "-h)" in line


def test_an_error_quoting_hostile_text_stays_one_line_without_escapes(
    env: dict[str, str], tmp_path: Path
) -> None:
    # An error message may quote text that is not ours (a path, a process's command line
    # in a refusal): its ESC sequences and newlines are shown escaped, never obeyed.
    hostile = str(tmp_path / "a\x1b[2J\nFIX: sudo gpuwatch reap --pid 1" / "config.json")
    line = one_line_error(run(env, "fit", "--config", hostile, "--gpu", "24GiB"), 3)
    assert "\x1b" not in line and "\\x1b[2J\\nFIX: sudo" in line


# An argument that is not UTF-8 (a Latin-1 file name, a mangled paste): Python keeps its
# bytes as lone surrogates, which no request can carry.
NOT_UTF8 = os.fsdecode(b"\xff\xfe")


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["history", "processes", "--host", NOT_UTF8], "--host"),
        (["history", "events", "--user", NOT_UTF8], "--user"),
        (["alerts", "test-receiver", NOT_UTF8], "the receiver name"),
        (["alerts", "list", "--server", f"http://{NOT_UTF8}/"], "--server"),
    ],
)
def test_an_argument_that_is_not_utf8_is_an_option_error(
    env: dict[str, str], args: list[str], names: str
) -> None:
    # Before: "unexpected UnicodeEncodeError ... (a bug)", exit 1.
    result = run(env, *args, *([] if "--server" in args else ["--server", "http://127.0.0.1:1"]))
    assert f"{names} is not valid UTF-8 text" in one_line_error(result, 3)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--speed", "1e-9"], "--speed must be at least"),
        (["--duration", "inf"], "--duration must be a number of seconds from 1 to 604500"),
        (["--duration", "1e400"], "--duration must be a number of seconds from 1 to 604500"),
        (["--duration", "1e20"], "--duration must be a number of seconds from 1 to 604500"),
    ],
)
def test_demo_refuses_speeds_and_durations_its_settings_cannot_hold_before_starting(
    env: dict[str, str], args: list[str], says: str
) -> None:
    # Before: "unexpected ValidationError / OverflowError (a bug)", or exit 3 naming an
    # internal file after ~20 s of start-up. Nothing listens on port 1: nothing started.
    result = run(env, "demo", "--listen", "127.0.0.1:1", *args)
    assert says in one_line_error(result, 3)


@pytest.fixture(scope="module")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database at the schema's head, made once: each test takes a copy."""
    path = tmp_path_factory.mktemp("central") / "central.db"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    subprocess.run(
        [*GPUWATCH, "db", "upgrade", "--database-url", f"sqlite:///{path}"],
        env=environ | {"GPUWATCH_CONFIG": "/dev/null"}, capture_output=True, timeout=60,
        check=True,
    )  # fmt: skip
    return path


@pytest.mark.parametrize("stdout", ["closed", "full", "reader gone"])
def test_token_create_that_cannot_show_the_token_creates_none(
    env: dict[str, str], migrated_sqlite: Path, stdout: str
) -> None:
    import shutil
    import sqlite3

    database = Path(env["HOME"]) / "central.db"
    shutil.copy(migrated_sqlite, database)
    args = [*GPUWATCH, "token", "create", "host-a", "--database-url", f"sqlite:///{database}"]
    common = {"env": env, "cwd": env["HOME"], "stderr": subprocess.PIPE, "timeout": 60}
    if stdout == "closed":  # `>&-`: before, exit 0 with the token's only copy lost
        result = subprocess.run(args, preexec_fn=lambda: os.close(1), **common)  # type: ignore[call-overload]
    elif stdout == "full":
        with open("/dev/full", "wb") as full:
            result = subprocess.run(args, stdout=full, **common)  # type: ignore[call-overload]
    else:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = subprocess.run(args, stdout=write_end, **common)  # type: ignore[call-overload]
        finally:
            os.close(write_end)
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuwatch: error: cannot write the token to standard output")
    assert "no token was created for host-a" in lines[0]
    with sqlite3.connect(database) as db:  # nothing kept: no token, and no host
        assert db.execute("SELECT count(*) FROM agent_tokens").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM hosts").fetchone() == (0,)


def test_any_command_with_stdout_closed_fails_to_write_in_one_line(env: dict[str, str]) -> None:
    result = run(env, "--version", preexec_fn=lambda: os.close(1))
    assert one_line_error(result, 1) == "gpuwatch: error: cannot write: standard output is closed"


@pytest.mark.parametrize(
    "server",
    ["ftp://host", "127.0.0.1:9403", "", "http://127.0.0.1:99999", "http://"],
)
@pytest.mark.parametrize(
    "command",
    [["history", "events"], ["alerts", "list"], ["alerts", "silence", "expire", "1"]],
)
def test_a_server_url_no_request_can_use_is_an_option_error(
    env: dict[str, str], command: list[str], server: str
) -> None:
    # Before: exit 5, "cannot reach the gpuwatch server", for all but one spelling.
    line = one_line_error(run(env, *command, "--server", server), 3)
    assert f"--server {server!r}" in line


@pytest.mark.parametrize(
    ("server", "says"),
    [
        ("ftp://host", "server_url must be an http:// or https:// URL with a host"),
        ("http://127.0.0.1:99999", "invalid server_url: Port out of range"),
        (f"http://{NOT_UTF8}/", "server_url: its host is not a valid host name"),
    ],
)
def test_the_agent_refuses_a_server_url_before_starting_anything(
    env: dict[str, str], server: str, says: str
) -> None:
    result = run(env, "agent", "--listen", "127.0.0.1:0", "--server", server, "--token", "t")
    assert says in one_line_error(result, 3)


def test_only_a_port_in_use_is_blamed_on_another_agent(env: dict[str, str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = one_line_error(run(env, "agent", "--listen", f"127.0.0.1:{port}"), 3)
    assert "Address already in use (another gpuwatch agent?)" in busy
    # An address this host does not have (TEST-NET-1, RFC 5737) is no other agent.
    absent = one_line_error(run(env, "agent", "--listen", "192.0.2.1:0"), 3)
    assert "cannot listen on 192.0.2.1:0" in absent and "another gpuwatch agent" not in absent


def test_fake_nvml_exec_options_after_the_scenario_say_where_they_go(
    env: dict[str, str],
) -> None:
    # Before: exit 127, "cannot run --at".
    result = run(env, "fake-nvml", "exec", "workstation", "--at", "1h", "--", "true")
    assert "options go before it" in one_line_error(result, 2)


@pytest.mark.parametrize("command", ["events", "top-idle"])
def test_history_since_after_until_is_refused_not_an_empty_table(
    env: dict[str, str], command: str
) -> None:
    result = run(
        env, "history", command, "--since", "1h", "--until", "7d",
        "--server", "http://127.0.0.1:1",
    )  # fmt: skip
    assert "--since 1h is after --until 7d" in one_line_error(result, 3)
