"""``gpuwatch reap`` with another user's hostile command line (/tmp/audit74): root's
table before "Stop N processes?" shows control sequences, line breaks, bidi overrides
and rich markup escaped, and the reap acts (or refuses) exactly as before.

The victim is a real process of another uid whose argv[0] (``exec -a``) carries the
payload; the audit log keeps its exact bytes. Assertions are on the bytes printed.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reaper.rig import ALICE, Hold
from reaper.test_reap_cli import _audit, _reap, _setup

# Clear the screen, an OSC 8 hyperlink, CR/LF then a forged line of advice; then a
# bidi override, rich markup and an emoji code. Within the 60 characters the table
# keeps of a command.
PAYLOAD = "\x1b[2J\x1b]8;;http://e/\x07L\x1b]8;;\x07\r\nFIX:\u202e[red]R[/]:x:"
SHOWN = "\\x1b[2J\\x1b]8;;http://e/\\x07L\\x1b]8;;\\x07\\r\\nFIX:\\u202e[red]R[/]:x:"


class Hostile:
    def __init__(self, argv0: str, uid: int = ALICE) -> None:
        self.process = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
             "bash", "-c", 'exec -a "$0" sleep 600', argv0],
            cwd="/",
        )  # fmt: skip
        cmdline = Path(f"/proc/{self.pid}/cmdline")
        deadline = time.monotonic() + 10
        while not cmdline.read_bytes().startswith(argv0.encode()):
            assert time.monotonic() < deadline, "the hostile process did not start"
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    victim = Hostile(PAYLOAD)
    yield victim
    if victim.alive():
        victim.process.kill()
    victim.process.wait(10)


def _unwrapped(stdout: str) -> str:
    """The table's text with its borders and wrapping undone: rich wraps a long cell
    over several rows, so the cells' pieces are joined back, column by column."""
    rows = [line for line in stdout.splitlines() if line.startswith("│")]
    cells = [[cell.strip() for cell in row.strip("│").split("│")] for row in rows]
    columns = zip(*cells, strict=True) if cells else []
    return "\n".join("".join(column) for column in columns)


def _assert_escaped(stdout: str) -> None:
    for raw in ("\x1b", "\x07", "\r", "\u202e"):
        assert raw not in stdout, f"{raw!r} reached root's terminal"
    # The forged advice never starts a line of its own.
    assert not any(line.lstrip().startswith("FIX") for line in stdout.splitlines())
    assert SHOWN in _unwrapped(stdout)


def test_the_dry_run_table_shows_a_hostile_command_escaped(
    rig, hostile, agent, tmp_path: Path
) -> None:
    scenario = _setup(rig, agent, [Hold(hostile.pid)])
    dry = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    _assert_escaped(dry.stdout)
    assert "reap" in _unwrapped(dry.stdout) and hostile.alive()
    # --json, for scripts, keeps the exact command line.
    as_json = _reap(tmp_path, agent, scenario, "--idle", "2h", "--dry-run", "--json")
    (candidate,) = json.loads(as_json.stdout)["candidates"]
    assert candidate["command"] == f"{PAYLOAD} 600" and candidate["decision"] == "reap"


def test_unconfirmed_at_no_terminal_still_refuses(rig, hostile, agent, tmp_path: Path) -> None:
    scenario = _setup(rig, agent, [Hold(hostile.pid)])
    done = _reap(tmp_path, agent, scenario, "--idle", "2h")
    assert done.returncode == 22, done.stderr
    assert "not a terminal" in done.stderr
    _assert_escaped(done.stdout)
    assert hostile.alive()


def test_the_reap_stops_it_and_the_audit_log_keeps_the_exact_bytes(
    rig, hostile, agent, tmp_path: Path
) -> None:
    scenario = _setup(rig, agent, [Hold(hostile.pid)])
    done = _reap(tmp_path, agent, scenario, "--idle", "2h", "--yes")
    assert done.returncode == 0, done.stderr
    _assert_escaped(done.stdout)
    assert f"pid {hostile.pid}: terminated" in done.stdout
    assert hostile.process.wait(10) == -15
    rows = _audit(tmp_path)
    assert [row["event"] for row in rows] == ["decision", "signal", "outcome"]
    assert rows[0]["command"] == f"{PAYLOAD} 600"
