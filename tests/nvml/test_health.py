"""Health reads (gpuwatch.nvml.health) over the real pynvml and the fake GPUs beneath it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

MHZ = 1_000_000

HEALTH = """
[fake]
name = "health"
lifetime = "2m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
power_watts = 250
fans = 0
memory_temperature_celsius = 51
throttle_reasons = { steps = [["0s", []], ["60s", ["sw_thermal_slowdown", "hw_slowdown"]]] }
ecc_corrected = { linear = [0, 100], over = "100s" }
ecc_uncorrected = { steps = [["0s", 0], ["30s", 2]] }
remapped_rows_correctable = 3
remapped_rows_uncorrectable = { steps = [["0s", 0], ["30s", 1]] }
remapped_rows_pending = true
pcie_replay = 7
xid = [["10s", 48], ["20s", 63], ["300s", 79]]

[[gpu]]
name = "Tesla V100-SXM2-32GB"
memory_total = "32GiB"
cuda_capability = "7.0"
ecc = false
fan_percent = 55
retired_pages_single_bit = 2
retired_pages_double_bit = 1
retired_pages_pending = true
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def host(tmp_path: Path, clock: Clock) -> Iterator[fake.FakeHost]:
    path = tmp_path / "health.toml"
    path.write_text(HEALTH)
    installed = fake.install(path, runtime_dir=tmp_path / "runtime", clock=clock)
    clock.now = installed.state.epoch  # scenario time 0
    yield installed
    fake.uninstall()
    installed.stop()


def test_health_of_an_ampere_board(host: fake.FakeHost, clock: Clock) -> None:
    with NvmlSession.open() as session:
        clock.now += 40
        gpu = session.read_device(0)
    assert gpu.clock_sm_hertz == 345 * MHZ  # idle: no process
    assert gpu.clock_memory_hertz == 2619 * MHZ
    assert gpu.energy_joules == pytest.approx(250 * 40)
    assert gpu.fan_ratio is None  # passively cooled
    assert gpu.memory_temperature_celsius == 51
    assert gpu.throttle_reasons == []
    assert (gpu.ecc_uncorrected_volatile, gpu.ecc_uncorrected_aggregate) == (2, 2)
    assert (gpu.ecc_corrected_volatile, gpu.ecc_corrected_aggregate) == (40, 40)
    assert (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable) == (3, 1)
    assert (gpu.remapped_rows_pending, gpu.remapped_rows_failure) == (True, False)
    # Ampere remaps rows; page retirement is not supported: unknown, not 0.
    assert gpu.retired_pages_single_bit is None and gpu.retired_pages_pending is None
    assert gpu.pcie_replay_errors == 7
    assert (gpu.encoder_ratio, gpu.decoder_ratio) == (0.0, 0.0)


def test_health_of_an_older_board(host: fake.FakeHost) -> None:
    with NvmlSession.open() as session:
        gpu = session.read_device(1)
    assert (gpu.retired_pages_single_bit, gpu.retired_pages_double_bit) == (2, 1)
    assert gpu.retired_pages_pending is True
    assert gpu.remapped_rows_correctable is None and gpu.remapped_rows_pending is None
    assert gpu.ecc_uncorrected_volatile is None  # ECC off
    assert gpu.memory_temperature_celsius is None  # no HBM sensor
    assert gpu.fan_ratio == 0.55
    assert gpu.throttle_reasons == ["gpu_idle"]  # derived: idle


def test_throttle_reasons_follow_the_scenario(host: fake.FakeHost, clock: Clock) -> None:
    with NvmlSession.open() as session:
        clock.now += 61
        assert session.read_device(0).throttle_reasons == ["hw_slowdown", "sw_thermal_slowdown"]


def test_older_drivers_answer_under_the_old_throttle_name(
    host: fake.FakeHost, clock: Clock
) -> None:
    # Before R535 only nvmlDeviceGetCurrentClocksThrottleReasons exists.
    with NvmlSession.open() as session:
        session._missing.add("nvmlDeviceGetCurrentClocksEventReasons")
        clock.now += 61
        assert session.read_device(0).throttle_reasons == ["hw_slowdown", "sw_thermal_slowdown"]


def test_what_a_board_does_not_support_is_asked_and_counted_once(host: fake.FakeHost) -> None:
    with NvmlSession.open() as session:
        for _ in range(3):
            session.read_device(0)
            session.read_device(1)
        counts = session.errors.snapshot()
    assert counts[("nvmlDeviceGetFanSpeed", "not_supported")] == 1
    assert counts[("nvmlDeviceGetRetiredPages", "not_supported")] == 1
    assert counts[("nvmlDeviceGetRemappedRows", "not_supported")] == 1
    assert counts[("nvmlDeviceGetTotalEccErrors", "not_supported")] == 1
    assert counts[("nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)", "not_supported")] == 1


def test_xid_events_are_counted_from_when_the_agent_started_watching(
    host: fake.FakeHost, clock: Clock
) -> None:
    with NvmlSession.open() as session:
        clock.now += 15  # Xid 48 at 10 s: before the first read, so never delivered
        first = session.read_device(0)
        assert (first.xid_errors, first.xid_last_code) == (0, None)
        clock.now += 10  # Xid 63 at 20 s
        second = session.read_device(0)
        assert (second.xid_errors, second.xid_last_code) == (1, 63)
        third = session.read_device(0)  # each event once
        assert (third.xid_errors, third.xid_last_code) == (1, 63)
        clock.now += 300  # Xid 79 at 300 s
        assert session.read_device(0).xid_last_code == 79
        assert session.read_device(0).xid_errors == 2
        # The GPU without Xid events still has a working watch: 0, not unknown.
        assert session.read_device(1).xid_errors == 0


def test_energy_never_goes_back(host: fake.FakeHost, clock: Clock) -> None:
    readings: list[float] = []
    with NvmlSession.open() as session:
        for _ in range(5):
            clock.now += 7
            energy = session.read_device(1).energy_joules
            assert energy is not None
            readings.append(energy)
    assert readings == sorted(readings) and 0 < readings[0] < readings[-1]


def test_mig_instances_carry_their_gpu_instance_id_and_profile(tmp_path: Path) -> None:
    installed = fake.install("a100-mig", runtime_dir=tmp_path / "runtime", at=3600)
    try:
        with NvmlSession.open() as session:
            gpu = session.read_device(0)
    finally:
        fake.uninstall()
        installed.stop()
    assert [(m.gpu_instance_id, m.profile) for m in gpu.mig] == [
        (1, "3g.40gb"), (2, "2g.20gb"), (3, "2g.20gb"),
    ]  # fmt: skip
    assert gpu.utilization_ratio is None  # NVML reports no utilisation in MIG mode
