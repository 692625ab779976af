"""Advice that fits what the message and the live view say: XLA on a TPU at compile time
(the program's footprint, no GPU preallocation), PyTorch on MPS (autocast on "mps"), and
a holder that is busy now (gpuwatch reap stops only idle ones)."""

from __future__ import annotations

from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.live import LiveGpu, LiveProcess
from gpuwatch.doctor.remedies import reap_commands

TPU_COMPILE = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
    "hbm. Used 17.60G of 15.48G hbm. Exceeded hbm capacity by 2.12G."
)
MPS = (
    "RuntimeError: MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: "
    "1.50 GB, max allowed: 18.13 GB). Tried to allocate 1.00 GB on private pool."
)


def test_tpu_compile_oom_is_the_programs_footprint_with_tpu_advice() -> None:
    first = explain(TPU_COMPILE).diagnoses[0]
    assert "compiled program needs 17.60 GiB" in first.evidence
    assert "one allocation" not in first.evidence
    commands = " ".join(first.commands)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in commands
    assert "jax.checkpoint" in commands


def test_mps_advice_casts_on_the_mps_device() -> None:
    commands = " ".join(c for d in explain(MPS).diagnoses for c in d.commands)
    assert 'device_type="cuda"' not in commands
    assert 'device_type="mps"' in commands


def test_a_busy_holder_is_not_offered_to_the_reaper() -> None:
    gpu = LiveGpu(
        hostname="box",
        index=0,
        collected_at=0.0,
        processes=[
            LiveProcess(pid=13180, user="bo", used_bytes=30 * 2**30, sm_ratio=0.86),
            LiveProcess(pid=4242, user="ana", used_bytes=20 * 2**30, sm_ratio=0.0),
        ],
    )
    commands = reap_commands(gpu, min_bytes=2**30)
    assert not any("reap --pid 13180" in c for c in commands)
    assert any("busy now: ask bo" in c for c in commands)
    assert any("reap --pid 4242" in c for c in commands)
