"""Run the ``gpuwatch`` command line in this process, as the doctor's CLI tests do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.cli import main


def model_config(tmp_path: Path, model: str, config: dict[str, Any]) -> str:
    """``config`` written as ``<tmp_path>/<model>/config.json`` (fit names the model after
    its folder); the path, for ``--config``."""
    path = tmp_path / model / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config), encoding="utf-8")
    return str(path)


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``gpuwatch ARGS``."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), out, err
