"""Our NVML layer over the real pynvml, over the fake C library: every error path."""

from __future__ import annotations

import os
import time

import pytest

from gpuwatch.errors import NvmlUnavailable
from gpuwatch.nvml.bounded import BoundedReader, DeviceTimeout
from gpuwatch.nvml.library import DeviceReading, NvmlSession

GiB = 2**30

TWO_GPUS = """
[fake]
name = "two"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
reserved = "1GiB"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
attach = "self"
memory = "10GiB"
sm_percent = 40

[[process]]
gpu = 0
ghost = 4100001
memory = "3GiB"
"""


def _open() -> NvmlSession:
    return NvmlSession.open()


def test_reads_memory_identity_and_processes(fake_gpus) -> None:
    fake_gpus(TWO_GPUS)
    with _open() as session:
        assert session.device_count() == 2
        gpu0 = session.read_device(0)
    assert gpu0.name == "NVIDIA A100-SXM4-80GB"
    assert gpu0.uuid.startswith("GPU-")
    assert gpu0.memory_total_bytes == 80 * GiB
    assert gpu0.memory_reserved_bytes == 1 * GiB
    # v2 accounting: used + free + reserved = total
    assert gpu0.memory_used_bytes is not None and gpu0.memory_free_bytes is not None
    assert gpu0.memory_used_bytes + gpu0.memory_free_bytes + GiB == 80 * GiB
    pids = {p.pid: p.used_bytes for p in gpu0.processes}
    assert pids == {os.getpid(): 10 * GiB, 4100001: 3 * GiB}
    assert gpu0.process_sm is not None and gpu0.process_sm.get(os.getpid()) == pytest.approx(0.4)


def test_unsupported_and_no_permission_fields_are_absent_not_zero(fake_gpus) -> None:
    fake_gpus(
        TWO_GPUS
        + """
[[fault]]
gpu = 0
at = "0s"
kind = "unsupported"
function = "nvmlDeviceGetPowerUsage"

[[fault]]
gpu = 0
at = "0s"
kind = "no_permission"
function = "nvmlDeviceGetTemperature"
"""
    )
    with _open() as session:
        gpu0 = session.read_device(0)
        gpu1 = session.read_device(1)
        errors = session.errors.snapshot()
    assert gpu0.power_watts is None and gpu0.temperature_celsius is None
    assert gpu0.memory_total_bytes == 80 * GiB  # the rest of the GPU is still read
    assert gpu1.power_watts is not None  # the fault is per GPU
    assert errors[("nvmlDeviceGetPowerUsage", "not_supported")] == 1
    assert errors[("nvmlDeviceGetTemperature", "no_permission")] == 1


def test_lost_gpu_is_marked_and_does_not_hide_the_other(fake_gpus) -> None:
    fake_gpus(TWO_GPUS + '\n[[fault]]\ngpu = 1\nat = "0s"\nkind = "gpu_lost"\n')
    with _open() as session:
        readings = [session.read_device(i) for i in range(2)]
    assert readings[1].lost and readings[1].memory_used_bytes is None
    assert not readings[0].lost and readings[0].memory_total_bytes == 80 * GiB


def test_process_memory_not_available_is_none(fake_gpus) -> None:
    fake_gpus(TWO_GPUS.replace('memory = "10GiB"', 'memory = "10GiB"\nmemory_not_available = true'))
    with _open() as session:
        gpu0 = session.read_device(0)
    used = {p.pid: p.used_bytes for p in gpu0.processes}
    assert used[os.getpid()] is None


def test_process_utilisation_asks_only_for_newer_samples(fake_gpus) -> None:
    fake_gpus(TWO_GPUS, at=None)
    with _open() as session:
        first = session.read_device(0).process_sm
        # Asked again at once, NVML has no newer samples (NOT_FOUND). A few ms of
        # silence is no evidence of idleness: the last known activity stands
        # (tests/nvml/test_process_activity.py), never "unknown" (None).
        second = session.read_device(0).process_sm
    assert first and first[os.getpid()] == pytest.approx(0.4)
    assert second == first


def test_hung_call_is_bounded_and_other_gpus_are_read(fake_gpus) -> None:
    fake_gpus(
        TWO_GPUS
        + '\n[[fault]]\ngpu = 1\nat = "0s"\nkind = "hang"\nfunction = "nvmlDeviceGetPowerUsage"\nseconds = 3\n'
    )
    with _open() as session:
        reader = BoundedReader(session, timeout=0.5)
        started = time.monotonic()
        results = reader.read_all(2)
        elapsed = time.monotonic() - started
        assert elapsed < 2.5
        assert isinstance(results[0], DeviceReading) and results[0].memory_total_bytes == 80 * GiB
        assert results[1] == DeviceTimeout(index=1, still_stuck=False)
        # While the hung read is still stuck, the next poll skips that GPU (no new thread).
        again = reader.read_all(2)
        assert again[1] == DeviceTimeout(index=1, still_stuck=True)
        assert isinstance(again[0], DeviceReading)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a real NVIDIA driver is present")
def test_no_library_is_a_clear_fatal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    from gpuwatch.nvml import fake

    fake.uninstall()
    monkeypatch.setattr(pynvml, "nvmlLib", None)
    with pytest.raises(NvmlUnavailable, match=r"libnvidia-ml\.so\.1"):
        NvmlSession.open()


def test_coherent_memory_gpu_is_detected_and_unattributed_masked(fake_gpus) -> None:
    fake_gpus(
        """
[fake]
name = "coherent"

[[gpu]]
name = "NVIDIA GH200 480GB"
memory_total = "96GiB"
coherent = true
unattributed = "5GiB"
"""
    )
    from gpuwatch.agent.assemble import build_sampler
    from gpuwatch.agent.state import AgentState
    from gpuwatch.settings import AgentSettings

    with _open() as session:
        assert session.read_device(0).coherent_memory is True
    gpu = build_sampler(AgentSettings(), AgentState()).poll().gpus[0]
    assert gpu.coherent_memory is True
    assert gpu.unattributed_bytes is None  # "used" there is not the sum of processes
