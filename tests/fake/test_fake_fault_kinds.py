"""Fault kinds, fault scopes, and answers the fake gives as a real driver does, through
the real pynvml: each NVML error a scenario can inject, init failures, faults on a MIG
GPU's own handle only, MIG mode on boards without MIG, and PCI bus ids in every form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from gpuwatch.errors import NvmlUnavailable
from gpuwatch.nvml import fake
from gpuwatch.nvml.library import NvmlSession

# One per-call kind on each function of GPU 0; GPU 1 has none.
PER_CALL_KINDS = {
    "unknown": ("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN),
    "timeout": ("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_TIMEOUT),
    "function_not_found": ("nvmlDeviceGetFanSpeed", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
    "insufficient_power": ("nvmlDeviceGetUUID", pynvml.NVML_ERROR_INSUFFICIENT_POWER),
    "irq_issue": ("nvmlDeviceGetName", pynvml.NVML_ERROR_IRQ_ISSUE),
    "reset_required": ("nvmlDeviceGetEnforcedPowerLimit", pynvml.NVML_ERROR_RESET_REQUIRED),
}
TWO_GPUS = '[[gpu]]\nmemory_total = "80GiB"\n[[gpu]]\nmemory_total = "80GiB"\n'


def _call(function: str, handle: object) -> object:
    if function == "nvmlDeviceGetTemperature":
        return pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    return getattr(pynvml, function)(handle)


def test_each_error_kind_answers_its_nvml_code_on_its_gpu_only(
    write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    faults = "".join(
        f'[[fault]]\ngpu = 0\nkind = "{kind}"\nfunction = "{function}"\n'
        for kind, (function, _) in PER_CALL_KINDS.items()
    )
    fake.install(write_scenario(TWO_GPUS + faults), runtime_dir=runtime_dir)
    pynvml.nvmlInit()
    try:
        gpu0, gpu1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
        for function, code in PER_CALL_KINDS.values():
            with pytest.raises(pynvml.NVMLError) as raised:
                _call(function, gpu0)
            assert raised.value.value == code, function
            _call(function, gpu1)  # the fault is GPU 0's
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize(
    ("kind", "code", "message"),
    [
        ("driver_not_loaded", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded"),
        ("lib_rm_version_mismatch", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "differ in version"),
    ],
)
def test_init_fault_kinds_fail_nvml_init(
    write_scenario: Callable[..., Path], runtime_dir: Path, kind: str, code: int, message: str
) -> None:
    fake.install(
        write_scenario(TWO_GPUS + f'[[fault]]\nkind = "{kind}"\n'), runtime_dir=runtime_dir
    )
    with pytest.raises(pynvml.NVMLError) as raised:
        pynvml.nvmlInit()
    assert raised.value.value == code
    with pytest.raises(NvmlUnavailable, match=message):
        NvmlSession.open()


MIG_GPU = """
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
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
"""


def test_a_fault_can_take_only_the_parent_handle_or_one_instance(
    write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    faults = """
[[fault]]
gpu = 0
mig = "parent"
kind = "no_permission"
function = ["nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo"]
[[fault]]
gpu = 0
mig = 0
kind = "unknown"
function = "nvmlDeviceGetName"
"""
    fake.install(write_scenario(MIG_GPU + faults), runtime_dir=runtime_dir)
    pynvml.nvmlInit()
    try:
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        big, small = (pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in (0, 1))
        # "Aggregate information, only if the caller has appropriate privileges."
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetComputeRunningProcesses(parent)
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetMemoryInfo(parent, version=pynvml.nvmlMemory_v2)
        assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(small)] == [30001]
        assert pynvml.nvmlDeviceGetMemoryInfo(small).used == 4 * 2**30
        assert pynvml.nvmlDeviceGetName(parent) == "NVIDIA A100-SXM4-80GB"
        assert pynvml.nvmlDeviceGetName(small).endswith("MIG 1g.10gb")
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetName(big)
    finally:
        pynvml.nvmlShutdown()


def test_mig_mode_is_not_supported_on_a_board_without_mig(
    write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    boards = """
[[gpu]]
name = "NVIDIA RTX A6000"
memory_total = "48GiB"
cuda_capability = "8.6"
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
"""
    fake.install(write_scenario(boards), runtime_dir=runtime_dir)
    pynvml.nvmlInit()
    try:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))
        # A board with MIG, not in MIG mode, says "disabled".
        assert pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(1)) == [0, 0]
    finally:
        pynvml.nvmlShutdown()


def test_pci_bus_id_lookup_takes_every_form_nvml_takes(
    write_scenario: Callable[..., Path], runtime_dir: Path
) -> None:
    fake.install(
        write_scenario('[[gpu]]\nmemory_total = "8GiB"\npci_bus_id = "0000:1a:00.0"\n'),
        runtime_dir=runtime_dir,
    )
    pynvml.nvmlInit()
    try:
        device = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPciInfo(device).busId == "00000000:1A:00.0"
        for form in (b"00000000:1A:00.0", b"0000:1a:00.0", b"1a:00.0", b"0:1a:0.0", b"0:1A:0"):
            found = pynvml.nvmlDeviceGetHandleByPciBusId(form)
            assert pynvml.nvmlDeviceGetIndex(found) == 0, form
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByPciBusId(b"1b:00.0")
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByPciBusId(b"not a bus id")
    finally:
        pynvml.nvmlShutdown()
