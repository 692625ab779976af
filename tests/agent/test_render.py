"""`gpuwatch status` rendering: what a person sees flags what is wrong."""

from __future__ import annotations

from rich.console import Console
from support.snapshots import sample_snapshot

from gpuwatch.agent.render import format_age, format_bytes, render_status


def _render() -> str:
    console = Console(width=160, record=True, color_system=None)
    render_status(sample_snapshot(), console=console, now=1_700_010_000.0)
    return console.export_text()


def test_status_names_holders_and_flags_problems() -> None:
    text = _render()
    assert "gpu-box" in text and "driver 550.54.15" in text
    assert "[0] NVIDIA A100-SXM4-80GB" in text and "53.0 GiB / 80.0 GiB" in text
    assert "alice" in text and "20.0 GiB" in text and "kernel, server gone" in text
    assert "slurm job 4242" in text and "docker aaaaaaaaaaaa" in text
    assert "2.0 GiB held by PID 999999, which no longer exists" in text
    assert "1.0 GiB in use that no visible process accounts for" in text
    assert "GPU lost" in text


def test_rows_are_sorted_by_memory() -> None:
    text = _render()
    assert text.index("5151") < text.index("4242") < text.index("999999")


def test_formatting_helpers() -> None:
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30 // 2) == "1.5 GiB"
    assert format_bytes(5 * 2**40) == "5.0 TiB"
    assert format_age(None) == "?"
    assert format_age(59) == "59s"
    assert format_age(111) == "1m51s"
    assert format_age(11 * 60 + 5) == "11m"
    assert format_age(2 * 3600 + 5 * 60) == "2h05m"
    assert format_age(3 * 86400 + 7200) == "3d2h"


def _render_at(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    render_status(sample_snapshot(), console=console, now=1_700_010_000.0)
    return console.export_text().splitlines()


def test_a_terminal_keeps_every_column_and_cuts_the_command_with_an_ellipsis() -> None:
    lines = _render_at(110)
    header = next(line for line in lines if "COMMAND" in line)
    assert header.split() == ["PID", "USER", "MEMORY", "SM", "AGE", "FLAGS", "COMMAND"]
    row = next(line for line in lines if "alice" in line)
    assert "kernel, server gone" in row and row.rstrip().endswith("…")
    assert all(len(line) <= 110 for line in lines)


def test_a_narrow_terminal_prints_each_process_as_a_block_with_its_whole_command() -> None:
    snapshot = sample_snapshot()
    command = next(p.command for g in snapshot.gpus for p in g.processes if p.pid == 4242)
    console = Console(width=40, record=True, color_system=None)
    render_status(snapshot, console=console, now=1_700_010_000.0)
    text = console.export_text()
    assert "pid 4242" in text and "COMMAND" not in text
    assert command is not None and command.replace(" ", "") in text.replace(" ", "").replace(
        "\n", ""
    )


def test_status_into_a_file_keeps_whole_commands(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from gpuwatch.nvml.fake.lifecycle import stop_all

    try:
        out = subprocess.run(
            [sys.executable, "-m", "gpuwatch", "status", "--fake-gpus", "workstation"],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                "PATH": "/usr/bin:/bin",
                "GPUWATCH_CONFIG": "/dev/null",
                "XDG_RUNTIME_DIR": str(tmp_path),
                "COLUMNS": "80",
            },
        )
    finally:
        stop_all(tmp_path / "gpuwatch-fake")  # status leaves the scenario running for the next
    assert out.returncode == 0, out.stderr
    assert "runtime/kernel-3f2a9c.json" in out.stdout
