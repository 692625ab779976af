"""`gpuwatch demo` as a newcomer sees it, without running the whole demo (test_demo.py
does): the live view fits an ordinary terminal, the printed commands work from any
directory, bad options are exit 3, and `./dev` refuses a command it does not know."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from rich.console import Console

from gpuwatch.cli.demo_sink import Notification
from gpuwatch.cli.demo_watch import Seen, Watch, render

ROOT = Path(__file__).resolve().parents[1]


# As the demo's server words them: longer than an 80-column row.
_LONG = (
    "memory grew 3072.0 MiB/min for 20 s to 33.1 GiB, 460.8 MiB above its earlier peaks;"
    " the GPU is full in 5.4 min at this rate"
)


_HOSTS = {
    "gpu-a": ["alice", "bob", "carol"],
    "gpu-b": ["dave", "erin", "frank", "grace"],
    "gpu-c": ["heidi", "ivan"],
}


def _gpus(users: list[str]) -> list[dict[str, object]]:
    processes = [{"user": user} for user in users]
    return [
        {"memory_used_bytes": 40 * 2**30, "memory_total_bytes": 80 * 2**30, "processes": processes}
        for _ in range(4)
    ]


def _busy_watch(summary: str = "finding number {i}") -> Watch:
    """A run two minutes in: three hosts, a dozen findings, a dozen notifications."""
    started = time.time() - 120
    events = [
        {
            "id": i,
            "hostname": f"gpu-{'abc'[i % 3]}",
            "gpu_index": i % 2,
            "kind": "idle" if i % 2 else "orphaned",
            "reason": "idle" if i % 2 else "parent_exited",
            "user": "alice" if i % 2 else "carol",
            "summary": summary.format(i=i),
            "open": True,
        }
        for i in range(12)
    ]
    seen = Seen(
        # As the demo's hosts are: several users each, so a host's row wraps at 80
        # columns (the view counted one line a host, and lost its newest notifications).
        hosts={name: {"gpus": _gpus(users)} for name, users in _HOSTS.items()},
        events=events,
        found={e["id"]: float(e["id"]) for e in events},
        notifications=[
            Notification(
                started + 60 + i,
                "firing",
                (("gpu_filling_up_warning", "firing", f"n{i} " + summary.format(i=i)),),
            )
            for i in range(12)
        ],
    )
    return cast(
        Watch, SimpleNamespace(seen=seen, started=started, sink=SimpleNamespace(rejected=0))
    )


@pytest.mark.parametrize("summary", ["finding number {i}", "finding number {i}: " + _LONG])
@pytest.mark.parametrize(("width", "height"), [(80, 24), (120, 40)])
def test_the_live_view_fits_the_terminal_with_the_newest_findings_named(
    width: int, height: int, summary: str
) -> None:
    stories = {
        name: "a story of what this host shows, long enough to wrap"
        for name in ("gpu-a", "gpu-b", "gpu-c")
    }
    console = Console(width=width, height=height, record=True, color_system=None)
    console.print(render(_busy_watch(summary), stories=stories, width=width, height=height))
    lines = console.export_text().splitlines()
    assert len(lines) < height, "\n".join(lines)  # Rich would cut the rest off ("...")
    text = "\n".join(lines)
    assert "Found" in text and "Sent to the webhook" in text
    assert "carol: finding number 10" in text  # the newest, with whose it is
    assert "n11" in text


def test_the_printed_command_is_an_absolute_path() -> None:
    from gpuwatch.cli.demo import _program

    program = _program()
    assert program[0] == "gpuwatch" or os.path.isabs(program[0]), program


@pytest.mark.parametrize("args", [["--listen", "foo"], ["--speed", "10"]])
def test_bad_demo_options_are_exit_3_in_one_line(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "demo", *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("gpuwatch: error: ") and done.stderr.count("\n") == 1


def test_dev_refuses_an_unknown_command() -> None:
    done = subprocess.run(
        [str(ROOT / "dev"), "tset"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "unknown command 'tset'" in done.stderr
    assert "set -euo" not in done.stderr + done.stdout
    shown = subprocess.run([str(ROOT / "dev"), "help"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0 and "./dev test" in shown.stdout
    assert "set -euo" not in shown.stdout
