"""Terminal rendering of one snapshot (``gpuwatch status``), in gpustat's spirit.

One line per GPU, then who holds its memory, then what looks wrong: memory held by
PIDs that no longer exist, memory no visible process accounts for, orphaned processes
and Jupyter kernels whose notebook server is gone.

Every name and command comes from /proc or NVML, and other users choose theirs: each
is printed through :func:`~gpuwatch.terminal_text.printable` as a
:class:`~rich.text.Text`, so a control character shows as an escape and rich markup
in it stays text.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot
from gpuwatch.terminal_text import printable

# Below this, unattributed memory is driver/context overhead, not worth a warning.
UNATTRIBUTED_WARN_BYTES = 256 * 2**20


def format_bytes(n: int | None) -> str:
    """``21474836480`` -> ``"20.0 GiB"`` (binary units, like nvidia-smi's MiB)."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    # Seconds while they still matter: the reap table showed "1m" beside its own
    # "no GPU activity for 111s".
    if minutes < 10:
        return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
    return f"{minutes}m"


def process_flags(proc: GpuProcess) -> list[str]:
    """Short, human words for what is unusual about a process."""
    flags: list[str] = []
    if not proc.visible:
        flags.append("not visible (PID namespace)")
    elif not proc.alive:
        flags.append("DEAD PID")
    if proc.orphaned:
        flags.append("orphaned")
    if proc.jupyter_kernel:
        flags.append("kernel, server gone" if proc.jupyter_server_alive is False else "kernel")
    owner = proc.owner
    if owner.slurm_job_id:
        flags.append(f"slurm job {owner.slurm_job_id}")
    if owner.pod_uid:
        flags.append(f"pod {owner.pod_uid[:8]}")
    elif owner.container_id:
        flags.append(f"{owner.container_runtime or 'container'} {owner.container_id[:12]}")
    return flags


def gpu_warnings(gpu: Gpu) -> list[str]:
    warnings: list[str] = []
    if gpu.lost:
        warnings.append("GPU lost (fallen off the bus): check `dmesg` for Xid errors")
    if gpu.read_error:
        warnings.append(f"could not read this GPU: {gpu.read_error}")
    dead = [p for p in gpu.processes if p.visible and not p.alive and p.used_bytes]
    for p in dead:
        warnings.append(f"{format_bytes(p.used_bytes)} held by PID {p.pid}, which no longer exists")
    if (gpu.unattributed_bytes or 0) >= UNATTRIBUTED_WARN_BYTES:
        warnings.append(
            f"{format_bytes(gpu.unattributed_bytes)} in use that no visible process accounts for"
        )
    if not gpu.processes_visible:
        warnings.append(
            "processes not visible: the agent runs in another PID namespace (use hostPID),"
            " or NVML could not list them this poll"
        )
    return warnings


def render_status(
    snapshot: HostSnapshot, *, console: Console | None = None, now: float | None = None
) -> None:
    console = console or Console()
    now = time.time() if now is None else now
    header = Text(printable(snapshot.hostname), style="bold")
    header.append(f"  driver {printable(snapshot.driver_version or '?')}")
    if snapshot.cuda_driver_version:
        header.append(f"  CUDA {printable(snapshot.cuda_driver_version)}")
    if snapshot.fake:
        header.append("  (simulated GPUs)", style="yellow")
    console.print(header)
    if not snapshot.gpus:
        console.print("no GPUs found")
        return
    for gpu in snapshot.gpus:
        console.print(_gpu_line(gpu))
        if gpu.processes:
            console.print(_process_table(gpu, now))
        for warning in gpu_warnings(gpu):
            console.print(Text(f"  ! {printable(warning)}", style="bold red"))


def _gpu_line(gpu: Gpu) -> Text:
    line = Text(f"[{gpu.index}] ", style="cyan")
    line.append(printable(gpu.name or "unknown GPU"), style="bold")
    if gpu.lost or gpu.read_error:
        return line
    temp = "?" if gpu.temperature_celsius is None else f"{gpu.temperature_celsius:.0f}°C"
    util = "?" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}"
    line.append(f" | {temp:>5} {util:>4} | ")
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    style = "bold red" if used and total and used / total > 0.9 else "yellow"
    line.append(f"{format_bytes(used)} / {format_bytes(total)}", style=style)
    return line


def _process_table(gpu: Gpu, now: float) -> Table:
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False)
    for column, justify, width in (
        ("PID", "right", 7), ("USER", "left", 6), ("MEMORY", "right", 9), ("SM", "right", 4),
        ("AGE", "right", 5),
    ):  # fmt: skip
        table.add_column(column, justify=justify, no_wrap=True, min_width=width)  # type: ignore[arg-type]
    # Flags before the command: on a narrow terminal the command gives way (cut with an
    # ellipsis, never wrapped), not the warning.
    rows = sorted(gpu.processes, key=lambda p: p.used_bytes or 0, reverse=True)
    flags = {p.pid: printable(", ".join(process_flags(p))) for p in rows}
    table.add_column("FLAGS", no_wrap=True, min_width=max(5, *(len(f) for f in flags.values())))
    table.add_column("COMMAND", no_wrap=True, overflow="ellipsis", max_width=60)
    for proc in rows:
        age = None if proc.start_time is None else now - proc.start_time
        sm = "?" if proc.sm_ratio is None else f"{proc.sm_ratio:.0%}"
        table.add_row(
            str(proc.pid),
            Text(printable(proc.owner.user or "?")),
            format_bytes(proc.used_bytes),
            sm,
            format_age(age),
            Text(flags[proc.pid], style="red"),
            Text(printable((proc.command or proc.name or "?")[:60])),
        )
    return table
