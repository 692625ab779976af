"""docs/scenarios.md stays honest: every fake NVML function and bundled scenario is in it."""

from __future__ import annotations

import re
from pathlib import Path

from gpuwatch.nvml.fake import bundled_scenario_names
from gpuwatch.nvml.fake.library import implemented_symbols
from gpuwatch.nvml.fake.scenario import symbol_family

DOC = Path(__file__).resolve().parents[2] / "docs" / "scenarios.md"


def test_every_implemented_function_is_documented_and_no_other() -> None:
    mentioned = set(re.findall(r"`(nvml[A-Z]\w+)`", DOC.read_text(encoding="utf-8")))
    implemented = set(implemented_symbols())
    families = {symbol_family(name) for name in implemented}
    assert families - mentioned == set()
    # nvmlMemory_v2 is the struct version constant, mentioned in prose.
    assert mentioned - families - implemented - {"nvmlMemory_v2"} == set()


def test_every_bundled_scenario_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert [name for name in bundled_scenario_names() if f"| `{name}`" not in text] == []
