"""Out-of-memory from other accelerators' runtimes, below any framework's allocator.

* Intel Gaudi (HPU), through the PyTorch bridge: ``RuntimeError: [Rank:0] FATAL ERROR ::
  MODULE:PT_DEVMEM Allocation failed for size::3288334336 (3136)MB``.
* Huawei Ascend (NPU), CANN's runtime: ``EL0004: Failed to allocate memory.`` (also
  ``Memory_Allocation_Failure(EL0004)``), often with ``Failed to allocate
  resource[DeviceMemory] with info [size:N]``, and torch_npu's ``... failed, error code is
  207001`` (ACL_ERROR_RT_MEMORY_ALLOCATION). torch_npu's own allocator message is PyTorch's
  wording with ``NPU``, read by :mod:`~gpuwatch.doctor.families.pytorch`.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_HPU = re.compile(r"PT_DEVMEM\s+Allocation\s+failed\s+for\s+size::(?P<bytes>\d+)")
_CANN = re.compile(
    r"EL0004\)?:\s*(?:\[PID:[^\]]*\]\s*[\d:.\-]*\s*)?Failed\s+to\s+allocate\s+memory"
    r"|error\s+code\s+is\s+207001\b"
)
_CANN_SIZE = re.compile(r"resource\[DeviceMemory\]\s+with\s+info\s+\[size:(?P<bytes>\d+)\]")
_CANN_DEVICE = re.compile(r"Device:(?P<index>\d+)")
CANN_CONTEXT_CHARS = 1500


def find(window: str) -> list[Found]:
    """Every HPU allocation failure, and the first CANN one (its lines are one failure)."""
    found = []
    for span in spans(window, _HPU, limit=300):
        match = _HPU.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="hpu",
            category="hpu_devmem_allocation_failed",
            exception=exception_before(window, span.start),
            device_type="hpu",
            requested_bytes=int(match["bytes"]),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    for span in spans(window, _CANN, limit=CANN_CONTEXT_CHARS)[:1]:
        around = (max(0, span.start - CANN_CONTEXT_CHARS), span.start + CANN_CONTEXT_CHARS)
        size = _CANN_SIZE.search(window, *around)
        device = _CANN_DEVICE.search(window, *around)
        facts = OomFacts(
            kind="cann",
            category="cann_memory_allocation_failure",
            device_type="npu",
            device_index=int(device["index"]) if device else None,
            requested_bytes=int(size["bytes"]) if size else None,
            cuda_error="ACL_ERROR_RT_MEMORY_ALLOCATION",
            cuda_error_code=207001,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
