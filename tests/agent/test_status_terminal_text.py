"""``gpuwatch status`` with another user's hostile command line (/tmp/audit74): control
sequences, line breaks, bidi overrides and rich markup in an argv are shown escaped,
never sent to the terminal or interpreted.

The processes are real (another uid, ``exec -a`` sets their argv[0]); fake GPUs attach
them. Assertions are on the exact bytes ``gpuwatch status`` writes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from gpuwatch.agent.render import render_status
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.runtime_state import default_runtime_dir
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

MALLORY = 4242  # no passwd entry: shown as "4242"
# A red colour, a window title (OSC 0 ended by BEL), CR/LF forging a line of its own;
# clearing the screen and an OSC 8 hyperlink; bidi override, rich markup and emoji codes.
# Each fits the 60 columns status gives a command, once escaped.
CONTROLS = "\x1b[31mR\x1b]0;pwned\x07\r\nFAKE"
SHOWN_CONTROLS = "\\x1b[31mR\\x1b]0;pwned\\x07\\r\\nFAKE"
LINK = "\x1b[2J\x1b]8;;http://e/\x07L\x1b]8;;\x07"
SHOWN_LINK = "\\x1b[2J\\x1b]8;;http://e/\\x07L\\x1b]8;;\\x07"
MARKUP = "\u202e[bold red]B[/] [link=http://e]K[/link] :warning:"
SHOWN_MARKUP = "\\u202e[bold red]B[/] [link=http://e]K[/link] :warning:"


def start_hostile(argv0: str, uid: int = MALLORY) -> subprocess.Popen[bytes]:
    """``sleep 600`` as ``uid`` with ``argv0`` as its argv[0]; returned once /proc shows it."""
    process = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
         "bash", "-c", 'exec -a "$0" sleep 600', argv0],
        cwd="/",
    )  # fmt: skip
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if cmdline.read_bytes().startswith(argv0.encode()):
            return process
        time.sleep(0.02)
    process.kill()
    raise AssertionError("the hostile process did not start")


@pytest.fixture
def hostile() -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [start_hostile(CONTROLS), start_hostile(LINK), start_hostile(MARKUP)]
    yield started
    for process in started:
        process.kill()
        process.wait(10)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    environ = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "GPUWATCH_CONFIG": "/dev/null",
        "COLUMNS": "200",
    }
    (tmp_path / "run").mkdir()
    yield environ
    runtime = default_runtime_dir(environ)
    if runtime.exists():
        stop_all(runtime)


def _scenario(tmp_path: Path, pids: list[int]) -> Path:
    text = ['[fake]\nname = "hostile"\n\n[[gpu]]\nmemory_total = "16GiB"\n']
    text += [
        f'[[process]]\ngpu = 0\nattach = {pid}\nmemory = "{i + 1}GiB"\n'
        for i, pid in enumerate(pids)
    ]
    path = tmp_path / "hostile.toml"
    path.write_text("\n".join(text))
    return path


def _assert_no_raw_controls(out: bytes) -> None:
    text = out.decode()
    for raw in ("\x1b", "\x07", "\r", "\u202e"):
        assert raw not in text, f"{raw!r} reached the terminal"


def test_status_shows_a_hostile_command_line_escaped(env, tmp_path, hostile) -> None:
    scenario = _scenario(tmp_path, [p.pid for p in hostile])
    done = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "status", "--fake-gpus", str(scenario)],
        env=env, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    _assert_no_raw_controls(done.stdout)
    text = done.stdout.decode()
    assert f"{SHOWN_CONTROLS} 600" in text
    assert f"{SHOWN_LINK} 600" in text
    assert f"{SHOWN_MARKUP} 600" in text  # markup and emoji codes stay text
    assert not any(line.startswith("FAKE") for line in text.splitlines())
    # Each process is one row: PID, user, command on the same line.
    rows = [line for line in text.splitlines() if str(MALLORY) in line]
    assert len(rows) == 3 and all(line.lstrip().split()[0].isdigit() for line in rows)
    # --json keeps the exact command line for scripts.
    as_json = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "status", "--fake-gpus", str(scenario), "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert f"{CONTROLS} 600" in {
        p["command"] for g in json.loads(as_json.stdout)["gpus"] for p in g["processes"]
    }


def test_status_escapes_every_field_from_proc(tmp_path) -> None:
    # Users, names, Slurm job ids and container ids come from /proc too.
    owner = ProcessOwner(
        user="m\x1b]0;t\x07", uid=MALLORY, slurm_job_id="7\r\nFAKE", container_id="c\u2066[red]x"
    )
    process = GpuProcess(pid=77, used_bytes=2**30, name="n", command=None, owner=owner)
    snapshot = HostSnapshot(
        agent_id="a", hostname="h[bold]x[/]", boot_id="b", sequence=1, collected_at=1.0,
        gpus=[Gpu(index=0, uuid="GPU-0", name="G\x9b2J", memory_total_bytes=2**34,
                  memory_used_bytes=2**30, processes=[process])],
    )  # fmt: skip
    out = io.StringIO()
    render_status(snapshot, console=Console(file=out, width=200, color_system=None), now=2.0)
    text = out.getvalue()
    _assert_no_raw_controls(text.encode())
    assert "\x9b" not in text
    assert "h[bold]x[/]" in text and "G\\x9b2J" in text
    assert "m\\x1b]0;t\\x07" in text
    assert "slurm job 7\\r\\nFAKE" in text and "container c\\u2066[red]x" in text
