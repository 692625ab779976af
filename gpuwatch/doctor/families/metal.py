"""Apple Metal: a command buffer aborted because the GPU (unified memory) ran out.

``Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)`` is the
``MTLCommandBufferError`` text; llama.cpp's Metal backend prints it after
``ggml_metal_graph_compute: command buffer N failed with status 5`` and MLX raises it as
``[METAL] Command buffer execution failed: ...``. PyTorch's MPS allocator has its own
wording (:mod:`~gpuwatch.doctor.families.mps`). No sizes are printed: the fix is a
smaller context or model, or fewer other apps holding unified memory.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_HEADER = re.compile(
    r"(?:Insufficient\s+Memory\s+\(\w+:)?kIOGPUCommandBufferCallbackErrorOutOfMemory\)?"
)
_GGML = re.compile(r"ggml_metal|llama_|ggml_backend")


def find(window: str) -> list[Found]:
    """Every Metal command-buffer out-of-memory in ``window`` (repeats fold later)."""
    found = []
    for span in spans(window, _HEADER, limit=400):
        around = window[max(0, span.start - 300) : span.end]
        facts = OomFacts(
            kind="metal",
            category="metal_command_buffer_oom",
            exception=exception_before(window, span.start),
            device_type="metal",
            api_call="llama.cpp (ggml Metal)" if _GGML.search(around) else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
