"""Package boundaries that the design relies on, checked on the source itself.

* ``gpuwatch.detectors`` is pure: the server uses it now and the agent's reaper next,
  so it imports neither of them.
* ``gpuwatch.agent`` and ``gpuwatch.server`` never import each other; what both need
  lives beside ``gpuwatch/snapshot.py`` (``wire``, ``metricspec``, ``detectors``).
* One event path: only ``gpuwatch/server/events/`` writes ``events`` rows (and their
  outbox rows). Everything else goes through its ``EventBook`` or service.

Imports are read with ``ast``, function-level ones included, so a lazy import cannot
slip past.
"""

from __future__ import annotations

import ast
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
