"""Allocator reports reach the GPU NVML lists, by UUID: PyTorch's device ordinal is not
NVML's index (``CUDA_VISIBLE_DEVICES``, CUDA's fastest-first order).

A real process on two fake GPUs, polled by the real sampler.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reaper.rig import Hold, Rig, Victim, rig_fixture, victims_fixture
from support.clock import FakeClock

from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import TorchReport


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from rig_fixture(tmp_path, FakeClock(time.time()))


@pytest.fixture
def victims() -> Iterator[Callable[..., Victim]]:
    yield from victims_fixture()


def test_a_report_by_uuid_is_attached_on_the_gpu_with_that_uuid(
    rig: Rig, victims: Callable[..., Victim]
) -> None:
    job = victims()
    rig.install([Hold(job.pid, gpu=0, memory="1GiB"), Hold(job.pid, gpu=1, memory="2GiB")])
    assert rig.session is not None
    reports = TorchReports()
    sampler = Sampler(
        rig.session,
        ProcInfo(isolated=False),
        HostIdentity("agent-test", socket.gethostname(), "boot"),
        timeout_seconds=5.0,
        torch_reports=reports,
        clock=rig.clock,
    )
    nvml_gpu1 = sampler.poll().gpus[1].uuid
    # PyTorch's device 0 is NVML's GPU 1 (CUDA_VISIBLE_DEVICES=1); torch prints the
    # UUID without "GPU-".
    reports.record(
        TorchReport(
            pid=job.pid,
            device_index=0,
            device_uuid=nvml_gpu1.removeprefix("GPU-"),
            allocated_bytes=5,
            reserved_bytes=8,
            reserved_unallocated_bytes=3,
            peak_allocated_bytes=6,
            reported_at=time.time(),
        )
    )
    snapshot = sampler.poll()
    on = {gpu.index: [p.torch for p in gpu.processes if p.pid == job.pid] for gpu in snapshot.gpus}
    assert on[0] == [None]
    assert on[1][0] is not None and on[1][0].allocated_bytes == 5
