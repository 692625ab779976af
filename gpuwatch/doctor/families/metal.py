"""Apple Metal: a command buffer aborted because the GPU (unified memory) ran out.

``Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)`` is the
``MTLCommandBufferError`` text (as an NSError: ``Error Domain=MTLCommandBufferErrorDomain
Code=8 "Insufficient Memory (IOAF code 8)"``); llama.cpp's Metal backend prints it after
``ggml_metal_graph_compute: command buffer N failed with status 5`` and MLX raises it as
``[METAL] Command buffer execution failed: ...``. PyTorch's MPS allocator has its own
wording (:mod:`~gpuwatch.doctor.families.mps`). No sizes are printed: the fix is a
smaller context or model, or fewer other apps holding unified memory.

MLX's allocator says so before a command buffer runs: ``[malloc_or_wait] Unable to
allocate N bytes.`` (``[malloc]`` in later releases) when unified memory is used up, and
``[metal::malloc] Attempting to allocate N bytes which is greater than the maximum
allowed buffer size of M bytes.`` when one buffer is larger than Metal allows at all.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_HEADER = re.compile(
    r"(?:Insufficient\s+Memory\s+\(\w+:)?kIOGPUCommandBufferCallbackErrorOutOfMemory\)?"
    # The same status as an NSError, as Swift prints it: the domain's code 8, in words.
    r"|MTLCommandBufferErrorDomain\s+Code=8\b|Insufficient\s+Memory\s+\(IOAF\s+code\s+8\)"
)
_GGML = re.compile(r"ggml_metal|llama_|ggml_backend")
_MLX_UNABLE = re.compile(
    r"\[(?:malloc_or_wait|malloc|metal::malloc)\]\s+Unable\s+to\s+allocate\s+(?P<bytes>\d+)\s+bytes"
)
_MLX_TOO_LARGE = re.compile(
    r"\[metal::malloc\]\s+Attempting\s+to\s+allocate\s+(?P<bytes>\d+)\s+bytes\s+which\s+is\s+"
    r"greater\s+than\s+the\s+maximum\s+allowed\s+buffer\s+size\s+of\s+(?P<limit>\d+)\s+bytes"
)


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
    for header, category in (
        (_MLX_UNABLE, "mlx_malloc_failed"),
        (_MLX_TOO_LARGE, "mlx_buffer_larger_than_allowed"),
    ):
        for match in header.finditer(window):
            facts = OomFacts(
                kind="metal",
                category=category,
                exception=exception_before(window, match.start()),
                device_type="metal",
                requested_bytes=int(match["bytes"]),
                allowed_bytes=int(match["limit"]) if header is _MLX_TOO_LARGE else None,
                api_call="MLX",
                message=window[match.start() : match.end() + 1].strip(),
            )
            found.append(Found(match.start(), facts))
    return found
