"""docs/deploy.md cannot drift from the files it explains."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
# Plumbing, not security: the doc need not explain these.
NOT_SECURITY = {
    "Type", "ExecStart", "Environment", "RestartSec", "TimeoutStopSec", "Group",
    "StateDirectoryMode", "SystemCallArchitectures",
}  # fmt: skip


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_repository_path_in_the_doc_exists(doc: str) -> None:
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|grafana|docs|tests)/[\w./-]*\w)", doc))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).exists() and "*" not in p)
    assert not missing, missing


@pytest.mark.parametrize("unit", UNITS, ids=[u.stem for u in UNITS])
def test_every_hardening_directive_of_the_units_is_explained(doc: str, unit: Path) -> None:
    service = unit.read_text(encoding="utf-8").split("[Service]", 1)[1].split("\n[", 1)[0]
    keys = set(re.findall(r"^([A-Z]\w+)=", service, flags=re.MULTILINE))
    assert "ProtectSystem" in keys
    unexplained = sorted(k for k in keys - NOT_SECURITY if k not in doc)
    assert not unexplained, f"{unit.name}: not in docs/deploy.md: {unexplained}"


def test_every_alert_is_in_the_doc(doc: str, all_rules: list[dict[str, Any]]) -> None:
    missing = [r["alert"] for r in all_rules if "alert" in r and f"`{r['alert']}`" not in doc]
    assert not missing, missing
