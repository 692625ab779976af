"""TensorFlow out-of-memory messages (XLA's are in :mod:`~gpuwatch.doctor.families.xla`).

* ``OOM when allocating tensor with shape[...] and type float on
  /job:.../device:GPU:0 by allocator GPU_0_bfc`` (a ``ResourceExhaustedError``; TF 1.x
  wrote ``tensor of shape [...]``, TF 0.x stopped after ``with shape``; the device may be
  ``CPU:0``, Intel's ``XPU:0`` or, before TF 1.5, ``/gpu:0``).
* TF 2.x eager: ``ResourceExhaustedError: failed to allocate memory [Op:AddV2]``.
* The BFC allocator's own failure: ``Allocator (GPU_0_bfc) ran out of memory trying to
  allocate 32.0KiB (rounded to 32768)`` (then ``requested by op X`` in TF >= 2.5, and the
  "Current allocation summary follows" dump). ``... with freed_by_count=0. The caller
  indicates that this is not a failure ...`` (or, before 2.1, ``... allocate 217.69MiB.
  The caller indicates ...``) is a warning only; alone it is not an OOM.
* Its stream executor, when the BFC allocator grows: ``failed to allocate 90.48M
  (94873600 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY``, retried with smaller sizes;
  ``... on host:`` means pinned *host* memory ran out, not the GPU; ``... bytes unified
  memory; result: CUDA_ERROR_OUT_OF_MEMORY`` is managed memory (JAX on GPU); ROCm builds
  print ``HIP_ERROR_OutOfMemory`` or, in hiptensorflow, ``hipError_t(1002)``.
* ``EigenAllocator for GPU ran out of memory when allocating N`` (TF 1.x, fatal).
* ``InternalError: Dst tensor is not initialized.``: TF 1.x's wording when a GPU copy
  could not get its destination buffer, which in practice is GPU memory running out.
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

# Shape and type are optional: TF 0.x printed "... tensor with shape" and nothing more,
# and many reports cut the line after the shape.
_TF_OOM = re.compile(
    r"OOM\s+when\s+allocating\s+tensor"
    r"(?:\s+(?:with|of)\s+shape\s*(?P<shape>\[[\d,\s]{0,200}\])?)?"
    r"(?:\s+and\s+type\s+(?P<dtype>\w+))?"
)
# "device:GPU:0" (TF 1.5+), "/gpu:0" (TF 1.0-1.4).
_TF_DEVICE = re.compile(
    r"device:(?P<type>GPU|XPU|CPU):(?P<index>\d+)|/(?P<old>gpu|cpu):(?P<old_index>\d+)"
)
_RESOURCE_EXHAUSTED_ERROR = re.compile(r"([\w.]*ResourceExhaustedError)\b")
_INTERNAL_ERROR = re.compile(r"([\w.]*InternalError)\b")
# The allocator's failure; the ITEX build prints "Allocator ran out ..." with no name, and
# people quoting it often drop the "Allocator (GPU_0_bfc)" in front.
_BFC_FAILURE = compile_clause(
    r"(?:Allocator\s+(?:\((?P<allocator>\w+)\)\s+)?)?ran\s+out\s+of\s+memory\s+trying\s+to\s+allocate\s+",
    r"(?:\s*\(rounded\s+to\s+(?P<rounded>\d+)\))?"
    r"(?!\s*(?:with\s+freed_by|\.\s*The\s+caller))",
)
_BFC_WARNING = re.compile(
    rf"ran\s+out\s+of\s+memory\s+trying\s+to\s+allocate\s+{SIZE}\s+with\s+freed_by_count=\d+\."
    r"\s+The\s+caller\s+indicates\s+that\s+this\s+is\s+not\s+a\s+failure"
)
_STREAM_EXECUTOR = re.compile(
    rf"failed\s+to\s+alloc(?:ate)?\s+{SIZE}\s+(?P<where>from\s+device|on\s+host|unified\s+memory)"
    r"\s*(?:;\s*result)?\s*:\s*"
    r"(?P<error>CUDA_ERROR_OUT_OF_MEMORY|HIP_ERROR_OutOfMemory|hipError_t\(1002\))"
)
_FAILED_TO_ALLOCATE = re.compile(
    r"(?:ResourceExhaustedError|RESOURCE_EXHAUSTED|Resource\s+exhausted):\s*"
    r"[Ff]ailed\s+to\s+allocate\s+memory(?:\s+\[Op:(?P<op>\w+)\])?"
)
_EIGEN = re.compile(
    r"EigenAllocator\s+for\s+GPU\s+ran\s+out\s+of\s+memory\s+when\s+allocating\s+(?P<bytes>\d+)"
)
_DST_TENSOR = re.compile(r"Dst\s+tensor\s+is\s+not\s+initialized")
# Any of these after a lone BFC failure is the message that reports it.
_REPORTING = re.compile(
    r"OOM\s+when\s+allocating|[Ff]ailed\s+to\s+allocate\s+memory|Dst\s+tensor|RESOURCE_EXHAUSTED"
    r"|Resource\s+exhausted|EigenAllocator"
)
BFC_LOOKBACK_CHARS = 1500
_XLA_SOURCE = re.compile(r"\bxla/(?:tsl|xla|service|pjrt|stream_executor)/|\bjax(?:lib)?\b")


def find(window: str) -> list[Found]:
    """Every TensorFlow OOM in ``window``; stream-executor retries form one message."""
    return [
        *_find_tf_oom(window),
        *_find_stream_executor(window),
        *_find_simple(window),
        *_find_bfc(window),
    ]


def _device(window: str, start: int, end: int) -> tuple[str | None, int | None]:
    match = _TF_DEVICE.search(window, start, end)
    if match is None:
        return None, None
    if match["type"]:
        return match["type"].lower(), int(match["index"])
    return match["old"], int(match["old_index"])


def _find_tf_oom(window: str) -> list[Found]:
    found = []
    for span in spans(window, _TF_OOM, limit=1200):
        match = _TF_OOM.match(window, span.start)
        assert match is not None
        device_type, device_index = _device(window, span.start, span.end)
        before = window[max(0, span.start - BFC_LOOKBACK_CHARS) : span.start]
        # The last allocator failure before the OOM line is the request that failed.
        failures = list(_BFC_FAILURE.finditer(before))
        failure = failures[-1] if failures else None
        facts = OomFacts(
            kind="tensorflow",
            category="tensorflow_oom_allocating_tensor",
            exception=name_near(window, span.start, _RESOURCE_EXHAUSTED_ERROR),
            device_type=device_type,
            device_index=device_index,
            requested_bytes=size_of(failure) if failure else None,
            tensor_shape=re.sub(r"\s", "", match["shape"]) if match["shape"] else None,
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
    where, error = first["where"], first["error"]
    on_host = where == "on host"
    hip = not error.startswith("CUDA")
    if on_host:
        category, device_type = "host_pinned_memory_oom", "host"
    elif where.startswith("unified"):
        category, device_type = "tensorflow_stream_executor_unified_alloc_failed", "gpu"
    else:
        category = "tensorflow_stream_executor_alloc_failed"
        device_type = "hip" if hip else "gpu"
    facts = OomFacts(
        kind="tensorflow",
        category=category,
        device_type=device_type,
        cuda_error="HIP_ERROR_OutOfMemory" if hip else error,
        requested_bytes=size_of(first),
        attempts_bytes=[size_of(m) for m in attempts],
        nonfatal_requests_bytes=[size_of(m) for m in _BFC_WARNING.finditer(window)],
        message=window[first.start() : attempts[-1].end()][:4000],
    )
    return [Found(first.start(), facts)]


def _find_simple(window: str) -> list[Found]:
    """The wordings that carry at most a size: failed-to-allocate, Eigen, Dst tensor."""
    found = []
    for header, category in (
        (_FAILED_TO_ALLOCATE, "tensorflow_failed_to_allocate_memory"),
        (_EIGEN, "tensorflow_eigen_allocator_oom"),
        (_DST_TENSOR, "tensorflow_dst_tensor_not_initialized"),
    ):
        for span in spans(window, header, limit=800):
            found.append(Found(span.start, _simple_facts(span, header, category)))
    return found


def _simple_facts(span: Span, header: re.Pattern[str], category: str) -> OomFacts:
    match = header.match(span.text, span.start)
    assert match is not None
    device_type, device_index = _device(span.text, span.start, span.end)
    named = _INTERNAL_ERROR if header is _DST_TENSOR else _RESOURCE_EXHAUSTED_ERROR
    return OomFacts(
        kind="tensorflow",
        category=category,
        exception=exception_before(span.text, span.start)
        or name_near(span.text, span.start, named),
        device_type=device_type or ("gpu" if header is _EIGEN else None),
        device_index=device_index,
        requested_bytes=int(match["bytes"]) if header is _EIGEN else None,
        api_call=match["op"] if header is _FAILED_TO_ALLOCATE else None,
        message=span.snippet,
    )


def _find_bfc(window: str) -> list[Found]:
    """A BFC failure with no message after it that reports the failure (a cut log)."""
    found = []
    for span in spans(window, _BFC_FAILURE, limit=BFC_LOOKBACK_CHARS):
        if _REPORTING.search(window, span.start):
            continue
        match = _BFC_FAILURE.match(window, span.start)
        assert match is not None
        allocator = match["allocator"] or ""
        gpu = re.fullmatch(r"GPU_(\d+)_bfc", allocator)
        # XLA (JAX) runs the same BFC allocator; its log lines name XLA's source tree.
        xla = _XLA_SOURCE.search(window, span.line_lookback, span.start) is not None
        facts = OomFacts(
            kind="xla" if xla else "tensorflow",
            category="xla_bfc_allocator_oom" if xla else "tensorflow_bfc_allocator_oom",
            device_type="gpu" if gpu else None,
            device_index=int(gpu[1]) if gpu else None,
            requested_bytes=int(match["rounded"]) if match["rounded"] else size_of(match),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
