"""Run the ``gpuwatch`` command line in this process, as the doctor's CLI tests do."""

from __future__ import annotations

import pytest

from gpuwatch.cli import main


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``gpuwatch ARGS``."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    code = exited.value.code
    return (code if isinstance(code, int) else 0), out, err
