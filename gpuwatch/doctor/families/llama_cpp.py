"""llama.cpp / ggml: ``ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144.00 MiB
on device 4: cudaMalloc failed: out of memory`` then ``failed to allocate CUDA4 buffer of
size 150995968`` (the exact bytes; printed by ``ggml_gallocr_reserve_n`` or, since 2026,
``ggml_gallocr_reserve_n_impl``). HIP builds print ``cudaMalloc`` too, for a ``ROCm0``
buffer. The following line tells what was being allocated: the model's weights (``error
loading model``), the KV cache (``failed to allocate buffer for kv cache``) or the
compute buffers (``failed to allocate compute buffers``).

``llama_model_load: error loading model: unable to allocate backend buffer`` (or
``unable to allocate CUDA0 buffer``) alone is the loader's summary of the same failure
when the allocation line was not captured; ggml's ``GGML_ASSERT: ... "failed to allocate
buffer"`` is the same from programs that assert instead (whisper.cpp).

Metal (Apple silicon's unified memory) has no cudaMalloc line; its failure is the buffer
itself, with its size: ``ggml_gallocr_reserve_n: failed to allocate Metal buffer of size
34681522080`` (bytes), ``ggml_metal_add_buffer: error: failed to allocate 'data            '
buffer, size = 19283.21 MiB`` (older builds, one buffer per named region), and
``ggml_backend_metal_buffer_type_alloc_buffer: error: failed to allocate buffer, size =
17096.00 MiB``. Ollama passes the last on as ``llama runner process has terminated:
error:failed to allocate buffer, size = 33074.89 MiB``: read where ggml's or llama's lines
are around it, and as Metal's only where Metal is named.

A HIP build names its devices ROCm (``ggml_cuda_init: found 1 ROCm devices``, ``ROCm0``)
while its allocation line still says ``cudaMalloc``: the device is ``hip`` wherever the
paste says so. ``--list-devices`` (``ROCm0: AMD Radeon(TM) Graphics (110511 MiB, 110357
MiB free)``) and the loader (``using device CUDA0 (...) - 23306 MiB free``) print the
device's memory before the load: read as the failing device's total and free.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    SIZE,
    Found,
    compile_clause,
    size_of,
    spans,
)
from gpuwatch.doctor.units import size_to_bytes

_HEADER = compile_clause(
    r"allocating\s+",
    r"\s+on\s+device\s+(?P<device>\d+):\s+(?:cuda|hip)Malloc\s+failed:\s+out\s+of\s+memory",
)
# What says the build is HIP's, although its allocation line says cudaMalloc.
_ROCM = re.compile(r"\bfound\s+\d+\s+ROCm\s+devices?\b|\bROCm\d+\b|\bhipMalloc\b")
# The device's memory as llama.cpp lists it (MiB), before the load: "ROCm0: NAME (total MiB,
# free MiB free)", and the loader's "using device CUDA0 (NAME) - free MiB free".
_BACKEND_NAME = r"(?:CUDA|ROCm|Vulkan|SYCL)"
_LISTED = re.compile(
    rf"\b{_BACKEND_NAME}(?P<index>\d+):[^\n]{{0,120}}?\((?P<total>\d+)\s+MiB,\s+"
    r"(?P<free>\d+)\s+MiB\s+free\)"
)
_USING = re.compile(
    rf"\busing\s+device\s+{_BACKEND_NAME}(?P<index>\d+)\b[^\n]{{0,200}}?-\s+(?P<free>\d+)\s+MiB\s+free"
)
_EXACT = re.compile(
    r"failed\s+to\s+allocate\s+(?P<backend>CUDA|ROCm)\d+\s+buffer\s+of\s+size\s+(?P<bytes>\d+)"
)
# Any backend's name: CUDA0, ROCm0, CPU (host RAM), Metal, Vulkan0, SYCL0, CANN0, ...
_BACKEND_BUFFER = re.compile(
    r"unable\s+to\s+allocate\s+(?:backend|(?P<backend>[A-Za-z]+?)_?(?P<device>\d+)?)\s+buffer"
    # ggml's own assertion in every program built on it (whisper.cpp, stable-diffusion.cpp):
    # GGML_ASSERT: .../ggml-backend.c:460: data != NULL && "failed to allocate buffer".
    r'|GGML_ASSERT:.{0,200}?"failed\s+to\s+allocate\s+buffer"'
)
# The host-side allocation that precedes it when system RAM ran out:
# "alloc_tensor_range: failed to allocate CPU buffer of size 437944320".
_HOST_EXACT = re.compile(r"failed\s+to\s+allocate\s+CPU\s+buffer\s+of\s+size\s+(?P<bytes>\d+)")
# A buffer that could not be allocated, with its size (see the module's docstring).
_SIZED_BUFFER = re.compile(
    r"failed\s+to\s+allocate\s+Metal\s+buffer\s+of\s+size\s+(?P<bytes>\d+)"
    r"|failed\s+to\s+allocate\s+(?:'[^'\n]{0,40}'\s+)?buffer,\s+size\s*=\s*" + SIZE
)
# What makes that second wording ggml's (Ollama's runner, llama.cpp's and ggml's lines),
# and Metal's.
_GGML_AROUND = re.compile(r"ggml|llama|[Mm]etal")
_METAL = re.compile(r"[Mm]etal|METAL")
GGML_CONTEXT_CHARS = 2000
# A ggml backend name, as the device type it runs on.
_DEVICE_TYPES = {"cuda": "cuda", "rocm": "hip", "cpu": "host", "metal": "metal"}
# (phase, pattern), first match wins; looked for after the failure, and for the
# weights also shortly before it (the loader prints its progress first).
_PHASES = (
    ("compute buffers", re.compile(r"compute\s+buffers")),
    ("kv cache", re.compile(r"buffer\s+for\s+kv\s+cache|kv_cache_init\(\)\s+failed")),
    ("model weights", re.compile(r"error\s+loading\s+model|load_tensors")),
)
WEIGHTS_LOOKBACK_CHARS = 400


def find(window: str) -> list[Found]:
    """Every ggml CUDA/HIP buffer allocation failure in ``window``."""
    found = []
    for span in spans(window, _HEADER, limit=600):
        header = _HEADER.match(window, span.start)
        assert header is not None
        exact = _EXACT.search(window, span.start, span.end)
        facts = OomFacts(
            kind="ggml",
            category="ggml_cuda_alloc_failed",
            device_type="hip" if _ROCM.search(window) else "cuda",
            device_index=int(header["device"]),
            requested_bytes=int(exact["bytes"]) if exact else span.size(_HEADER),
            phase=_phase(window, span.start, span.end),
            message=span.snippet,
        )
        facts.total_bytes, facts.free_bytes = _listed_memory(window, int(header["device"]))
        found.append(Found(span.start, facts))
    if found:
        return found
    found = _find_sized(window)
    if found:
        return found
    for span in spans(window, _BACKEND_BUFFER, limit=400):
        match = _BACKEND_BUFFER.match(window, span.start)
        assert match is not None
        backend = (match["backend"] or "").lower()
        device_type = _DEVICE_TYPES.get(backend, backend or None)
        host = _HOST_EXACT.search(window, max(0, span.start - 400), span.end)
        facts = OomFacts(
            kind="ggml",
            category="ggml_host_buffer_alloc_failed"
            if device_type == "host"
            else "ggml_backend_buffer_alloc_failed",
            device_type=device_type,
            device_index=int(match["device"]) if match["device"] else None,
            requested_bytes=int(host["bytes"]) if host and device_type == "host" else None,
            phase=_phase(window, span.start, span.end),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def _listed_memory(window: str, index: int) -> tuple[int | None, int | None]:
    """The device's total and free memory as llama.cpp printed them before the load."""
    for pattern in (_LISTED, _USING):
        for match in pattern.finditer(window):
            if int(match["index"]) == index:
                total = match.groupdict().get("total")
                return (
                    size_to_bytes(total, "MiB") if total else None,
                    size_to_bytes(match["free"], "MiB"),
                )
    return None, None


def _phase(window: str, start: int, end: int) -> str | None:
    for name, pattern in _PHASES:
        low = max(0, start - WEIGHTS_LOOKBACK_CHARS) if name == "model weights" else start
        if pattern.search(window, low, end):
            return name
    return None


def _find_sized(window: str) -> list[Found]:
    """Buffers ggml could not allocate, with their sizes (Metal's, and Ollama's copy)."""
    found = []
    for span in spans(window, _SIZED_BUFFER, limit=400)[:16]:
        match = _SIZED_BUFFER.match(window, span.start)
        assert match is not None
        around_start = max(0, span.start - GGML_CONTEXT_CHARS)
        around_end = min(len(window), span.end + GGML_CONTEXT_CHARS)
        if not match["bytes"] and not _GGML_AROUND.search(window, around_start, around_end):
            continue  # "failed to allocate buffer, size = ..." from some other program
        # Metal named on the line itself, or in ggml's lines around an Ollama copy.
        metal = bool(match["bytes"] or _METAL.search(window, around_start, around_end))
        facts = OomFacts(
            kind="ggml",
            category="ggml_metal_alloc_failed" if metal else "ggml_backend_buffer_alloc_failed",
            device_type="metal" if metal else None,
            requested_bytes=int(match["bytes"]) if match["bytes"] else size_of(match),
            phase=_phase(window, span.start, span.end),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
