"""XLA on a TPU, at compile time: "Used X of Y hbm" is the program's whole footprint,
and the advice is a TPU's (no GPU preallocation to turn off)."""

from __future__ import annotations

from gpuwatch.doctor.explain import explain

MESSAGE = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
    "hbm. Used 17.60G of 15.48G hbm. Exceeded hbm capacity by 2.12G."
)


def test_tpu_compile_oom_is_the_programs_footprint_with_tpu_advice() -> None:
    first = explain(MESSAGE).diagnoses[0]
    assert "compiled program needs 17.60 GiB" in first.evidence
    assert "one allocation" not in first.evidence
    commands = " ".join(first.commands)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in commands
    assert "jax.checkpoint" in commands
