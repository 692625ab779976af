"""ONNX Runtime: its memory arena (``BFCArena``) could not grow.

``Non-zero status code returned while running Conv node. Name:'Conv_12' Status Message:
.../bfc_arena.cc:376 void* onnxruntime::BFCArena::AllocateRawInternal(...) Failed to
allocate memory for requested buffer of size 1073741824``, often inside ``[ONNXRuntimeError]
: 6 : RUNTIME_EXCEPTION``. The same arena serves the CPU provider, so the device is named
only when the text says CUDA; where it says the CPU provider (or names a node of its
NCHWc layout, ``Conv node. Name:'347_nchwc'``), it is system RAM: kind ``host``. The
CUDA provider's own ``CUDA failure 2: out of memory`` is a plain cudaMalloc failure
(:mod:`~gpuwatch.doctor.families.cuda_libraries`).
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, name_near, spans
from gpuwatch.doctor.units import ABSURD_REQUEST_BYTES

_HEADER = re.compile(
    r"Failed\s+to\s+allocate\s+memory\s+for\s+requested\s+buffer\s+of\s+size\s+(?P<bytes>\d+)"
)
_ARENA = re.compile(r"BFCArena|bfc_arena")
_NODE = re.compile(
    r"while\s+running\s+(?P<op>\w+)\s+node\.\s+Name:\s*\\?'(?P<name>[^'\\\n]{1,200})"
)
# "onnxruntime.capi.onnxruntime_pybind11_state.RuntimeException: [ONNXRuntimeError] : 6 ..."
_EXCEPTION = re.compile(r"([\w.]*RuntimeException)\b")
_CUDA = re.compile(r"BFCArena\s+for\s+Cuda|CUDAExecutionProvider|providers/cuda/|\bCuda\b")
# The CPU provider's arena: system RAM ran out, not the GPU's. Its NCHWc layout
# transformer names the nodes it makes "..._nchwc", and no other provider runs them.
_CPU = re.compile(r"CPUExecutionProvider|BFCArena\s+for\s+Cpu|_nchwc'", re.IGNORECASE)
CONTEXT_CHARS = 600


def find(window: str) -> list[Found]:
    """Every ONNX Runtime arena allocation failure in ``window``."""
    found = []
    for span in spans(window, _HEADER, limit=400):
        start = max(0, span.start - CONTEXT_CHARS)
        if not _ARENA.search(window, start, span.end):
            continue  # the wording is generic; the arena's name makes it ONNX Runtime's
        header = _HEADER.match(window, span.start)
        assert header is not None
        requested = int(header["bytes"])
        node = _NODE.search(window, start, span.start)
        absurd = requested >= ABSURD_REQUEST_BYTES
        cuda = _CUDA.search(window, start, span.end) is not None
        cpu = not cuda and _CPU.search(window, start, span.end) is not None
        facts = OomFacts(
            kind="host" if cpu and not absurd else "onnxruntime",
            category="onnxruntime_arena_absurd_size"
            if absurd
            else "onnxruntime_cpu_arena_alloc_failed"
            if cpu
            else "onnxruntime_arena_alloc_failed",
            exception=name_near(window, span.start, _EXCEPTION, back=CONTEXT_CHARS),
            device_type="cuda" if cuda else "cpu" if cpu else None,
            requested_bytes=None if absurd else requested,
            api_call=f"{node['op']} node {node['name']}" if node else None,
            message=window[node.start() if node else span.start : span.end].strip()[:4000],
        )
        found.append(Found(span.start, facts))
    return found
