"""GPM through the real pynvml on the fake GPUs: per-MIG-instance activity on Hopper,
NOT_SUPPORTED on an A100, exactly as a program would call it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from gpuwatch.nvml import fake

SCENARIO = """
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
[[gpu.mig]]
profile = "1g.10gb"
memory_total = "10GiB"
gpu_instance_id = 9
activity_percent = { steps = [["0s", 0], ["1m", 100]] }
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
sm_percent = 60
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
"""


@pytest.fixture
def booted(
    write_scenario: Callable[..., Path], runtime_dir: Path, clock: Callable[[], float]
) -> Iterator[fake.FakeHost]:
    host = fake.install(write_scenario(SCENARIO), runtime_dir=runtime_dir, clock=clock)
    clock.now = host.state.epoch  # type: ignore[attr-defined]
    pynvml.nvmlInit()
    yield host
    pynvml.nvmlShutdown()


def _utilisation(first: object, second: object, metric: int) -> tuple[int, float]:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1 = first
    request.sample2 = second
    request.metrics[0].metricId = metric
    answer = pynvml.nvmlGpmMetricsGet(request).metrics[0]
    return answer.nvmlReturn, answer.value


def _instance_activity(parent: object, instance: int, clock: object, seconds: float) -> float:
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmMigSampleGet(parent, instance, first)
        clock.now += seconds  # type: ignore[attr-defined]
        pynvml.nvmlGpmMigSampleGet(parent, instance, second)
        code, value = _utilisation(first, second, pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL)
        assert code == pynvml.NVML_SUCCESS
        return value
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


def test_hopper_reports_each_mig_instance_activity_between_two_samples(
    booted: fake.FakeHost, clock: Callable[[], float]
) -> None:
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(parent).isSupportedDevice == 1

    assert _instance_activity(parent, 2, clock, 10) == pytest.approx(60)  # its process's SM
    assert _instance_activity(parent, 3, clock, 10) == 0.0  # a process that runs nothing
    # The timeline turns on at one minute: the mean over 0:50..1:20 is two thirds busy.
    clock.now = booted.state.epoch + 50  # type: ignore[attr-defined]
    assert _instance_activity(parent, 9, clock, 30) == pytest.approx(100 * 20 / 30)


@pytest.mark.usefixtures("booted")
def test_other_metrics_unknown_instances_and_bad_samples_are_refused() -> None:
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmMigSampleGet(parent, 2, first)
    pynvml.nvmlGpmMigSampleGet(parent, 2, second)
    code, _ = _utilisation(first, second, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY)
    assert code == pynvml.NVML_ERROR_NOT_SUPPORTED  # in the metric's own return code
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmMigSampleGet(parent, 7, first)  # no GPU instance 7
    pynvml.nvmlGpmSampleGet(parent, second)  # the whole GPU: not the same source
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _utilisation(first, second, pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL)
    pynvml.nvmlGpmSampleFree(first)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpmSampleFree(first)  # freed once already
    pynvml.nvmlGpmSampleFree(second)


@pytest.mark.usefixtures("booted")
def test_an_a100_has_no_gpm() -> None:
    a100 = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlGpmQueryDeviceSupport(a100).isSupportedDevice == 0
    sample = pynvml.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmMigSampleGet(a100, 1, sample)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlGpmSampleGet(a100, sample)
    pynvml.nvmlGpmSampleFree(sample)


@pytest.mark.usefixtures("booted")
def test_two_samples_at_one_moment_give_the_activity_at_that_moment() -> None:
    # A frozen scenario (--at) never advances: the figures are those of that instant.
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmMigSampleGet(parent, 2, first)
        pynvml.nvmlGpmMigSampleGet(parent, 2, second)
        code, value = _utilisation(first, second, pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL)
        assert (code, value) == (pynvml.NVML_SUCCESS, 60.0)
        code, value = _utilisation(first, second, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
        assert (code, value) == (pynvml.NVML_SUCCESS, 24.0)  # 40 % of its SM's 60 %
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)
