"""TensorRT: device memory ran out while building or running an engine.

Wordings (``[TRT] [E]``, ``[TensorRT] ERROR:`` or ``ERROR: [TRT]:`` in front):

* 8.x and later: ``Error Code 2: OutOfMemory (no further information)`` (often from
  ``virtualMemoryBuffer.cpp::resizePhysical``), and ``Error Code 1: Cuda Runtime (out of
  memory)`` from its default allocator.
* 7.x: ``Cuda Error in allocate: 2 (out of memory)`` (also ``in
  nvinfer1::internal::DefaultAllocator::allocate``), ``OutOfMemory Error in allocate: 0``.
* The builder's ``Requested amount of GPU memory (N bytes) could not be allocated``: an
  error in 7.x, a warning in 8.x (the tactic is skipped and the build goes on). A
  warning alone is not a failure and is not reported; beside an error it gives the size.
* TensorRT-LLM's runtime: ``[TensorRT-LLM][ERROR] CUDA runtime error in
  ::cudaMallocAsync(ptr, n, stream): out of memory (.../tllmBuffers.h:112)`` (its buffers
  are sized for the engine's maximum batch and tokens), and the paged KV cache too small
  for one sequence: ``maxTokensInPagedKvCache must be large enough to process at least 1
  sequence to completion``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, spans

_HEADER = re.compile(
    r"Error\s+Code\s+\d+:\s+(?:OutOfMemory\b|Cuda\s+Runtime\s+\(out\s+of\s+memory\))"
    r"|Cuda\s+Error\s+in\s+(?P<call>[\w:]+):\s*2\s*\(out\s+of\s+memory\)"
    r"|OutOfMemory\s+Error\s+in\s+(?P<call2>\w+)"
    r"|(?P<requested>Requested\s+amount\s+of\s+(?:GPU\s+)?memory\s+\((?P<bytes>\d+)\s+bytes\)"
    r"\s+could\s+not\s+be\s+allocated)"
    r"|(?P<llm>\[TensorRT-LLM\]\[ERROR\])[\s\S]{0,300}?out\s+of\s+memory"
    r"|(?P<kv>maxTokensInPagedKvCache\s+must\s+be\s+large\s+enough)"
)
_LLM_CALL = re.compile(r"error\s+in\s+(?:::)?(\w+)\(")
_LLM_SOURCE = re.compile(r"\((?:[^()\s]*/)?(\w+\.(?:h|cpp|cu)):(\d+)\)")
_REQUESTED = re.compile(
    r"Requested\s+amount\s+of\s+(?:GPU\s+)?memory\s+\((?P<bytes>\d+)\s+bytes\)\s+could\s+not"
)
_WARNING_LINE = re.compile(r"\[W\]|WARNING")
_SOURCE = re.compile(r"\[(?P<source>\w+\.cpp)::")
CONTEXT_CHARS = 1500


def find(window: str) -> list[Found]:
    """The first TensorRT out-of-memory error in ``window`` (its repeats are one failure)."""
    for span in spans(window, _HEADER, limit=600):
        header = _HEADER.match(window, span.start)
        assert header is not None
        begins, reads = span.line_start, span.line_lookback
        if header["requested"] and _WARNING_LINE.search(window, reads, span.start):
            continue  # the builder skipped a tactic; not the failure
        around = window[max(0, span.start - CONTEXT_CHARS) : span.start + CONTEXT_CHARS]
        sizes = [int(m["bytes"]) for m in _REQUESTED.finditer(around)]
        category, call = "tensorrt_out_of_memory", header["call"] or header["call2"]
        source = _SOURCE.search(window, reads, span.start + 200)
        location = source["source"] if source else None
        if header["llm"] or header["kv"]:  # TensorRT-LLM names its own call and file
            category = (
                "tensorrt_llm_kv_cache_too_small" if header["kv"] else "tensorrt_llm_out_of_memory"
            )
            call = span.group(_LLM_CALL)
            llm_source = _LLM_SOURCE.search(window, span.start, span.end)
            location = f"{llm_source[1]}:{llm_source[2]}" if llm_source else None
        facts = OomFacts(
            kind="tensorrt",
            category=category,
            device_type="cuda",
            requested_bytes=sizes[0] if sizes else None,
            api_call=call,
            source_location=location,
            message=window[begins : span.end].strip()[:4000],
        )
        return [Found(span.start, facts)]
    return []
