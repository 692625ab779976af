"""TensorFlow and XLA (JAX, TF-XLA, Elixir EXLA) out-of-memory messages.

* TensorFlow: ``OOM when allocating tensor with shape[...] and type float on
  /job:.../device:GPU:0 by allocator GPU_0_bfc`` (a ``ResourceExhaustedError``).
* Its stream executor, when the BFC allocator grows: ``failed to allocate 90.48M
  (94873600 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY``, retried with smaller sizes;
  ``... on host:`` means pinned *host* memory ran out, not the GPU.
* ``Allocator (GPU_0_bfc) ran out of memory ... The caller indicates that this is not a
  failure`` is a warning only; alone it is not an OOM.
* XLA: ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate N bytes`` or
  ``Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0``, often
  after a BFC ``Stats:`` dump with ``Limit:`` and ``InUse:`` in bytes.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    SIZE,
    Found,
    Span,
    compile_clause,
    exception_before,
    name_near,
    size_of,
    spans,
)

_TF_OOM = re.compile(
    r"OOM\s+when\s+allocating\s+tensor\s+(?:with|of)\s+shape\s*(?P<shape>\[[\d,\s]{0,200}\])"
    r"\s+and\s+type\s+(?P<dtype>\w+)"
)
_TF_DEVICE = re.compile(r"device:(?P<type>GPU|XPU|CPU):(?P<index>\d+)")
_RESOURCE_EXHAUSTED_ERROR = re.compile(r"([\w.]*ResourceExhaustedError)\b")
_BFC_FAILURE = compile_clause(
    r"Allocator\s+ran\s+out\s+of\s+memory\s+trying\s+to\s+allocate\s+", r"(?!\s+with\s+freed_by)"
)
_BFC_WARNING = re.compile(
    rf"ran\s+out\s+of\s+memory\s+trying\s+to\s+allocate\s+{SIZE}\s+with\s+freed_by_count=\d+\."
    r"\s+The\s+caller\s+indicates\s+that\s+this\s+is\s+not\s+a\s+failure"
)
_STREAM_EXECUTOR = re.compile(
    rf"failed\s+to\s+alloc(?:ate)?\s+{SIZE}\s+(?P<where>from\s+device|on\s+host)\s*:\s*"
    r"(?P<error>CUDA_ERROR_OUT_OF_MEMORY|HIP_ERROR_OutOfMemory)"
)
_XLA_OOM = re.compile(
    r"(?:RESOURCE_EXHAUSTED|Resource\s+exhausted):\s+Out\s+of\s+memory\s+while\s+trying\s+to"
    r"\s+allocate\s+(?P<bytes>\d+)\s+bytes"
)
_XLA_REQUEST = re.compile(
    rf"RESOURCE_EXHAUSTED:\s+Failed\s+to\s+allocate\s+request\s+for\s+{SIZE}"
    r"(?:\s+on\s+device\s+ordinal\s+(?P<ordinal>\d+))?"
)
_BFC_LIMIT = re.compile(r"(?:^|\n)\s*Limit:\s+(\d+)")
_BFC_IN_USE = re.compile(r"(?:^|\n)\s*InUse:\s+(\d+)")
_TPU = re.compile(r"\bTPU\b|\bHBM\b")


def find(window: str) -> list[Found]:
    """Every TensorFlow/XLA OOM in ``window``; stream-executor retries form one message."""
    return [*_find_tf_oom(window), *_find_stream_executor(window), *_find_xla(window)]


def _find_tf_oom(window: str) -> list[Found]:
    found = []
    for span in spans(window, _TF_OOM, limit=1200):
        match = _TF_OOM.match(window, span.start)
        assert match is not None
        device = _TF_DEVICE.search(window, span.start, span.end)
        before = window[max(0, span.start - 1500) : span.start]
        # The last allocator failure before the OOM line is the request that failed.
        failures = list(_BFC_FAILURE.finditer(before))
        failure = failures[-1] if failures else None
        facts = OomFacts(
            kind="tensorflow",
            category="tensorflow_oom_allocating_tensor",
            exception=name_near(window, span.start, _RESOURCE_EXHAUSTED_ERROR),
            device_type=device["type"].lower() if device else None,
            device_index=int(device["index"]) if device else None,
            requested_bytes=size_of(failure) if failure else None,
            tensor_shape=re.sub(r"\s", "", match["shape"]),
            dtype=match["dtype"],
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def _find_stream_executor(window: str) -> list[Found]:
    attempts = list(_STREAM_EXECUTOR.finditer(window))
    if not attempts:
        return []
    first = attempts[0]
    on_host = first["where"] == "on host"
    facts = OomFacts(
        kind="tensorflow",
        category="host_pinned_memory_oom" if on_host else "tensorflow_stream_executor_alloc_failed",
        device_type="host" if on_host else ("hip" if first["error"].startswith("HIP") else "gpu"),
        cuda_error=first["error"],
        requested_bytes=size_of(first),
        attempts_bytes=[size_of(m) for m in attempts],
        nonfatal_requests_bytes=[size_of(m) for m in _BFC_WARNING.finditer(window)],
        message=window[first.start() : attempts[-1].end()][:4000],
    )
    return [Found(first.start(), facts)]


def _find_xla(window: str) -> list[Found]:
    found = []
    for header in (_XLA_OOM, _XLA_REQUEST):
        for span in spans(window, header, limit=1500):
            found.append(Found(span.start, _xla_facts(window, span, header)))
    return found


def _xla_facts(window: str, span: Span, header: re.Pattern[str]) -> OomFacts:
    match = header.match(window, span.start)
    assert match is not None
    by_request = header is _XLA_REQUEST
    stats_start = max(0, span.start - 1500)
    limit = _BFC_LIMIT.search(window, stats_start, span.start)
    in_use = _BFC_IN_USE.search(window, stats_start, span.start)
    return OomFacts(
        kind="xla",
        category="xla_resource_exhausted",
        exception=exception_before(window, span.start)
        or name_near(window, span.start, _RESOURCE_EXHAUSTED_ERROR),
        device_type="tpu" if _TPU.search(window, stats_start, span.end) else "gpu",
        device_index=int(match["ordinal"]) if by_request and match["ordinal"] else None,
        requested_bytes=size_of(match) if by_request else int(match["bytes"]),
        allowed_bytes=int(limit[1]) if limit else None,
        allocated_bytes=int(in_use[1]) if in_use else None,
        message=span.snippet,
    )
