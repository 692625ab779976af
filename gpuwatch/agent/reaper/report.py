"""What ``gpuwatch reap`` prints: the candidates table, the results, and ``--json``.

``--json`` prints one object::

    {"dry_run": false, "host": "...", "window_seconds": 7200.0, "notes": [...],
     "refused": null,
     "candidates": [{"pid", "user", "uid", "name", "command", "workload", "gpu",
                     "gpus", "memory_bytes", "idle_seconds", "coverage_ratio",
                     "decision": "reap" | "spare", "reason", "detail"}],
     "results": [{"pid", "outcome", "detail", "signals", "memory_bytes",
                  "memory_freed", "memory_freed_bytes", "seconds_to_freed"}]}

A dry run lists the same candidates and decisions as a real run would, and a result
with outcome ``dry_run`` for each process it would stop.

The table and the result lines show other users' command lines, names and details
through :func:`~gpuwatch.terminal_text.printable`, as :class:`~rich.text.Text` (no
markup): a control character in them shows as an escape and cannot redraw what root
sees before the prompt. ``--json`` and the audit log keep the exact text.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwatch.agent.reaper.execute import Result
from gpuwatch.agent.reaper.plan import Plan
from gpuwatch.agent.reaper.policy import Candidate, Decision
from gpuwatch.agent.render import format_age, format_bytes
from gpuwatch.terminal_text import printable


def candidate_dict(decision: Decision) -> dict[str, Any]:
    c = decision.candidate
    return {
        "pid": c.pid,
        "user": c.user,
        "uid": c.uid,
        "name": c.name,
        "command": c.command,
        "workload": c.workload,
        "gpu": c.largest.gpu_index,
        "gpus": c.gpus,
        "memory_bytes": c.memory_bytes,
        "idle_seconds": decision.idle_seconds,
        "coverage_ratio": decision.coverage_ratio,
        "orphaned": c.orphaned,
        "decision": decision.verdict,
        "reason": decision.reason,
        "detail": decision.detail,
    }


def as_json(
    plan: Plan | None,
    results: list[Result],
    *,
    dry_run: bool,
    refused: str | None = None,
    notes: list[str] | None = None,
) -> str:
    document = {
        "dry_run": dry_run,
        "host": plan.hostname if plan else None,
        "window_seconds": plan.window_seconds if plan else None,
        "notes": (plan.notes if plan else []) + (notes or []),
        "refused": refused,
        "candidates": [candidate_dict(d) for d in plan.decisions] if plan else [],
        "results": [r.as_dict() for r in results],
    }
    return json.dumps(document, indent=2)


def print_plan(plan: Plan, console: Console) -> None:
    """The candidates table: processes to stop first, then those spared and why."""
    for note in plan.notes:
        console.print(note_line(note))
    if not plan.decisions:
        console.print("No process holds the memory floor on any GPU.")
        return
    ordered = sorted(plan.decisions, key=lambda d: (d.verdict != "reap", -d.candidate.memory_bytes))
    if console.width < WIDE_COLUMNS:
        _print_stacked(plan.hostname, ordered, console)
        return
    table = Table(
        title=Text(f"GPU processes on {printable(plan.hostname)}"),
        title_justify="left",
    )
    for column in (
        "PID",
        "USER",
        "COMMAND",
        "WORKLOAD",
        "GPU",
        "MEMORY",
        "IDLE FOR",
        "DECISION",
        "WHY",
    ):
        # A long word in a command or reason is folded onto the next row, not ended with
        # an ellipsis: what root confirms is all on screen.
        wraps = column in ("COMMAND", "WHY")
        table.add_column(column, no_wrap=not wraps, overflow="fold" if wraps else "ellipsis")
    for d in ordered:
        c = d.candidate
        table.add_row(
            str(c.pid),
            _text(c.user or (str(c.uid) if c.uid is not None else "?")),
            _text(_command(c)),
            _text(c.workload or ("orphan" if c.orphaned else "")),
            ",".join(str(i) for i in c.gpus),
            format_bytes(c.memory_bytes),
            format_age(d.idle_seconds),
            Text("reap", style="bold red") if d.verdict == "reap" else "spare",
            _text(d.detail),
        )
    console.print(table)


def print_results(results: list[Result], console: Console) -> None:
    for r in results:
        freed = ""
        if r.memory_freed and r.outcome == "already_exited":
            # Nothing was sent: the memory is free, but not by this run's doing.
            freed = f", its {format_bytes(r.memory_freed_bytes)} is free"
        elif r.memory_freed:
            freed = f", {format_bytes(r.memory_freed_bytes)} freed in {r.seconds_to_freed:.1f}s"
        elif r.memory_freed is False:
            freed = ", but NVML still lists its memory"
        console.print(Text(f"pid {r.pid}: {r.outcome} ({printable(r.detail)}){freed}"))


def note_line(note: str) -> Text:
    """``note: ...`` in yellow, its text shown as it is (escaped, never markup)."""
    return Text(f"note: {printable(note)}", style="yellow")


def _text(value: str) -> Text:
    return Text(printable(value))


# Below this many columns the table squeezed COMMAND and WHY to a few characters each
# (a row took 20 to 40 lines at 80 columns): each process is printed as a block instead.
WIDE_COLUMNS = 120
# A command line is shown up to this long, and a cut one says so: what root confirms
# must be what runs (a job cut at 60 characters, unmarked, lost its arguments).
COMMAND_CHARS = 240


def _command(c: Candidate) -> str:
    command = c.command or c.name or "?"
    return command if len(command) <= COMMAND_CHARS else command[: COMMAND_CHARS - 1] + "…"


def _print_stacked(hostname: str, ordered: list[Decision], console: Console) -> None:
    """The candidates one block each, for a narrow terminal: the decision and figures on
    the first line, then the command and the reason, each folded as long as it is."""
    console.print(Text(f"GPU processes on {printable(hostname)}"))
    for d in ordered:
        c = d.candidate
        head = Text()
        head.append(
            "reap " if d.verdict == "reap" else "spare",
            style="bold red" if d.verdict == "reap" else "",
        )
        user = c.user or (str(c.uid) if c.uid is not None else "?")
        workload = c.workload or ("orphan" if c.orphaned else "")
        head.append(
            f"  pid {c.pid}  {printable(user)}  GPU {','.join(str(i) for i in c.gpus)}"
            f"  {format_bytes(c.memory_bytes)}  idle {format_age(d.idle_seconds)}"
            + (f"  {printable(workload)}" if workload else "")
        )
        console.print(head)
        console.print(Text(f"    command: {printable(_command(c))}"), overflow="fold")
        console.print(Text(f"    why: {printable(d.detail)}"), overflow="fold")
