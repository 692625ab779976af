"""Unattributed memory comes only from a consistent read of memory and processes.

The real sampler and pynvml run over the fake GPUs. The fake host's clock moves on at
every reading, so each NVML call sees a later moment, and a process frees 19 GiB at
one moment: sliding that moment across a poll puts the free between every pair of
calls the poll makes. Whatever pair it falls between, the snapshot must report either
the true unattributed figure (1 GiB) or ``None`` (unknown), never the 19 GiB the free
would fake.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

GiB = 2**30
FREED_AT = 100.0  # scenario seconds
STEP = 0.001  # scenario seconds each clock reading moves on

SCENARIO = f"""
[fake]
name = "consistent-read"
lifetime = "2m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
unattributed = "1GiB"

[[process]]
gpu = 0
ghost = 4100001
memory = {{ steps = [["0s", "20GiB"], ["{FREED_AT:.0f}s", "1GiB"]] }}
"""


class TickingClock:
    """Unix seconds that move on by ``STEP`` at every reading."""

    def __init__(self) -> None:
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.now += STEP
        self.readings += 1
        return self.now


@pytest.fixture
def sampler(tmp_path: Path) -> Iterator[tuple[Sampler, TickingClock, float]]:
    """A sampler over the scenario, its fake host's clock, and the scenario's epoch."""
    path = tmp_path / "scenario.toml"
    path.write_text(SCENARIO)
    clock = TickingClock()
    host = fake.install(path, runtime_dir=tmp_path / "runtime", clock=clock, at=None)
    clock.now = host.state.epoch
    session = NvmlSession.open()
    identity = HostIdentity(agent_id="agent-1", hostname="gpu-box", boot_id="boot-1")
    try:
        yield Sampler(session, ProcInfo(), identity, timeout_seconds=10), clock, host.state.epoch
    finally:
        session.close()
        fake.uninstall()
        host.stop()


def test_a_free_during_the_read_never_shows_as_unattributed(sampler) -> None:
    poll, clock, epoch = sampler
    before = clock.readings
    poll.poll()
    readings = clock.readings - before
    assert readings > 5  # the poll made that many NVML-side clock readings

    seen: list[int | None] = []
    # The free falls before reading k of the poll, for every k, and after the last.
    for k in range(readings + 2):
        clock.now = epoch + FREED_AT - (k + 0.5) * STEP
        gpu = poll.poll().gpus[0]
        seen.append(gpu.unattributed_bytes)
        assert gpu.unattributed_bytes in (None, 1 * GiB), f"free before reading {k}"
    # Frees outside the memory/process reads leave a trustworthy figure ...
    assert seen[0] == 1 * GiB and seen[-1] == 1 * GiB
    # ... and the ones between them make it unknown rather than wrong.
    assert None in seen


def test_a_steady_gpu_reports_its_unattributed_memory(sampler) -> None:
    poll, clock, epoch = sampler
    clock.now = epoch + 10.0
    gpu = poll.poll().gpus[0]
    assert gpu.unattributed_bytes == 1 * GiB
    assert [p.used_bytes for p in gpu.processes] == [20 * GiB]
