"""The real pynvml, unmodified, against the fake library: every NVML code path it can hit.

These scenarios use ghost PIDs only (no stand-ins), so they need no real processes;
stand-ins are covered in test_fake_standins.py.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from gpuwatch.nvml import fake

GIB = 2**30
MIB = 2**20

CODE_PATHS = """
[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
reserved = "512MiB"
unattributed = "1GiB"
power_limit_watts = 700
[[gpu]]
memory_total = "16GiB"
reserved = "256MiB"
[[gpu]]
memory_total = "16GiB"
coherent = true

[[process]]
gpu = 0
ghost = 30001
count = 3
memory = "2GiB"
sm_percent = 40
[[process]]
gpu = 0
ghost = 30010
kind = "graphics"
memory = "256MiB"
[[process]]
gpu = 1
ghost = 30020
memory = "3GiB"
memory_not_available = true
[[process]]
gpu = 1
ghost = 30021
memory = { linear = ["1GiB", "5GiB"], over = "4m" }
start = "1m"
exit = "10m"

[[fault]]
gpu = 1
kind = "unsupported"
function = "nvmlDeviceGetPowerUsage"
[[fault]]
gpu = 1
kind = "no_permission"
function = "nvmlDeviceGetComputeRunningProcesses"
at = "20m"
duration = "5m"
[[fault]]
gpu = 2
kind = "gpu_lost"
at = "5m"
[[fault]]
gpu = 0
kind = "hang"
function = "nvmlDeviceGetTemperature"
seconds = 0.3
at = "30m"
"""


@pytest.fixture
def host(
    write_scenario: Callable[..., Path], runtime_dir: Path, clock: Callable[[], float]
) -> fake.FakeHost:
    installed = fake.install(write_scenario(CODE_PATHS), runtime_dir=runtime_dir, clock=clock)
    clock.now = installed.state.epoch  # type: ignore[attr-defined]
    return installed


def at_minutes(host: fake.FakeHost, clock: Callable[[], float], minutes: float) -> None:
    clock.now = host.state.epoch + minutes * 60  # type: ignore[attr-defined]


def handle(index: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def test_calls_before_nvml_init_are_uninitialized(host: fake.FakeHost) -> None:
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


@pytest.mark.usefixtures("host", "nvml")
def test_identity_and_lookups() -> None:
    assert pynvml.nvmlDeviceGetCount() == 3
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12040
    uuid = pynvml.nvmlDeviceGetUUID(handle(1))
    assert uuid.startswith("GPU-") and uuid != pynvml.nvmlDeviceGetUUID(handle(0))
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == 1
    assert pynvml.nvmlDeviceGetName(handle(0)) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetPciInfo(handle(2)).busId == "00000000:03:00.0"
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(b"00000000:02:00.0")) == 1
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID(b"GPU-nope")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetName(pynvml.c_nvmlDevice_t())  # a NULL handle


@pytest.mark.usefixtures("host", "nvml")
def test_memory_v2_separates_reserved_and_v1_counts_it_as_used() -> None:
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
    held = 3 * 2 * GIB + 256 * MIB + 1 * GIB  # processes + graphics + unattributed
    assert (v2.total, v2.reserved, v2.used) == (80 * GIB, 512 * MIB, held)
    assert v2.total == v2.reserved + v2.used + v2.free
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle(0))
    assert (v1.total, v1.used, v1.free) == (80 * GIB, held + 512 * MIB, v2.free)


@pytest.mark.usefixtures("host", "nvml")
def test_memory_v2_checks_the_struct_version() -> None:
    memory = pynvml.c_nvmlMemory_v2_t()
    memory.version = 1
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")
    assert fn(handle(0), ctypes.byref(memory)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


@pytest.mark.usefixtures("host", "nvml")
def test_process_list_sizing_protocol_matches_the_c_library() -> None:
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
    count = ctypes.c_uint(0)
    assert fn(handle(0), ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    too_small = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
    count.value = 2
    assert fn(handle(0), ctypes.byref(count), too_small) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    enough = (pynvml.c_nvmlProcessInfo_v3_t * 8)()
    count.value = 8
    assert fn(handle(0), ctypes.byref(count), enough) == pynvml.NVML_SUCCESS
    assert count.value == 3
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in enough[:3]] == [
        (30001 + i, 2 * GIB, 0xFFFFFFFF) for i in range(3)
    ]
    assert fn(handle(0), None, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    # Nothing to list: SUCCESS with a count of 0 on the first call.
    count.value = 0
    assert fn(handle(2), ctypes.byref(count), None) == pynvml.NVML_SUCCESS
    assert count.value == 0
    # And pynvml's own wrapper, driving that protocol:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(30001 + i, 2 * GIB) for i in range(3)]
    assert [p.pid for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle(0))] == [30010]
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(2)) == []


def test_memory_not_available_is_none_per_process_but_still_used(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(30020, None)]
    raw = (pynvml.c_nvmlProcessInfo_v3_t * 4)()
    count = ctypes.c_uint(4)
    pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")(
        handle(1), ctypes.byref(count), raw
    )
    assert raw[0].usedGpuMemory == 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(1), version=pynvml.nvmlMemory_v2).used == 3 * GIB


def test_processes_follow_their_start_exit_and_timeline(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    def listed() -> dict[int, int | None]:
        return {
            p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))
        }

    assert 30021 not in listed()  # starts at 1m
    at_minutes(host, clock, 1)
    assert listed()[30021] == 1 * GIB
    at_minutes(host, clock, 3)  # two of the four ramp minutes: halfway
    assert listed()[30021] == 3 * GIB
    at_minutes(host, clock, 9.9)
    assert listed()[30021] == 5 * GIB
    at_minutes(host, clock, 10)  # exited: gone, and its memory freed
    assert 30021 not in listed()
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(1), version=pynvml.nvmlMemory_v2).used == 3 * GIB


def test_speed_scales_scenario_time(
    write_scenario: Callable[..., Path], runtime_dir: Path, clock: Callable[[], float]
) -> None:
    path = write_scenario(
        '[[gpu]]\nmemory_total = "16GiB"\n[[process]]\ngpu = 0\nghost = 30001\n'
        'memory = { linear = [0, "6GiB"], over = "6m" }\n'
    )
    path.write_text(path.read_text().replace("[fake]\n", "[fake]\nspeed = 60.0\n"))
    host = fake.install(path, runtime_dir=runtime_dir, clock=clock)
    pynvml.nvmlInit()
    clock.now = host.state.epoch + 3  # type: ignore[attr-defined]  # 3 wall seconds = 3 minutes
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))[0].usedGpuMemory == 3 * GIB


@pytest.mark.usefixtures("host", "nvml")
def test_unsupported_fault_is_per_gpu_and_per_function() -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetPowerUsage(handle(1))
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) > 0  # milliwatts, other GPU unaffected
    assert pynvml.nvmlDeviceGetTemperature(handle(1), pynvml.NVML_TEMPERATURE_GPU) > 0


def test_no_permission_fault_has_a_time_window_and_matches_every_version(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))
    at_minutes(host, clock, 21)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))  # _v3 beneath
    count = ctypes.c_uint(0)
    v2 = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v2")
    assert v2(handle(1), ctypes.byref(count), None) == pynvml.NVML_ERROR_NO_PERMISSION
    at_minutes(host, clock, 25)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1))


def test_process_utilization_samples_follow_last_seen_timestamp(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    samples = pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
    assert sorted((s.pid, s.smUtil) for s in samples) == [(30001, 40), (30002, 40), (30003, 40)]
    newest = max(s.timeStamp for s in samples)
    assert newest <= clock() * 1_000_000
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than what we saw
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), newest)
    clock.now += 1.0  # type: ignore[attr-defined]  # the next sample period
    assert len(pynvml.nvmlDeviceGetProcessUtilization(handle(0), newest)) == 3
    with pytest.raises(pynvml.NVMLError_NotFound):  # GPU 1's processes run nothing
        pynvml.nvmlDeviceGetProcessUtilization(handle(1), 0)


def test_video_engines_show_per_process_and_per_gpu(
    write_scenario: Callable[..., Path], runtime_dir: Path, clock: Callable[[], float]
) -> None:
    # A transcoder: NVENC busy, SMs idle. NVML lists its sample (smUtil 0, encUtil 35)
    # and the GPU's encoder utilisation; the decoder is a second process's.
    path = write_scenario(
        """
        [[gpu]]
        memory_total = "24GiB"
        [[process]]
        gpu = 0
        ghost = 777001
        memory = "1GiB"
        encoder_percent = 35
        [[process]]
        gpu = 0
        ghost = 777002
        memory = "1GiB"
        decoder_percent = { steps = [["0s", 0], ["1m", 50]] }
        """
    )
    installed = fake.install(path, runtime_dir=runtime_dir, clock=clock)
    clock.now = installed.state.epoch + 90  # type: ignore[attr-defined]
    pynvml.nvmlInit()
    try:
        gpu = handle(0)
        samples = pynvml.nvmlDeviceGetProcessUtilization(gpu, 0)
        assert sorted((s.pid, s.smUtil, s.encUtil, s.decUtil) for s in samples) == [
            (777001, 0, 35, 0),
            (777002, 0, 0, 50),
        ]
        assert pynvml.nvmlDeviceGetEncoderUtilization(gpu)[0] == 35
        assert pynvml.nvmlDeviceGetDecoderUtilization(gpu)[0] == 50
    finally:
        pynvml.nvmlShutdown()


def test_gpu_lost_fails_every_call_on_that_gpu_from_its_time(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    lost = handle(2)
    assert pynvml.nvmlDeviceGetMemoryInfo(lost).total == 16 * GIB
    at_minutes(host, clock, 5)
    for call in (
        lambda: pynvml.nvmlDeviceGetMemoryInfo(lost),
        lambda: pynvml.nvmlDeviceGetName(lost),
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(lost),
        lambda: pynvml.nvmlDeviceGetHandleByIndex(2),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert pynvml.nvmlDeviceGetCount() == 3
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).total == 80 * GIB


def test_hang_fault_really_blocks_the_call(
    host: fake.FakeHost, clock: Callable[[], float], nvml: None
) -> None:
    at_minutes(host, clock, 30)
    started = time.monotonic()
    assert pynvml.nvmlDeviceGetTemperature(handle(0), pynvml.NVML_TEMPERATURE_GPU) > 0
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    pynvml.nvmlDeviceGetPowerUsage(handle(0))
    assert time.monotonic() - started < 0.3


@pytest.mark.usefixtures("host", "nvml")
def test_missing_symbols_are_function_not_found_and_recorded() -> None:
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetNvLinkState(handle(0), 0)
    assert "nvmlDeviceGetNvLinkState" in pynvml.nvmlLib.missing


@pytest.mark.usefixtures("host", "nvml")
def test_error_strings_come_back_as_text_for_unknown_codes() -> None:
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_GPU_IS_LOST) == "GPU is lost"
    assert str(pynvml.NVMLError(4242)) == "Unknown Error"


@pytest.mark.usefixtures("host", "nvml")
def test_device_readings_are_in_nvml_units() -> None:
    h = handle(0)
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000  # milliwatts
    assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 100  # 3 x 40 % SM, capped
    assert pynvml.nvmlDeviceGetPowerUsage(h) == round(700 * (0.12 + 0.8) * 1000)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(1)).gpu == 0
    assert pynvml.nvmlDeviceGetAddressingMode(handle(2)) == pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS
    assert pynvml.nvmlDeviceGetAddressingMode(h) == pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE
    assert pynvml.nvmlDeviceGetMigMode(h) == [0, 0]


def test_mig_instances(write_scenario: Callable[..., Path], runtime_dir: Path) -> None:
    path = write_scenario(
        """
        [[gpu]]
        name = "NVIDIA A100-SXM4-80GB"
        memory_total = "80GiB"
        [[gpu.mig]]
        profile = "3g.40gb"
        memory_total = "40GiB"
        [[gpu.mig]]
        profile = "1g.10gb"
        memory_total = "10GiB"
        [[process]]
        gpu = 0
        mig = 1
        ghost = 30001
        memory = "4GiB"
        sm_percent = 50
        """
    )
    fake.install(path, runtime_dir=runtime_dir)
    pynvml.nvmlInit()
    parent = handle(0)
    assert pynvml.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    small = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(small).value == 1
    assert pynvml.nvmlDeviceGetName(small) == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert pynvml.nvmlDeviceGetUUID(small).startswith("MIG-")
    assert pynvml.nvmlDeviceGetMemoryInfo(small).used == 4 * GIB
    assert pynvml.nvmlDeviceGetMemoryInfo(small).total == 10 * GIB
    assert pynvml.nvmlDeviceGetGpuInstanceId(small) == 2
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(small)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [(30001, 2, 0)]
    assert (
        pynvml.nvmlDeviceGetComputeRunningProcesses(
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
        )
        == []
    )
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(parent)] == [30001]
    back = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(small)
    assert pynvml.nvmlDeviceGetUUID(back) == pynvml.nvmlDeviceGetUUID(parent)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # not on MIG, as on real drivers
        pynvml.nvmlDeviceGetProcessUtilization(parent, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(small)


def test_uninstall_restores_the_real_library_slot(
    write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    before = pynvml.nvmlLib
    fake.install(write_scenario('[[gpu]]\nmemory_total = "1GiB"\n'), runtime_dir=runtime_dir)
    assert isinstance(pynvml.nvmlLib, fake.FakeNvmlLibrary)
    fake.install(
        write_scenario('[[gpu]]\nmemory_total = "2GiB"\n'), runtime_dir=runtime_dir
    )  # replaces
    fake.uninstall()
    assert pynvml.nvmlLib is before
    assert pynvml._nvmlGetFunctionPointer_cache == {}
