"""llama.cpp / ggml: ``ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144.00 MiB
on device 4: cudaMalloc failed: out of memory`` then ``failed to allocate CUDA4 buffer of
size 150995968`` (the exact bytes). HIP builds print ``cudaMalloc`` too, for a ``ROCm0``
buffer. The following line tells what was being allocated: the model's weights
(``error loading model``) or the compute buffers (``failed to allocate compute buffers``).
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, compile_clause, spans

_HEADER = compile_clause(
    r"allocating\s+",
    r"\s+on\s+device\s+(?P<device>\d+):\s+cudaMalloc\s+failed:\s+out\s+of\s+memory",
)
_EXACT = re.compile(
    r"failed\s+to\s+allocate\s+(?P<backend>CUDA|ROCm)\d+\s+buffer\s+of\s+size\s+(?P<bytes>\d+)"
)
_WEIGHTS = re.compile(r"error\s+loading\s+model|load_tensors")
_COMPUTE = re.compile(r"compute\s+buffers")


def find(window: str) -> list[Found]:
    """Every ggml CUDA/HIP buffer allocation failure in ``window``."""
    found = []
    for span in spans(window, _HEADER, limit=600):
        header = _HEADER.match(window, span.start)
        assert header is not None
        exact = _EXACT.search(window, span.start, span.end)
        if _COMPUTE.search(window, span.start, span.end):
            phase = "compute buffers"
        elif _WEIGHTS.search(window, max(0, span.start - 400), span.end):
            phase = "model weights"
        else:
            phase = None
        facts = OomFacts(
            kind="ggml",
            category="ggml_cuda_alloc_failed",
            device_type="hip" if exact and exact["backend"] == "ROCm" else "cuda",
            device_index=int(header["device"]),
            requested_bytes=int(exact["bytes"]) if exact else span.size(_HEADER),
            phase=phase,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
