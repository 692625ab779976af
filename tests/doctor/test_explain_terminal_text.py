"""``gpuwatch explain`` (and the torch reporter) with another user's hostile command line
in the live context (/tmp/audit74), and with a snapshot served by another user.

A command line's control sequences, line breaks, bidi overrides and rich markup are
shown escaped: a raw newline cannot forge a line of advice. A local listener on the
agent's port owned by another uid is not trusted: its snapshot is ignored, with one
warning line. The command runs in a child process; assertions are on its exact bytes.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from support.served_as import served_by

from doctor.fake_agent_server import FakeAgent, shared_gpu_snapshot
from gpuwatch.snapshot import HostSnapshot, ProcessOwner

REPO_ROOT = Path(__file__).resolve().parents[2]
MALLORY = 4343
STARVED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 20.00 MiB is free. Including non-PyTorch memory, this process "
    "has 1.20 GiB memory in use. Of the allocated memory 800.00 MiB is allocated by PyTorch, and "
    "100.00 MiB is reserved by PyTorch but unallocated."
)
FORGED = "FIX: run sudo gpuwatch reap --pid 1 --force"
# A window title and colour, then a forged advice line (LF, and CR/LF), a bidi override
# and rich markup: within the 60 characters explain quotes of a command.
COMMAND = f"py\x1b]0;t\x07\x1b[31m\n{FORGED}\u202e[red]x[/]"
SHOWN = f"py\\x1b]0;t\\x07\\x1b[31m\\n{FORGED[:30]}"
USER = "m\r\n$ sudo x"


def _hostile_snapshot() -> HostSnapshot:
    snapshot = shared_gpu_snapshot()
    gpu = snapshot.gpus[0]
    processes = [
        p.model_copy(update={"command": COMMAND, "owner": ProcessOwner(user=USER, uid=4242)})
        if p.pid == 4242
        else p
        for p in gpu.processes
    ]
    return snapshot.model_copy(update={"gpus": [gpu.model_copy(update={"processes": processes})]})


def _explain(agent_url: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["GPUWATCH_CONFIG"] = "/dev/null"
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "explain", "--agent", agent_url, "--text", STARVED],
        capture_output=True, timeout=60, cwd=REPO_ROOT, env=env, check=False,
    )  # fmt: skip


def _assert_escaped(text: str) -> None:
    for raw in ("\x1b", "\x07", "\r", "\u202e"):
        assert raw not in text, f"{raw!r} reached the terminal"
    lines = text.splitlines()
    # The forged advice is never a line of its own; it stays inside the quoted command.
    assert not any(line.lstrip().startswith(("FIX", "$ sudo")) for line in lines)
    assert any(SHOWN in line for line in lines)
    assert any("pid 4242 m\\r\\n$ sudo x" in line for line in lines)


def test_explain_shows_a_hostile_live_command_escaped(agent: FakeAgent) -> None:
    agent.snapshot = _hostile_snapshot()
    done = _explain(agent.url)
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    _assert_escaped(text)
    # The real advice is still there, for the real PID.
    assert "gpuwatch reap --pid 4242   # or: kill 4242" in text
    assert "Right now on gpu-box, GPU 0" in text


def test_the_torch_reporter_prints_it_escaped(agent: FakeAgent) -> None:
    import gpuwatch.torch as gt

    agent.snapshot = _hostile_snapshot()
    reporter = gt.Reporter(agent_url=agent.url)
    out = io.StringIO()
    reporter.handle_oom(RuntimeError(STARVED), stream=out)
    _assert_escaped(out.getvalue())


def test_a_snapshot_served_by_another_user_is_ignored() -> None:
    body = shared_gpu_snapshot().model_dump_json().encode()
    with served_by(MALLORY, {"snapshot": body}) as url:
        done = _explain(url)
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    # No live context: nothing from that snapshot, no PID to stop.
    assert "Right now on" not in text and "gpu-box" not in text
    assert "--pid 4242" not in text and "kill 4242" not in text
    warnings = [line for line in done.stderr.decode().splitlines() if "WARNING" in line]
    assert len(warnings) == 1
    assert f"ignoring the agent at {url}/snapshot" in warnings[0]
    assert f"uid {MALLORY}" in warnings[0] and "no live context" in warnings[0]


def test_the_torch_reporter_ignores_it_too() -> None:
    import gpuwatch.torch as gt

    body = shared_gpu_snapshot().model_dump_json().encode()
    with served_by(MALLORY, {"snapshot": body}) as url:
        explanation = gt.Reporter(agent_url=url).handle_oom(
            RuntimeError(STARVED), stream=io.StringIO()
        )
    assert explanation.recognized and explanation.live is None
