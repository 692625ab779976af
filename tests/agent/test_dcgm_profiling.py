"""The profiling figures (GPM) as metrics: dcgm-compatible DCGM_FI_PROF_* fields (ratios
and bytes/s as DCGM reports them) and the native gpuwatch_gpu_activity_ratio and
gpuwatch_gpu_pcie_bytes_per_second; each MIG instance its own, absent without GPM."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.snapshot import Gpu, HostSnapshot, MigInstance, Profiling

HOPPER = Profiling(
    graphics_ratio=0.8, sm_active_ratio=0.75, tensor_ratio=0.42, dram_ratio=0.3,
    pcie_tx_bytes_per_second=48_200_000.0, pcie_rx_bytes_per_second=1_000.0,
)  # fmt: skip


def _snapshot() -> HostSnapshot:
    return HostSnapshot(
        agent_id="a", hostname="gpu-box", boot_id="b", sequence=1, collected_at=1.0,
        driver_version="550.90.07",
        gpus=[
            Gpu(index=0, uuid="GPU-0", name="NVIDIA H100 80GB HBM3", temperature_celsius=40.0,
                profiling=HOPPER),
            Gpu(index=1, uuid="GPU-1", name="NVIDIA H100 80GB HBM3", temperature_celsius=41.0,
                profiling=Profiling(graphics_ratio=0.9, tensor_ratio=0.5),
                mig_instances=[
                    MigInstance(index=0, uuid="MIG-a", gpu_instance_id=2, profile="3g.40gb",
                                activity_ratio=0.6, profiling=Profiling(graphics_ratio=0.6,
                                                                        tensor_ratio=0.25)),
                    MigInstance(index=1, uuid="MIG-b", gpu_instance_id=3, profile="2g.20gb"),
                ]),
            Gpu(index=2, uuid="GPU-2", name="NVIDIA A100-SXM4-80GB", temperature_celsius=39.0),
        ],
    )  # fmt: skip


def _registry() -> CollectorRegistry:
    snapshot = _snapshot()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(DcgmCompatCollector(lambda: snapshot))  # type: ignore[arg-type]
    registry.register(GpuCollector(lambda: snapshot))  # type: ignore[arg-type]
    return registry


def _labels(gpu: int, instance: tuple[str, str] | None = None) -> dict[str, str]:
    labels = {
        "gpu": str(gpu), "UUID": f"GPU-{gpu}", "pci_bus_id": "", "device": f"nvidia{gpu}",
        "modelName": "NVIDIA A100-SXM4-80GB" if gpu == 2 else "NVIDIA H100 80GB HBM3",
        "Hostname": "gpu-box", "DCGM_FI_DRIVER_VERSION": "550.90.07",
    }  # fmt: skip
    if instance:
        labels |= {"GPU_I_PROFILE": instance[0], "GPU_I_ID": instance[1]}
    return labels


def test_a_hopper_gpu_exports_its_gpm_figures_in_dcgm_units() -> None:
    registry = _registry()
    value = registry.get_sample_value
    assert value("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", _labels(0)) == 0.42  # a ratio, not %
    assert value("DCGM_FI_PROF_GR_ENGINE_ACTIVE", _labels(0)) == 0.8
    assert value("DCGM_FI_PROF_SM_ACTIVE", _labels(0)) == 0.75
    assert value("DCGM_FI_PROF_DRAM_ACTIVE", _labels(0)) == 0.3
    assert value("DCGM_FI_PROF_PCIE_TX_BYTES", _labels(0)) == 48_200_000  # bytes/s
    assert value("DCGM_FI_PROF_PCIE_RX_BYTES", _labels(0)) == 1_000
    # What the driver did not answer has no series (not a 0).
    assert value("DCGM_FI_PROF_SM_OCCUPANCY", _labels(0)) is None
    assert value("DCGM_FI_PROF_PIPE_FP32_ACTIVE", _labels(0)) is None


def test_each_mig_instance_exports_its_own_figures_and_its_gpu_none() -> None:
    registry = _registry()
    value = registry.get_sample_value
    busy = _labels(1, ("3g.40gb", "2"))
    assert value("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", busy) == 0.25
    assert value("DCGM_FI_PROF_GR_ENGINE_ACTIVE", busy) == 0.6
    # An instance without figures (its first poll) has no PROF series, but its others.
    idle = _labels(1, ("2g.20gb", "3"))
    assert value("DCGM_FI_PROF_GR_ENGINE_ACTIVE", idle) is None
    assert value("DCGM_FI_DEV_GPU_TEMP", idle) == 41
    # As in dcgm-exporter, the MIG GPU itself has no series.
    assert value("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", _labels(1)) is None


def test_a_gpu_without_gpm_has_no_profiling_series() -> None:
    registry = _registry()
    tensor = [
        s.labels["gpu"]
        for family in registry.collect()
        if family.name == "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
        for s in family.samples
    ]
    assert sorted(tensor) == ["0", "1"]  # the H100 and the H100's 3g.40gb instance
    assert registry.get_sample_value("DCGM_FI_DEV_GPU_TEMP", _labels(2)) == 39


def test_native_metrics_carry_the_same_figures_in_base_units() -> None:
    registry = _registry()

    def activity(gpu: int, instance: str, what: str) -> float | None:
        labels = {"gpu": str(gpu), "uuid": f"GPU-{gpu}", "gpu_instance_id": instance}
        return registry.get_sample_value("gpuwatch_gpu_activity_ratio", labels | {"activity": what})

    assert activity(0, "", "tensor") == 0.42
    assert activity(0, "", "sm_occupancy") is None  # not answered: no series
    # A GPU in MIG mode keeps its own series here, next to each instance's.
    assert (activity(1, "", "tensor"), activity(1, "2", "tensor")) == (0.5, 0.25)
    assert activity(1, "3", "graphics") is None  # no figures yet
    assert activity(2, "", "graphics") is None  # an A100: no GPM
    tx = {"gpu": "0", "uuid": "GPU-0", "gpu_instance_id": "", "direction": "tx"}
    assert registry.get_sample_value("gpuwatch_gpu_pcie_bytes_per_second", tx) == 48_200_000
