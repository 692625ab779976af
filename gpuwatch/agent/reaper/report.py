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
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuwatch.agent.reaper.execute import Result
from gpuwatch.agent.reaper.plan import Plan
from gpuwatch.agent.reaper.policy import Decision
from gpuwatch.agent.render import format_age, format_bytes


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
        console.print(f"note: {note}", style="yellow", highlight=False)
    if not plan.decisions:
        console.print("No process holds the memory floor on any GPU.")
        return
    table = Table(title=f"GPU processes on {plan.hostname}", title_justify="left")
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
        table.add_column(column, no_wrap=column not in ("COMMAND", "WHY"))
    ordered = sorted(plan.decisions, key=lambda d: (d.verdict != "reap", -d.candidate.memory_bytes))
    for d in ordered:
        c = d.candidate
        table.add_row(
            str(c.pid),
            c.user or (str(c.uid) if c.uid is not None else "?"),
            (c.command or c.name or "?")[:60],
            c.workload or ("orphan" if c.orphaned else ""),
            ",".join(str(i) for i in c.gpus),
            format_bytes(c.memory_bytes),
            format_age(d.idle_seconds),
            "[bold red]reap[/]" if d.verdict == "reap" else "spare",
            d.detail,
        )
    console.print(table)


def print_results(results: list[Result], console: Console) -> None:
    for r in results:
        freed = ""
        if r.memory_freed:
            freed = f", {format_bytes(r.memory_freed_bytes)} freed in {r.seconds_to_freed:.1f}s"
        elif r.memory_freed is False:
            freed = ", but NVML still lists its memory"
        console.print(f"pid {r.pid}: {r.outcome} ({r.detail}){freed}", highlight=False)
