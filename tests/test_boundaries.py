"""Package boundaries that the design relies on, checked on the source itself.

* ``gpuwatch.detectors`` is pure: the server uses it now and the agent's reaper next,
  so it imports neither of them.
* ``gpuwatch.agent`` and ``gpuwatch.server`` never import each other; what both need
  lives beside ``gpuwatch/snapshot.py`` (``wire``, ``metricspec``, ``detectors``).
* One event path: only ``gpuwatch/server/events/`` writes ``events`` rows (and their
  outbox rows). Everything else goes through its ``EventBook`` or service.
* The running agent imports none of the heavy packages it does without (its memory
  budget, bench/README.md "Agent RSS"); this one is checked on a real agent process.

Imports are read with ``ast``, function-level ones included, so a lazy import cannot
slip past.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuwatch"


def _modules(subpackage: str) -> Iterator[Path]:
    yield from sorted((PACKAGE / subpackage).rglob("*.py"))


def _imported(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize(
    ("subpackage", "forbidden"),
    [
        ("detectors", ("gpuwatch.agent", "gpuwatch.server", "gpuwatch.cli")),
        ("agent", ("gpuwatch.server",)),
        ("server", ("gpuwatch.agent",)),
    ],
)
def test_packages_do_not_import_across_the_boundary(
    subpackage: str, forbidden: tuple[str, ...]
) -> None:
    crossings = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in _modules(subpackage)
        for name in _imported(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert crossings == []


_EVENT_TABLES = {"Event", "OutboxRow"}


def _writes_event_rows(tree: ast.AST) -> Iterator[int]:
    """Line numbers of ``Event(...)``, ``insert(Event...)`` or ``update(Event...)``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id in _EVENT_TABLES:
            yield node.lineno
        elif node.func.id in {"insert", "update", "insert_ignoring_conflicts"} and node.args:
            target = node.args[0]
            while isinstance(target, ast.Attribute):
                target = target.value
            if isinstance(target, ast.Name) and target.id in _EVENT_TABLES:
                yield node.lineno


def test_only_the_events_package_writes_event_rows() -> None:
    writers = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if PACKAGE / "server" / "events" not in path.parents
        for line in _writes_event_rows(ast.parse(path.read_text()))
    ]
    assert writers == []


def test_the_check_sees_a_writer() -> None:
    # The rule above must be able to fail: it flags the shapes it looks for.
    source = "update(Event).values(x=1)\ninsert_ignoring_conflicts(Event.__table__, 'pg')\n"
    assert sorted(_writes_event_rows(ast.parse(source))) == [1, 2]


# What ``gpuwatch agent`` does without, each with what it would cost the agent's RSS:
# settings are merged in gpuwatch.settings (pydantic-settings, and the asyncio,
# argparse and python-dotenv it imports: 3.5 MiB), its options are read without typer
# (typer and the click it vendors: 1.6 MiB; rich, which typer shows help and errors
# with, only on those paths), and only the agent command is registered (the others'
# modules: 1.3 MiB). Nor anything of the server: ServerSettings and the alert and
# receiver settings it holds live in gpuwatch.server_settings (0.7 MiB). The reaper's
# automatic policy, and the detectors it judges with, load only when it is on (0.6 MiB).
AGENT_NEVER_IMPORTS = (
    "httpx",
    "pydantic_settings",
    "dotenv",
    "asyncio",
    "argparse",
    "typer",
    "click",
    "rich",
    "gpuwatch.cli.demo",
    "gpuwatch.cli.history",
    "gpuwatch.cli.alerts",
    "gpuwatch.server",
    "gpuwatch.server_settings",
    "gpuwatch.agent.reaper.auto",
    "gpuwatch.agent.reaper.policy",
    "gpuwatch.detectors",
)


def _imports_of_a_running_agent(tmp_path: Path) -> set[str]:
    """Every module a real ``gpuwatch agent`` (simulated GPUs, pushing to a server that
    is away) imported by the time it had served a scrape, from ``python -X importtime``."""
    # Its own spool: the default one (root's /var/lib/gpuwatch/spool) takes one agent.
    env = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path),
        "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_AGENT_SPOOL_DIR": str(tmp_path / "spool"),
    }
    # --log-level: a root option before the command keeps the agent off typer too.
    command = [sys.executable, "-X", "importtime", "-m", "gpuwatch", "--log-level", "info"]
    command += ["agent"]
    command += ["--fake-gpus", "workstation", "--listen", "127.0.0.1:0"]
    command += ["--server", "http://127.0.0.1:9", "--token", "t" * 32]
    agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    assert agent.stderr is not None
    lines: list[str] = []
    try:
        for line in agent.stderr:
            lines.append(line)
            if "gpuwatch agent: serving " in line:
                url = line.split("serving ", 1)[1].strip()
                with urllib.request.urlopen(url, timeout=60) as scrape:
                    assert scrape.status == 200
                break
        agent.send_signal(signal.SIGTERM)
        lines += agent.communicate(timeout=60)[1].splitlines()
    finally:
        agent.kill()
        subprocess.run(
            [sys.executable, "-m", "gpuwatch", "fake-nvml", "stop", "--all"],
            env=env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    return {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}


def test_the_agent_process_does_without_the_heavy_packages(tmp_path: Path) -> None:
    imported = _imports_of_a_running_agent(tmp_path)
    # The listing is complete enough to trust its absences: what the agent uses is in it.
    assert {"gpuwatch.agent.reporter", "gpuwatch.agent.exporter", "pynvml"} <= imported
    unwanted = sorted(
        name
        for name in imported
        if any(name == f or name.startswith(f + ".") for f in AGENT_NEVER_IMPORTS)
    )
    assert unwanted == []
