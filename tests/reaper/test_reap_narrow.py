"""``gpuwatch reap``'s candidates on an 80-column terminal, as a newcomer sees them.

The table squeezed COMMAND and WHY to a few characters each (a row took 20 to 40 lines)
and cut every command at 60 characters without a mark, so root confirmed a command it
could not read. A narrow terminal now gets one block a process, its command whole.
Run on a real terminal (``script``) over the fake GPUs' workstation scenario.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from gpuwatch.agent.reaper.report import COMMAND_CHARS


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux's script")
def test_an_80_column_terminal_shows_each_process_as_a_block_with_its_whole_command(
    tmp_path,
) -> None:
    reap = (
        f"stty cols 80 rows 24; {sys.executable} -m gpuwatch reap --fake-gpus workstation"
        f" --idle 2h --dry-run --agent http://127.0.0.1:9 --audit-log {tmp_path}/audit.jsonl"
    )
    env = {**os.environ, "GPUWATCH_CONFIG": "/dev/null", "TERM": "xterm"}
    try:
        done = subprocess.run(
            ["script", "-q", "-c", reap, os.devnull],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(
            [sys.executable, "-m", "gpuwatch", "fake-nvml", "stop", "workstation"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", done.stdout).replace("\r", "")
    assert "┃" not in screen, screen  # no squeezed table
    lines = screen.splitlines()
    assert max(len(line) for line in lines) <= 80, screen
    assert "    command: python train.py --config configs/resnet152.yaml --batch-size 256" in lines
    assert any(re.match(r"spare  pid \d+  bob  GPU 1  ", line) for line in lines), screen
    assert COMMAND_CHARS >= 200
