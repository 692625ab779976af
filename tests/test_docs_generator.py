"""``python -m gpuwatch.docs``: what it generates, and that it writes only when asked."""

from __future__ import annotations

import pytest

from gpuwatch import docs


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["-h"], 0), (["--chek"], 2)])
def test_an_argument_other_than_check_writes_nothing(
    argv: list[str], code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: any argument but --check rewrote docs/*.md, a local edit lost without a word.
    def must_not_generate() -> dict[str, str]:
        raise AssertionError("the pages were generated (and would be written)")

    monkeypatch.setattr(docs, "documents", must_not_generate)
    assert docs.main(argv) == code
    assert "usage: python -m gpuwatch.docs [--check]" in capsys.readouterr().err


def test_the_configuration_reference_says_something_of_every_rule_and_default() -> None:
    text = docs.configuration_markdown()
    # Rules of the base class showed its docstring, which says nothing of when they fire.
    for rule in ("runaway_process", "gpu_lost", "gpu_ecc_uncorrected", "agent_silent"):
        section = text.split(f"### `[server.alerts.rules.{rule}]`", 1)[1].split("###", 1)[0]
        assert "What every rule has" not in section
        assert "alerts.md#the-shipped-rules" in section
    assert "computed (see description)" not in text
    assert "| Literal |" not in text and "`loopback` or `token` or `open`" in text
    assert "names no setting" in text  # the environment is checked, and says so
