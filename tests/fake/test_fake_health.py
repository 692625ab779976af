"""The fake's health symbols, through the real pynvml: ECC, retirement, throttling, energy,
Xid event sets, field values, PCIe, BAR1 on MIG; and the scenario keys that drive them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pynvml as nv
import pytest

from gpuwatch.errors import ScenarioError
from gpuwatch.nvml import fake
from gpuwatch.nvml.fake import load_scenario

MIB = 2**20

BOARDS = """
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
reserved = "512MiB"
cuda_capability = "8.0"
bar1_total = "128GiB"
fans = 0
memory_temperature_celsius = { linear = [40, 60], over = "100s" }
ecc_uncorrected = { steps = [["0s", 0], ["50s", 3]] }
remapped_rows_uncorrectable = 2
remapped_rows_failure = true
pcie_replay = { linear = [0, 100], over = "100s" }
xid = [["10s", 13], ["10s", 31], ["40s", 79]]
[[gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"
[[gpu.mig]]
profile = "1g.10gb"
memory_total = "10GiB"

[[gpu]]
name = "Tesla V100-SXM2-32GB"
memory_total = "32GiB"
cuda_capability = "7.0"
ecc = false
retired_pages_double_bit = 3
throttle_reasons = ["sw_power_cap", "hw_power_brake_slowdown"]
power_watts = { linear = [100, 300], over = "100s" }
xid = [["20s", 48]]

[[process]]
gpu = 0
mig = 0
ghost = 30001
memory = "4GiB"
"""


@pytest.fixture
def host(
    write_scenario: Callable[..., Path], runtime_dir: Path, clock: Callable[[], float]
) -> fake.FakeHost:
    installed = fake.install(write_scenario(BOARDS), runtime_dir=runtime_dir, clock=clock)
    clock.now = installed.state.epoch  # type: ignore[attr-defined]
    return installed


def at(host: fake.FakeHost, clock: Callable[[], float], seconds: float) -> None:
    clock.now = host.state.epoch + seconds  # type: ignore[attr-defined]


def handle(index: int) -> object:
    return nv.nvmlDeviceGetHandleByIndex(index)


def test_ecc_counts_follow_the_scenario_and_need_ecc_on(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    uncorrected, volatile, aggregate = (
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC,
    )  # fmt: skip
    at(host, clock, 49)
    assert nv.nvmlDeviceGetTotalEccErrors(handle(0), uncorrected, volatile) == 0
    at(host, clock, 50)
    assert nv.nvmlDeviceGetTotalEccErrors(handle(0), uncorrected, volatile) == 3
    assert nv.nvmlDeviceGetTotalEccErrors(handle(0), uncorrected, aggregate) == 3
    assert nv.nvmlDeviceGetEccMode(handle(1)) == [0, 0]
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEccErrors(handle(1), uncorrected, volatile)


def test_ampere_remaps_rows_and_older_boards_retire_pages(host: fake.FakeHost, nvml: None) -> None:
    assert nv.nvmlDeviceGetRemappedRows(handle(0)) == (0, 2, 0, 1)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetRetiredPages(handle(0), nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pages = nv.nvmlDeviceGetRetiredPages(
        handle(1), nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    assert len(pages) == 3 and len(set(pages)) == 3
    with_times = nv.nvmlDeviceGetRetiredPages_v2(
        handle(1), nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    )
    assert with_times == []
    assert nv.nvmlDeviceGetRetiredPagesPendingStatus(handle(1)) == 0
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetRemappedRows(handle(1))


def test_throttle_reasons_under_both_names(host: fake.FakeHost, nvml: None) -> None:
    expected = nv.nvmlClocksEventReasonSwPowerCap | nv.nvmlClocksEventReasonHwPowerBrakeSlowdown
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(handle(1)) == expected
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle(1)) == expected
    # Derived: GPU 0 is in MIG mode with a process holding memory but no SM: idle.
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(handle(0)) == nv.nvmlClocksEventReasonGpuIdle


def test_energy_is_the_integral_of_power(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    at(host, clock, 100)  # 100 -> 300 W over 100 s: 20 kJ
    assert nv.nvmlDeviceGetTotalEnergyConsumption(handle(1)) == 20_000_000  # mJ
    at(host, clock, 110)
    assert nv.nvmlDeviceGetTotalEnergyConsumption(handle(1)) == 23_000_000


def test_fans_memory_temperature_pcie_and_field_values(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    at(host, clock, 50)
    assert nv.nvmlDeviceGetNumFans(handle(0)) == 0
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetFanSpeed(handle(0))
    assert nv.nvmlDeviceGetFanSpeed(handle(1)) == 30
    assert nv.nvmlDeviceGetPcieReplayCounter(handle(0)) == 50
    values = nv.nvmlDeviceGetFieldValues(
        handle(0), [nv.NVML_FI_DEV_MEMORY_TEMP, nv.NVML_FI_DEV_NVLINK_LINK_COUNT, 12345]
    )
    assert (values[0].nvmlReturn, values[0].value.uiVal) == (nv.NVML_SUCCESS, 50)
    assert (values[1].nvmlReturn, values[1].value.uiVal) == (nv.NVML_SUCCESS, 0)
    assert values[2].nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
    (no_sensor,) = nv.nvmlDeviceGetFieldValues(handle(1), [nv.NVML_FI_DEV_MEMORY_TEMP])
    assert no_sensor.nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
    assert nv.nvmlDeviceGetPcieThroughput(handle(1), nv.NVML_PCIE_UTIL_TX_BYTES) > 0


def test_bar1_is_per_mig_instance_too(host: fake.FakeHost, nvml: None) -> None:
    whole = nv.nvmlDeviceGetBAR1MemoryInfo(handle(0))
    big = nv.nvmlDeviceGetBAR1MemoryInfo(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0))
    small = nv.nvmlDeviceGetBAR1MemoryInfo(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 1))
    assert whole.bar1Total == 128 * 1024 * MIB
    assert big.bar1Total > small.bar1Total > 0 and big.bar1Total + small.bar1Total < whole.bar1Total
    assert big.bar1Used > small.bar1Used  # the instance with a process maps more
    with pytest.raises(nv.NVMLError_NotSupported):  # MIG mode: no utilisation, as nvidia-smi
        nv.nvmlDeviceGetUtilizationRates(handle(0))


def test_xid_events_come_after_registration_each_once(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    events = nv.nvmlEventSetCreate()
    assert nv.nvmlDeviceGetSupportedEventTypes(handle(0)) & nv.nvmlEventTypeXidCriticalError
    at(host, clock, 5)
    nv.nvmlDeviceRegisterEvents(handle(0), nv.nvmlEventTypeXidCriticalError, events)
    at(host, clock, 15)  # GPU 1 registers before its Xid 48 (at 20 s)
    nv.nvmlDeviceRegisterEvents(handle(1), nv.nvmlEventTypeXidCriticalError, events)

    def drain() -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(events, 0)
            except nv.NVMLError_Timeout:
                return seen
            assert data.eventType == nv.nvmlEventTypeXidCriticalError
            seen.append((nv.nvmlDeviceGetIndex(data.device), data.eventData))

    assert drain() == [(0, 13), (0, 31)]
    assert drain() == []
    at(host, clock, 45)
    assert drain() == [(1, 48), (0, 79)]
    nv.nvmlEventSetFree(events)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlEventSetWait_v2(events, 0)


def test_an_event_set_registered_late_misses_earlier_events(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    events = nv.nvmlEventSetCreate()
    at(host, clock, 30)
    nv.nvmlDeviceRegisterEvents(handle(1), nv.nvmlEventTypeXidCriticalError, events)
    at(host, clock, 60)
    with pytest.raises(nv.NVMLError_Timeout):
        nv.nvmlEventSetWait_v2(events, 0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('ecc_uncorrected = { linear = [5, 1], over = "1m" }', "never decreases"),
        ('pcie_replay = { sawtooth = [0, 5], period = "1m" }', "never decreases"),
        ('throttle_reasons = ["too_hot"]', "unknown reason 'too_hot'"),
        ('throttle_reasons = { linear = [[], ["gpu_idle"]], over = "1m" }', "list"),
        ('xid = [["2m", 79], ["1m", 48]]', "time order"),
        ('xid = [["1m", 0]]', "1..65535"),
        ("fans = 99", "at most 32"),
        ("ecc = 1", "true or false"),
    ],
)
def test_health_keys_are_checked(
    write_scenario: Callable[..., Path], line: str, message: str
) -> None:
    path = write_scenario(f'[[gpu]]\nmemory_total = "80GiB"\n{line}\n')
    with pytest.raises(ScenarioError, match=message):
        load_scenario(path)
