"""GPM figures of GPUs and MIG instances (gpuwatch.nvml.gpm) over the real pynvml and the
fake GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from support.clock import FakeClock

from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

SCENARIO = """
[fake]
name = "gpm"
lifetime = "2m"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
[[gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"
gpu_instance_id = 2
[[gpu.mig]]
profile = "2g.20gb"
memory_total = "20GiB"
gpu_instance_id = 3

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
[[gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"

[[process]]
gpu = 0
mig = 0
ghost = 30001
memory = "4GiB"
sm_percent = { steps = [["0s", 40], ["90s", 0]] }
[[process]]
gpu = 0
mig = 1
ghost = 30002
memory = "4GiB"
[[process]]
gpu = 1
mig = 0
ghost = 30003
memory = "4GiB"
sm_percent = 50

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
memory_busy_percent = 30

[[process]]
gpu = 2
ghost = 30004
memory = "4GiB"
sm_percent = 80
tensor_percent = { steps = [["0s", 60], ["45s", 0]] }

[[fault]]
gpu = 0
kind = "gpu_lost"
at = "100s"
"""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_800_000_000.0)


@pytest.fixture
def session(tmp_path: Path, clock: FakeClock) -> Iterator[NvmlSession]:
    path = tmp_path / "gpm.toml"
    path.write_text(SCENARIO, encoding="utf-8")
    installed = fake.install(path, runtime_dir=tmp_path / "runtime", clock=clock)
    clock.now = installed.state.epoch
    opened = NvmlSession.open()
    try:
        yield opened
    finally:
        opened.close()
        fake.uninstall()
        installed.stop()


def _activity(session: NvmlSession, index: int) -> list[float | None]:
    return [m.activity_ratio for m in session.read_device(index).mig]


def test_each_instance_reads_its_activity_since_the_previous_poll(
    session: NvmlSession, clock: FakeClock
) -> None:
    assert _activity(session, 0) == [None, None]  # the first poll has nothing to pair with
    clock.advance(30)
    assert _activity(session, 0) == [0.4, 0.0]
    clock.advance(30)
    assert _activity(session, 0) == [0.4, 0.0]
    clock.advance(35)  # 60 s..95 s: 40 % until 90 s, then nothing: 34 % on average
    assert _activity(session, 0) == [0.34, 0.0]


def test_processes_on_mig_carry_their_gpu_instance(session: NvmlSession) -> None:
    rows = {p.pid: p.gpu_instance_id for p in session.read_device(0).processes}
    assert rows == {30001: 2, 30002: 3}


def test_an_a100_has_no_instance_activity_and_no_error_counted(
    session: NvmlSession, clock: FakeClock
) -> None:
    for _ in range(3):
        assert _activity(session, 1) == [None]
        clock.advance(30)
    assert not [key for key in session.errors.snapshot() if key[0].startswith("nvmlGpm")]


def test_a_lost_gpu_frees_its_sample_buffers(session: NvmlSession, clock: FakeClock) -> None:
    buffers = pynvml.nvmlLib.gpm_samples  # the fake library's allocations
    _activity(session, 0)
    assert len(buffers) == 6  # two for the GPU and two per instance, reused every poll
    clock.advance(30)
    _activity(session, 0)
    assert len(buffers) == 6
    clock.advance(80)  # past the GPU's loss at 100 s
    assert session.read_device(0).lost
    assert len(buffers) == 0


def test_a_whole_gpu_reads_every_gpm_figure_the_driver_answers(
    session: NvmlSession, clock: FakeClock
) -> None:
    assert session.read_device(2).gpm is None  # no pair yet
    clock.advance(30)
    first = session.read_device(2).gpm
    assert first is not None
    assert (first.graphics_ratio, first.sm_active_ratio) == (0.8, 0.8)
    assert (first.tensor_ratio, first.dram_ratio) == (0.6, 0.3)
    # The fake's PCIe: 200 KB/s + 60 MB/s x 80 % busy, in bytes/s (nvml.h: MiB/s).
    assert first.pcie_tx_bytes_per_second == first.pcie_rx_bytes_per_second == 48_200_000
    # Metrics the driver answers NOT_SUPPORTED in their own slot: unknown, not 0.
    assert first.sm_occupancy_ratio is None and first.fp32_ratio is None
    clock.advance(30)  # 30 s..60 s: tensor busy until 45 s, half the interval
    second = session.read_device(2).gpm
    assert second is not None and second.tensor_ratio == 0.3


def test_mig_instances_read_their_own_figures_and_their_gpu_its_own(
    session: NvmlSession, clock: FakeClock
) -> None:
    session.read_device(0)
    clock.advance(30)
    reading = session.read_device(0)
    busy, idle = (m.gpm for m in reading.mig)
    assert busy is not None and idle is not None
    assert (busy.graphics_ratio, busy.dram_ratio) == (0.4, 0.16)  # memory busy: 40 % of SM
    assert (idle.graphics_ratio, idle.tensor_ratio) == (0.0, 0.0)
    assert busy.pcie_tx_bytes_per_second is None  # the fake has no per-instance PCIe
    assert reading.gpm is not None and reading.gpm.graphics_ratio == 0.4
