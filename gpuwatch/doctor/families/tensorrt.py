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
* TensorRT-LLM 1.0's PyTorch backend, when a component of its executor does not fit
  (``[TRT-LLM] [RANK 1] [E] Failed to initialize executor on rank 1: Executor creation
  failed due to insufficient GPU memory.``, also raised as a bare ``RuntimeError``), then
  ``The following component could not be created: KV cache`` and a table of figures in
  GiB: ``Total GPU memory (GiB): 140.06``, ``Free GPU memory before component creation
  attempt (GiB): 108.86``.

TensorRT-LLM's own tag (``[TensorRT-LLM]``, ``[TRT-LLM]``) on an error line makes any
wording of a shortage there its own, "insufficient GPU memory" as well as "out of memory"
(families/generic.py reads the tags too, for a line no family reads).
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, Span, exception_before, spans, table_row

# The tags TensorRT and TensorRT-LLM print before their log lines: "[TRT] [E]",
# "[TensorRT] ERROR:", "[TensorRT-LLM][ERROR]", "[TRT-LLM] [RANK 1] [E]".
LLM_TAG = re.compile(r"\[(?:TensorRT-LLM|TRT-LLM)\]")
TAG = re.compile(r"\[(?:TensorRT|TRT)\]")
# A shortage in any words.
_SHORTAGE = r"(?:out\s+of|insufficient|not\s+enough)\s+(?:GPU\s+|device\s+)?memory"
_EXECUTOR = re.compile(r"Executor\s+creation\s+failed\s+due\s+to\s+insufficient\s+GPU\s+memory")
_HEADER = re.compile(
    r"Error\s+Code\s+\d+:\s+(?:OutOfMemory\b|Cuda\s+Runtime\s+\(out\s+of\s+memory\))"
    r"|Cuda\s+Error\s+in\s+(?P<call>[\w:]+):\s*2\s*\(out\s+of\s+memory\)"
    r"|OutOfMemory\s+Error\s+in\s+(?P<call2>\w+)"
    r"|(?P<requested>Requested\s+amount\s+of\s+(?:GPU\s+)?memory\s+\((?P<bytes>\d+)\s+bytes\)"
    r"\s+could\s+not\s+be\s+allocated)"
    # TensorRT-LLM's executor, whatever is in front of its sentence.
    rf"|{_EXECUTOR.pattern}"
    # TensorRT-LLM's tag, then (after a rank, a time) an error level on its line.
    rf"|(?P<llm>{LLM_TAG.pattern}[^\n]{{0,60}}?\[(?:ERROR|E)\])[\s\S]{{0,300}}?{_SHORTAGE}"
    r"|(?P<kv>maxTokensInPagedKvCache\s+must\s+be\s+large\s+enough)"
)
# The executor's table (TensorRT-LLM's _ExecutorMemoryMonitor) and what it could not create.
_TOTAL_ROW = table_row(r"Total\s+GPU\s+memory")
_FREE_ROW = table_row(r"Free\s+GPU\s+memory")
_COMPONENT = re.compile(
    r"The\s+following\s+component\s+could\s+not\s+be\s+created:[ \t]*(?P<component>[^\n]{1,80})"
)
_LLM_CALL = re.compile(r"error\s+in\s+(?:::)?(\w+)\(")
_LLM_SOURCE = re.compile(r"\((?:[^()\s]*/)?(\w+\.(?:h|cpp|cu)):(\d+)\)")
_REQUESTED = re.compile(
    r"Requested\s+amount\s+of\s+(?:GPU\s+)?memory\s+\((?P<bytes>\d+)\s+bytes\)\s+could\s+not"
)
EXECUTOR_CATEGORY = "tensorrt_llm_executor_out_of_memory"
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
            exception=exception_before(window, span.start),
            api_call=call,
            source_location=location,
            message=window[begins : span.end].strip()[:4000],
        )
        _read_executor(span, facts)
        return [Found(span.start, facts)]
    return []


def _read_executor(span: Span, facts: OomFacts) -> None:
    """The executor's failure (its sentence, or the component it names) with the card's
    figures in its table; the component that did not fit is the ``phase``."""
    facts.total_bytes = span.size(_TOTAL_ROW)
    facts.free_bytes = span.size(_FREE_ROW)
    component = span.group(_COMPONENT, "component")
    if component or span.has(_EXECUTOR):
        facts.category = EXECUTOR_CATEGORY
        facts.phase = component.strip().rstrip(".").lower() if component else None
