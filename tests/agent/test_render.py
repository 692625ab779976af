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
