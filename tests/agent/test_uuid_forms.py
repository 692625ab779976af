"""Every form in which a process may name its GPU reaches the device NVML lists.

PyTorch prints a MIG instance's UUID bare (no ``MIG-``); an older ``gpuwatch.torch``
sent it as ``GPU-<bare>``; ``CUDA_VISIBLE_DEVICES`` may hold a unique prefix
(``GPU-8932f937``) or CUDA 11's ``MIG-GPU-<uuid>/<gi>/<ci>``. Unit checks of the
matching, then real processes on fake MIG GPUs polled by the real sampler.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reaper.rig import Rig, Victim, rig_fixture, victims_fixture
from support.clock import FakeClock

from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.agent.service import incident_device
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import NamedDevice, OomIncident, TorchReport, find_device, same_gpu_uuid

GPU0 = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU1 = "GPU-8932f9aa-0000-4106-c12f-20bd9faed9f6"  # shares "8932f9" with GPU0
MIG3 = "MIG-84fa1e39-2b1b-5f5d-9a0c-0c3b2c1d0e01"
MIG5 = "MIG-5ab01c77-6f0e-5d4c-8b2a-1a2b3c4d5e6f"
DEVICES = (
    NamedDevice(GPU0),
    NamedDevice(MIG3, GPU0, 3),
    NamedDevice(MIG5, GPU0, 5),
    NamedDevice(GPU1),
)


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        (GPU0, GPU0),
        (GPU0.lower().removeprefix("gpu-").upper(), GPU0),  # PyTorch: no prefix, any case
        (MIG3.removeprefix("MIG-"), MIG3),  # PyTorch's str() of a MIG instance's UUID
        ("GPU-" + MIG3.removeprefix("MIG-"), MIG3),  # an older gpuwatch.torch's form of it
        (MIG3, MIG3),
        ("GPU-8932f937", GPU0),  # CUDA_VISIBLE_DEVICES: a unique prefix
        ("MIG-84fa", MIG3),
        ("84fa1e39", MIG3),
        (f"MIG-{GPU0}/5/0", MIG5),  # CUDA 11's MIG name
        (f"mig-{GPU0.lower()}/3/0", MIG3),
    ],
)
def test_each_form_names_its_device(reported: str, expected: str) -> None:
    found = find_device(reported, DEVICES)
    assert found is not None and found.uuid == expected


@pytest.mark.parametrize(
    "reported",
    [
        "GPU-8932f9",  # GPU0's and GPU1's: ambiguous, so neither
        "GPU-",
        "MIG-",
        "GPU-00000000",
        f"MIG-{GPU0}/7/0",  # no instance 7
        f"MIG-{GPU1}/3/0",  # GPU1 has no MIG instances
        "MIG-GPU-8932f937/3/0",  # the old form takes the whole parent UUID, not a prefix
    ],
)
def test_what_names_no_single_device_names_none(reported: str) -> None:
    assert find_device(reported, DEVICES) is None


def test_an_old_mig_name_with_two_compute_instances_in_its_gpu_instance_names_neither() -> None:
    # The agent does not read compute instance ids: which of the two is meant is unknown.
    split = (*DEVICES, NamedDevice("MIG-77777777-0000-0000-0000-000000000000", GPU0, 5))
    assert find_device(f"MIG-{GPU0}/5/0", split) is None
    assert find_device(f"MIG-{GPU0}/3/0", split) == DEVICES[1]


def test_same_gpu_uuid_ignores_either_prefix() -> None:
    assert same_gpu_uuid(MIG3, "GPU-" + MIG3[4:])
    assert same_gpu_uuid(MIG3, MIG3[4:].upper())
    assert not same_gpu_uuid(MIG3, MIG5)
    assert not same_gpu_uuid("GPU-", "MIG-")


def _report(pid: int, uuid: str, allocated: int = 5) -> TorchReport:
    return TorchReport(
        pid=pid, device_index=0, device_uuid=uuid, allocated_bytes=allocated, reserved_bytes=8,
        reserved_unallocated_bytes=3, peak_allocated_bytes=6, reported_at=1000.0,
    )  # fmt: skip


def test_the_store_resolves_a_prefix_among_all_of_the_hosts_devices() -> None:
    store = TorchReports(clock=lambda: 0.0)
    store.record(_report(10, "GPU-8932f937"))
    store.record(_report(11, "GPU-8932f9"))  # GPU0's and GPU1's
    gpu0 = (GPU0, MIG3, MIG5)
    assert store.get(10, 0, start_time=None, uuids=gpu0, host=DEVICES) is not None
    assert store.get(10, 1, start_time=None, uuids=(GPU1,), host=DEVICES) is None
    assert store.get(11, 0, start_time=None, uuids=gpu0, host=DEVICES) is None
    assert store.get(11, 1, start_time=None, uuids=(GPU1,), host=DEVICES) is None


# --- real processes, fake MIG GPUs -----------------------------------------------------


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from rig_fixture(tmp_path, FakeClock(time.time()))


@pytest.fixture
def victims() -> Iterator[Callable[..., Victim]]:
    yield from victims_fixture()


def _scenario(in_mig5: int, on_gpu1: int) -> str:
    return f"""
[fake]
name = "uuid-forms"
lifetime = "10m"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
uuid = "{GPU0}"
memory_total = "16GiB"
reserved = "0MiB"
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
uuid = "{MIG3}"
gpu_instance_id = 3
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
uuid = "{MIG5}"
gpu_instance_id = 5

[[gpu]]
uuid = "{GPU1}"
memory_total = "16GiB"
reserved = "0MiB"

[[process]]
gpu = 0
mig = 1
attach = {in_mig5}
memory = "1GiB"

[[process]]
gpu = 1
attach = {on_gpu1}
memory = "1GiB"
"""


def _sampler(rig: Rig, reports: TorchReports) -> Sampler:
    assert rig.session is not None
    return Sampler(
        rig.session,
        ProcInfo(isolated=False),
        HostIdentity("agent-test", socket.gethostname(), "boot"),
        timeout_seconds=5.0,
        torch_reports=reports,
        clock=rig.clock,
    )


def _torch_on(snapshot: HostSnapshot, pid: int) -> dict[int, int | None]:
    """GPU index -> the allocated bytes attached to ``pid`` there (None: no report)."""
    return {
        gpu.index: (p.torch.allocated_bytes if p.torch else None)
        for gpu in snapshot.gpus
        for p in gpu.processes
        if p.pid == pid
    }


@pytest.mark.parametrize(
    "reported",
    [
        MIG5.removeprefix("MIG-"),  # as this version sends PyTorch's UUID: bare
        "GPU-" + MIG5.removeprefix("MIG-"),  # as an older gpuwatch.torch sent it
        "MIG-5ab01c77",  # CUDA_VISIBLE_DEVICES=MIG-5ab01c77
        f"MIG-{GPU0}/5/0",  # CUDA_VISIBLE_DEVICES in CUDA 11's form
    ],
)
def test_a_report_from_a_mig_instance_is_attached_whatever_its_form(
    rig: Rig, victims: Callable[..., Victim], reported: str
) -> None:
    job, other = victims(), victims()
    rig.install_text(_scenario(job.pid, other.pid))
    reports = TorchReports()
    sampler = _sampler(rig, reports)
    sampler.poll()
    reports.record(
        _report(job.pid, reported, allocated=7).model_copy(update={"reported_at": time.time()})
    )
    assert _torch_on(sampler.poll(), job.pid) == {0: 7}


def test_a_unique_prefix_reaches_its_gpu_and_a_shared_one_reaches_none(
    rig: Rig, victims: Callable[..., Victim]
) -> None:
    job, other = victims(), victims()
    rig.install_text(_scenario(job.pid, other.pid))
    reports = TorchReports()
    sampler = _sampler(rig, reports)
    now = time.time()
    reports.record(_report(other.pid, "GPU-8932f9aa", 9).model_copy(update={"reported_at": now}))
    assert _torch_on(sampler.poll(), other.pid) == {1: 9}

    reports = TorchReports()
    sampler = _sampler(rig, reports)
    reports.record(_report(other.pid, "GPU-8932f9", 9).model_copy(update={"reported_at": now}))
    assert _torch_on(sampler.poll(), other.pid) == {1: None}


def test_an_oom_incident_names_the_mig_instance_in_every_form(
    rig: Rig, victims: Callable[..., Victim]
) -> None:
    job, other = victims(), victims()
    rig.install_text(_scenario(job.pid, other.pid))
    snapshot = _sampler(rig, TorchReports()).poll()
    for reported in (MIG5[4:], "GPU-" + MIG5[4:], "MIG-5ab0", f"MIG-{GPU0}/5/0"):
        incident = OomIncident(pid=job.pid, device_uuid=reported, message="CUDA out of memory")
        index, instance = incident_device(incident, snapshot)
        assert index == 0 and instance is not None and instance.gpu_instance_id == 5, reported
    whole = incident_device(OomIncident(pid=job.pid, device_uuid=GPU0[4:], message="x"), snapshot)
    assert whole == (0, None)
    shared = OomIncident(pid=job.pid, device_uuid="GPU-8932f9", message="x")
    assert incident_device(shared, snapshot) == (None, None)
