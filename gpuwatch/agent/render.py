"""Terminal rendering of one snapshot (``gpuwatch status``), in gpustat's spirit.

One line per GPU, then who holds its memory, then what looks wrong: memory held by
PIDs that no longer exist, memory no visible process accounts for, orphaned processes
and Jupyter kernels whose notebook server is gone. Above the GPUs, what limits the
reader's view (``notes``: ``/proc`` mounted ``hidepid``, a user namespace, the container
image's passwd file), so a hidden process is never taken for a dead one.

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

from gpuwatch.containers import container_label
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot
from gpuwatch.terminal_text import printable

# Below this, unattributed memory is driver/context overhead, not worth a warning.
UNATTRIBUTED_WARN_BYTES = 256 * 2**20


# Where the table's other columns leave the command fewer columns than this, each
# process is printed as a block instead: a few letters do not say which run it is.
COMMAND_MIN = 20


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


def process_flags(proc: GpuProcess, *, isolated: bool = True) -> list[str]:
    """Short, human words for what is unusual about a process. ``isolated``: the reader
    runs in another PID namespace (``HostSnapshot.pid_namespace_isolated``); otherwise a
    process it cannot see exists but ``/proc`` hides it (hidepid, a refused read)."""
    flags: list[str] = []
    if not proc.visible:
        flags.append("not visible (PID namespace)" if isolated else "hidden by /proc")
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
        flags.append(container_label(owner.container_runtime, owner.container_id))
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


def status_console() -> Console:
    """The console ``gpuwatch status`` prints on: the terminal's width, or, for a file,
    a pipe or cron's mail, no width at all, since whole commands (the kernel's connection
    file, the run's name) are what a reader greps for."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=1_000_000, soft_wrap=True)
    return console


def render_status(
    snapshot: HostSnapshot,
    *,
    console: Console | None = None,
    now: float | None = None,
    notes: list[str] | None = None,
) -> None:
    """Print ``snapshot``; ``notes``: what limits the reader's view (Sampler.reader_notes)."""
    console = console or status_console()
    now = time.time() if now is None else now
    header = Text(printable(snapshot.hostname), style="bold")
    header.append(f"  driver {printable(snapshot.driver_version or '?')}")
    if snapshot.cuda_driver_version:
        header.append(f"  CUDA {printable(snapshot.cuda_driver_version)}")
    if snapshot.fake:
        header.append("  (simulated GPUs)", style="yellow")
    console.print(header)
    for note in notes or []:
        console.print(Text(f"  ! {printable(note)}", style="yellow"))
    if not snapshot.gpus:
        console.print("no GPUs found")
        return
    for gpu in snapshot.gpus:
        console.print(_gpu_line(gpu))
        isolated = snapshot.pid_namespace_isolated
        if gpu.processes:
            table = _process_table(gpu, now, isolated=isolated, width=console.width)
            if table is None:  # too narrow a terminal for the table to name the command
                _print_process_blocks(gpu, now, console, isolated=isolated)
            else:
                console.print(table)
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


def _process_table(gpu: Gpu, now: float, *, isolated: bool, width: int) -> Table | None:
    """The processes of ``gpu`` as rows; ``width``: the console's, which the command
    fills, cut with an ellipsis where it does not fit (the other columns never give).
    None when ``width`` leaves the command fewer than COMMAND_MIN columns."""
    rows = sorted(gpu.processes, key=lambda p: p.used_bytes or 0, reverse=True)
    cells = []
    for proc in rows:
        age = None if proc.start_time is None else now - proc.start_time
        cells.append(
            [
                str(proc.pid),
                printable(proc.owner.user or "?"),
                format_bytes(proc.used_bytes),
                "?" if proc.sm_ratio is None else f"{proc.sm_ratio:.0%}",
                format_age(age),
                # Flags before the command: the command gives way, never the warning.
                printable(", ".join(process_flags(proc, isolated=isolated))),
            ]
        )
    columns = (
        ("PID", "right", 7), ("USER", "left", 6), ("MEMORY", "right", 9), ("SM", "right", 4),
        ("AGE", "right", 5), ("FLAGS", "left", 5),
    )  # fmt: skip
    widths = [
        max(least, *(len(row[i]) for row in cells)) for i, (_, _, least) in enumerate(columns)
    ]
    # Rich shrinks no-wrap columns by dropping some; the width is worked out here
    # instead, so PID..FLAGS stay whole and the command has exactly what is left.
    command_width = width - sum(widths) - 2 * len(columns) - 1
    if command_width < COMMAND_MIN:
        return None
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False)
    for (name, justify, _), fixed in zip(columns, widths, strict=True):
        table.add_column(name, justify=justify, no_wrap=True, width=fixed)  # type: ignore[arg-type]
    table.add_column("COMMAND", no_wrap=True, overflow="ellipsis", max_width=command_width)
    for proc, row in zip(rows, cells, strict=True):
        command = Text(printable(proc.command or proc.name or "?"))
        command.truncate(command_width, overflow="ellipsis")
        table.add_row(*row[:5], Text(row[5], style="red"), command)
    return table


def _print_process_blocks(gpu: Gpu, now: float, console: Console, *, isolated: bool) -> None:
    """One block per process for a terminal too narrow for the table: the figures and
    flags on the first line, the command folded below it, whole."""
    for proc in sorted(gpu.processes, key=lambda p: p.used_bytes or 0, reverse=True):
        age = None if proc.start_time is None else now - proc.start_time
        sm = "?" if proc.sm_ratio is None else f"{proc.sm_ratio:.0%}"
        head = Text(
            f"  pid {proc.pid}  {printable(proc.owner.user or '?')}"
            f"  {format_bytes(proc.used_bytes)}  SM {sm}  age {format_age(age)}"
        )
        flags = printable(", ".join(process_flags(proc, isolated=isolated)))
        if flags:
            head.append(f"  {flags}", style="red")
        console.print(head, overflow="fold")
        command = printable(proc.command or proc.name or "?")
        console.print(Text(f"    {command}"), overflow="fold")
