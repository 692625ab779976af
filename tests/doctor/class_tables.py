"""The two tests every table of wordings by class runs (test_doctor_*_classes.py,
test_doctor_more_families.py): each wording is recognised with its figures, and each
near miss is not recognised at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from gpuwatch.doctor.parse import parse_oom
from gpuwatch.errors import NotRecognized


def _short(value: object) -> str:
    """A parametrize id: the start of the wording."""
    return str(value)[:50]


def class_tests(
    positive: Sequence[tuple[str, dict[str, Any]]], negative: Sequence[str]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """``(recognised, not_recognised)``: bind them to ``test_`` names in the module."""

    @pytest.mark.parametrize(("text", "expected"), positive, ids=_short)
    def recognised(text: str, expected: dict[str, Any]) -> None:
        facts = parse_oom(text)
        for field, want in expected.items():
            assert getattr(facts, field) == want, f"{field}: {getattr(facts, field)!r}"

    @pytest.mark.parametrize("text", negative, ids=_short)
    def not_recognised(text: str) -> None:
        with pytest.raises(NotRecognized):
            parse_oom(text)

    return recognised, not_recognised
