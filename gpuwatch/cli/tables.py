"""Rows the server answered, printed for a person (a table) or a program (JSON).

One printer for ``gpuwatch history`` and ``gpuwatch alerts``: their cells hold other
users' command lines, users and summaries, so each cell is data, never markup, and its
control characters are shown escaped (:func:`gpuwatch.terminal_text.printable`); the
JSON keeps the exact text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import typer
from pydantic import BaseModel

from gpuwatch.terminal_text import printable


def print_json(rows: Sequence[BaseModel]) -> None:
    typer.echo(json.dumps([row.model_dump(mode="json") for row in rows], indent=2))


def print_table(headers: list[str], rows: list[list[str]], *, empty: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not rows:
        typer.echo(empty)
        return
    table = Table(*headers, box=None, pad_edge=False)
    for row in rows:
        # Rows are data, not markup: a command line may hold [brackets] or an ESC.
        table.add_row(*(Text(printable(cell)) for cell in row))
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        # Piped into grep or a file: whole rows, not cells squeezed into 80 columns.
        console = Console(soft_wrap=True, width=1_000_000)
    console.print(table)
