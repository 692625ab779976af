"""MIG instances in the native metrics: each instance's memory as its own series
(gpuwatch_mig_memory_*), and per-process series that say which instance a process runs
in, so the fill-up rules can judge an instance, and name its holders, on their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, MigInstance, ProcessOwner

GiB = 2**30


def _snapshot() -> HostSnapshot:
    return HostSnapshot(
        agent_id="a", hostname="gpu-box", boot_id="b", sequence=1, collected_at=1.0,
        gpus=[
            # A100 in MIG mode: the GPU as a whole has room, its 2g.20gb instance is full.
            Gpu(index=0, uuid="GPU-0", name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GiB, memory_used_bytes=51 * GiB,
                memory_free_bytes=29 * GiB,
                mig_instances=[
                    MigInstance(index=0, uuid="MIG-a", gpu_instance_id=1, profile="3g.40gb",
                                memory_total_bytes=39 * GiB, memory_used_bytes=31 * GiB),
                    MigInstance(index=1, uuid="MIG-b", gpu_instance_id=3, profile="2g.20gb",
                                memory_total_bytes=19 * GiB, memory_used_bytes=19 * GiB),
                    # NVML gave no instance id: it could not be told from the others.
                    MigInstance(index=2, uuid="MIG-c", memory_total_bytes=9 * GiB,
                                memory_used_bytes=1 * GiB),
                ],
                processes=[
                    GpuProcess(pid=7, used_bytes=19 * GiB, gpu_instance_id=3, name="python",
                               owner=ProcessOwner(user="carol")),
                    GpuProcess(pid=8, used_bytes=31 * GiB, gpu_instance_id=1, name="python",
                               owner=ProcessOwner(user="dave")),
                ]),
            Gpu(index=1, uuid="GPU-1", name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=80 * GiB, memory_used_bytes=10 * GiB,
                memory_free_bytes=70 * GiB,
                processes=[GpuProcess(pid=9, used_bytes=10 * GiB, name="python",
                                      owner=ProcessOwner(user="erin"))]),
        ],
    )  # fmt: skip


def _registry() -> CollectorRegistry:
    snapshot = _snapshot()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(GpuCollector(lambda: snapshot))  # type: ignore[arg-type]
    registry.register(ProcessCollector(lambda: snapshot, enabled=True, max_series=10))  # type: ignore[arg-type]
    return registry


def _mig(instance: str, profile: str) -> dict[str, str]:
    return {"gpu": "0", "uuid": "GPU-0", "gpu_instance_id": instance, "profile": profile}


def test_each_mig_instance_exports_its_own_memory() -> None:
    value = _registry().get_sample_value
    assert value("gpuwatch_mig_memory_total_bytes", _mig("3", "2g.20gb")) == 19 * GiB
    assert value("gpuwatch_mig_memory_used_bytes", _mig("3", "2g.20gb")) == 19 * GiB
    assert value("gpuwatch_mig_memory_used_bytes", _mig("1", "3g.40gb")) == 31 * GiB
    # The GPU's own figures stay the whole GPU's.
    assert value("gpuwatch_gpu_memory_free_bytes", {"gpu": "0", "uuid": "GPU-0"}) == 29 * GiB


def test_only_instances_with_an_id_and_only_mig_gpus_have_instance_series() -> None:
    text = generate_latest(_registry()).decode()
    rows = [line for line in text.splitlines() if line.startswith("gpuwatch_mig_memory_used")]
    assert len(rows) == 2, rows  # not MIG-c (no id), nothing for GPU 1 (not in MIG mode)


def test_process_series_name_the_mig_instance_and_are_empty_off_mig() -> None:
    value = _registry().get_sample_value
    base = {"name": "python", "container": "", "pod": "", "slurm_job": ""}
    in_instance = {"gpu": "0", "uuid": "GPU-0", "gpu_instance_id": "3", "pid": "7", "user": "carol"}
    whole_gpu = {"gpu": "1", "uuid": "GPU-1", "gpu_instance_id": "", "pid": "9", "user": "erin"}
    assert value("gpuwatch_gpu_process_memory_used_bytes", base | in_instance) == 19 * GiB
    assert value("gpuwatch_gpu_process_memory_used_bytes", base | whole_gpu) == 10 * GiB
