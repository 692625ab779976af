"""The store of allocator reports from gpuwatch.torch: fresh, bounded, PID-reuse safe."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpuwatch.agent import torch_reports
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import TorchReport


def _report(pid: int = 10, device: int = 0, at: float = 1000.0) -> TorchReport:
    return TorchReport(
        pid=pid, device_index=device, allocated_bytes=5, reserved_bytes=8,
        reserved_unallocated_bytes=3, peak_allocated_bytes=6, reported_at=at,
    )  # fmt: skip


def test_latest_report_until_stale() -> None:
    now = [0.0]
    store = TorchReports(clock=lambda: now[0])
    store.record(_report())
    assert store.get(10, 0, start_time=None).reserved_unallocated_bytes == 3  # type: ignore[union-attr]
    assert store.get(10, 1, start_time=None) is None
    now[0] = torch_reports.STALE_AFTER_SECONDS + 1
    assert store.get(10, 0, start_time=None) is None


def test_report_from_before_process_start_belongs_to_a_reused_pid() -> None:
    store = TorchReports(clock=lambda: 0.0)
    store.record(_report(at=1000.0))
    assert store.get(10, 0, start_time=999.0) is not None
    assert store.get(10, 0, start_time=1001.0) is None


def test_store_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_reports, "MAX_ENTRIES", 3)
    tick = iter(range(100))
    store = TorchReports(clock=lambda: float(next(tick)))
    for pid in range(1, 6):
        store.record(_report(pid=pid))
    kept = [pid for pid in range(1, 6) if store.get(pid, 0, start_time=None) is not None]
    assert kept == [3, 4, 5]


def test_invalid_report_is_rejected() -> None:
    with pytest.raises(ValidationError):
        TorchReport.model_validate({"pid": 0, "device_index": 0})


GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def test_a_report_with_a_uuid_is_found_by_that_uuid_not_by_its_index() -> None:
    # PyTorch's device 0 under CUDA_VISIBLE_DEVICES=1 is NVML's GPU 1: the report says
    # device_index 0 (the ordinal), and its UUID as torch prints it (no "GPU-", any case).
    store = TorchReports(clock=lambda: 0.0)
    store.record(_report(device=0).model_copy(update={"device_uuid": GPU1[4:].upper()}))
    assert (
        store.get(10, 0, start_time=None, uuids=("GPU-00000000-0000-0000-0000-000000000000",))
        is None
    )
    found = store.get(10, 1, start_time=None, uuids=(GPU1,))
    assert found is not None and found.allocated_bytes == 5


def test_a_report_without_a_uuid_is_still_found_by_index() -> None:
    store = TorchReports(clock=lambda: 0.0)
    store.record(_report(device=1))  # an older gpuwatch.torch
    assert store.get(10, 1, start_time=None, uuids=(GPU1,)) is not None


@pytest.mark.parametrize("uuid", ["", "GPU-1\n", "GPU-1 2", "G" * 97, "GPU-\x00"])
def test_a_device_uuid_is_bounded(uuid: str) -> None:
    with pytest.raises(ValidationError):
        TorchReport.model_validate({**_report().model_dump(), "device_uuid": uuid})
