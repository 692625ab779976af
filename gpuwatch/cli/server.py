"""`gpuwatch server` commands (placeholder until its owner fills it in)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
