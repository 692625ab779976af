"""What the NVML layer reports when NVML refuses part of a GPU: its handle, a MIG GPU's
aggregate figures (which need privileges), memory info v2, MIG mode on a board without
MIG. Each refusal must read as "unknown", never as "nothing there"."""

from __future__ import annotations

import pytest

from gpuwatch.agent.assemble import build_sampler
from gpuwatch.agent.state import AgentState
from gpuwatch.nvml.library import NvmlSession
from gpuwatch.settings import AgentSettings

GiB = 2**30
MiB = 2**20

TWO_GPUS = """
[fake]
name = "two"
[[gpu]]
memory_total = "80GiB"
[[gpu]]
memory_total = "80GiB"
[[process]]
gpu = 1
ghost = 4100001
memory = "30GiB"
"""


@pytest.mark.parametrize("kind", ["no_permission", "unknown", "insufficient_power", "irq_issue"])
def test_handle_refused_gpu_is_reported_unreadable_not_empty(fake_gpus, kind: str) -> None:
    """NVML documents these answers for nvmlDeviceGetHandleByIndex; UNKNOWN is what a
    process started after a GPU fell off the bus gets. An empty process list there
    read as every process on the board having ended."""
    fake_gpus(
        TWO_GPUS + f'[[fault]]\ngpu = 1\nkind = "{kind}"\nfunction = "nvmlDeviceGetHandleByIndex"\n'
    )
    with NvmlSession.open() as session:
        gpu0, gpu1 = session.read_device(0), session.read_device(1)
    assert gpu1.read_error == f"no handle: {kind}"
    assert gpu1.processes_unlisted and gpu1.processes == []
    assert gpu0.read_error is None and gpu0.memory_total_bytes == 80 * GiB

    snapshot = build_sampler(AgentSettings(), AgentState(), one_shot=True).poll()
    shown = snapshot.gpus[1]
    # The server reconciles (ends lifetimes on) only GPUs read with processes visible.
    assert shown.processes_visible is False
    assert shown.read_error == f"no handle: {kind}"
    assert shown.unattributed_bytes is None


def test_v1_memory_leaves_unattributed_unknown(fake_gpus) -> None:
    """v1's "used" includes the driver's reserved memory: counting it as memory no
    process accounts for warned on every GPU of a driver without v2."""
    fake_gpus(
        """
[fake]
name = "no-memv2"
[[gpu]]
memory_total = "81559MiB"
reserved = "529MiB"
[[process]]
gpu = 0
ghost = 4100001
memory = "20GiB"
[[fault]]
kind = "unsupported"
function = "nvmlDeviceGetMemoryInfo_v2"
"""
    )
    with NvmlSession.open() as session:
        gpu = session.read_device(0)
    assert gpu.memory_used_bytes == 20 * GiB + 529 * MiB  # v1: reserved counts as used
    assert gpu.memory_reserved_bytes is None and gpu.memory_used_includes_reserved
    shown = build_sampler(AgentSettings(), AgentState(), one_shot=True).poll().gpus[0]
    assert shown.unattributed_bytes is None


MIG_UNPRIVILEGED = """
[fake]
name = "mig-unprivileged"
[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"
cuda_capability = "8.0"
[[gpu.mig]]
profile = "3g.40gb"
memory_total = "40GiB"
gpu_instance_id = 1
[[gpu.mig]]
profile = "1g.10gb"
memory_total = "10GiB"
gpu_instance_id = 9
[[process]]
gpu = 0
mig = 0
ghost = 4100001
memory = "30GiB"
[[process]]
gpu = 0
mig = 1
ghost = 4100002
memory = "4GiB"
kind = "graphics"
# Unprivileged: the GPU's own handle refuses its aggregate lists and memory.
[[fault]]
gpu = 0
mig = "parent"
kind = "no_permission"
function = [
  "nvmlDeviceGetComputeRunningProcesses",
  "nvmlDeviceGetGraphicsRunningProcesses",
  "nvmlDeviceGetMPSComputeRunningProcesses",
  "nvmlDeviceGetMemoryInfo",
]
"""


def test_mig_gpu_without_privileges_is_read_from_its_instances(fake_gpus) -> None:
    fake_gpus(MIG_UNPRIVILEGED)
    with NvmlSession.open() as session:
        first = session.read_device(0)
        errors_after_first = session.errors.snapshot()
        second = session.read_device(0)
        errors = session.errors.snapshot()
    for gpu in (first, second):
        assert not gpu.processes_unlisted
        assert {(p.pid, p.kind, p.used_bytes, p.gpu_instance_id) for p in gpu.processes} == {
            (4100001, "compute", 30 * GiB, 1),
            (4100002, "graphics", 4 * GiB, 9),
        }
        assert gpu.memory_used_bytes == 34 * GiB
        assert gpu.memory_total_bytes == 50 * GiB  # what the instances can hold
        assert gpu.memory_free_bytes == 16 * GiB

    # The parent is asked in the first poll only: a refusal that repeats every poll is
    # no news, and counted each time it would raise the NVML-errors alert for a
    # complete reading.
    def refused(counts: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        return {key: n for key, n in counts.items() if key[1] == "no_permission"}

    assert ("nvmlDeviceGetMemoryInfo_v2", "no_permission") in refused(errors_after_first)
    assert refused(errors) == refused(errors_after_first)

    shown = build_sampler(AgentSettings(), AgentState(), one_shot=True).poll().gpus[0]
    assert shown.processes_visible is True
    assert sorted(p.pid for p in shown.processes) == [4100001, 4100002]


def test_mig_mode_on_a_board_without_mig_is_asked_once(fake_gpus) -> None:
    fake_gpus('[fake]\nname = "a6000"\n[[gpu]]\nmemory_total = "48GiB"\ncuda_capability = "8.6"\n')
    with NvmlSession.open() as session:
        readings = [session.read_device(0) for _ in range(3)]
        errors = session.errors.snapshot()
    assert all(r.mig == [] and r.memory_total_bytes == 48 * GiB for r in readings)
    assert errors.get(("nvmlDeviceGetMigMode", "not_supported")) == 1
