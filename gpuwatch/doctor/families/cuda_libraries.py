"""Out-of-memory reported by CUDA itself or a CUDA library, outside PyTorch's allocator.

These messages carry no sizes (or only the one failed request), so what they tell is
*where* memory ran out: a plain ``CUDA error: out of memory`` (often the CUDA context
or a kernel's own allocation), cuBLAS/cuDNN handle or workspace creation, NCCL's
communication buffers, bitsandbytes' managed (paged-optimizer) memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, Span, exception_before, spans

_RUNTIME = re.compile(r"CUDA\s+error:\s+out\s+of\s+memory")
# The driver API's name. TensorFlow's stream executor prints it too, after "failed to
# alloc(ate) ... from device/on host:"; that wording is the tensorflow family's.
_DRIVER = re.compile(r"CUDA_ERROR_OUT_OF_MEMORY")
_TF_ALLOC_BEFORE = re.compile(r"failed\s+to\s+alloc")
_DRIVER_CALL = re.compile(r"\.(cu[A-Z]\w*)\(")
_CUBLAS = re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")
_CALLING = re.compile(r"when\s+calling\s+`?(\w+\([^)`\n]{0,80}\))")
# cuDNN statuses that, in practice, mostly mean cuDNN could not get memory for its
# handle or workspace; ALLOC_FAILED says so outright.
_CUDNN_STATUS = re.compile(
    r"CUDNN_STATUS_(ALLOC_FAILED|NOT_INITIALIZED|EXECUTION_FAILED|INTERNAL_ERROR)"
)
_CUDNN_NO_ALGORITHM = re.compile(r"Unable\s+to\s+find\s+a\s+valid\s+cuDNN\s+algorithm")
_CPP_LOCATION = re.compile(r"\bat\s+\S*?(\w+\.cpp:\d+)")
_WORKSPACE = re.compile(
    r"Minimum\s+workspace\s+size:\s*(?P<need>\d+)\s*Bytes\s+Given:\s*(?P<given>\d+)\s*Bytes"
)
_NCCL = re.compile(r"NCCL\s+WARN\s+Cuda\s+failure\s+'out\s+of\s+memory'")
_NCCL_ORIGIN = re.compile(r"(?P<host>[\w.-]+):(?P<pid>\d+):\d+\s+\[(?P<gpu>\d+)\]")
_NCCL_CALLOC = re.compile(r"Failed\s+to\s+CUDA\s+calloc\s+(\d+)\s+bytes")
_BNB = re.compile(
    r"Error\s+out\s+of\s+memory\s+at\s+line\s+(?P<line>\d+)\s+in\s+file\s+(?P<file>\S+)"
)


def find(window: str) -> list[Found]:
    """Every CUDA runtime/driver/library OOM in ``window``."""
    found: list[Found] = []
    for header, build in _BUILDERS:
        for span in spans(window, header, limit=800):
            facts = build(span)
            if facts is not None:
                found.append(Found(span.start, facts))
    return found


def _runtime(span: Span) -> OomFacts:
    return OomFacts(
        kind="driver",
        category="cuda_runtime_error_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        cuda_error="cudaErrorMemoryAllocation",
        message=span.snippet,
    )


def _driver(span: Span) -> OomFacts | None:
    line_start = span.text.rfind("\n", 0, span.start) + 1
    if _TF_ALLOC_BEFORE.search(span.text, line_start, span.start):
        return None
    return OomFacts(
        kind="driver",
        category="cuda_driver_error_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        cuda_error="CUDA_ERROR_OUT_OF_MEMORY",
        api_call=span.group(_DRIVER_CALL),
        message=span.snippet,
    )


def _cublas(span: Span) -> OomFacts:
    return OomFacts(
        kind="cublas",
        category="cublas_alloc_failed",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        library_status="CUBLAS_STATUS_ALLOC_FAILED",
        api_call=span.group(_CALLING),
        message=span.snippet,
    )


def _cudnn_status(span: Span) -> OomFacts:
    status = span.group(_CUDNN_STATUS)
    return OomFacts(
        kind="cudnn",
        category="cudnn_alloc_failed" if status == "ALLOC_FAILED" else "cudnn_status_oom_suspect",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        library_status=f"CUDNN_STATUS_{status}",
        message=span.snippet,
    )


def _cudnn_no_algorithm(span: Span) -> OomFacts:
    return OomFacts(
        kind="cudnn",
        category="cudnn_no_algorithm_oom",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        source_location=span.group(_CPP_LOCATION),
        message=span.snippet,
    )


def _workspace(span: Span) -> OomFacts:
    return OomFacts(
        kind="cudnn",
        category="conv_workspace_insufficient",
        device_type="cuda",
        workspace_required_bytes=span.integer(_WORKSPACE, "need"),
        workspace_given_bytes=span.integer(_WORKSPACE, "given"),
        message=span.snippet,
    )


def _nccl(span: Span) -> OomFacts:
    line_start = span.text.rfind("\n", 0, span.start) + 1
    origin = _NCCL_ORIGIN.search(span.text, line_start, span.start)
    line = span.text[line_start : span.start].lower()
    # RCCL prints the same "Cuda failure" text on AMD GPUs; its paths say hipify/rccl.
    amd = "rccl" in line or "hipify" in line
    return OomFacts(
        kind="nccl",
        category="nccl_cuda_oom",
        device_type="hip" if amd else "cuda",
        device_index=int(origin["gpu"]) if origin else None,
        host=origin["host"] if origin else None,
        pid=int(origin["pid"]) if origin else None,
        requested_bytes=span.integer(_NCCL_CALLOC),
        message=span.snippet,
    )


def _bitsandbytes(span: Span) -> OomFacts:
    path = span.group(_BNB, "file") or ""
    # Keep the path inside the bitsandbytes tree ("csrc/pythonInterface.c"), not the
    # reporter's home directory.
    source = path[path.rfind("csrc/") :] if "csrc/" in path else path.rsplit("/", 1)[-1]
    return OomFacts(
        kind="bitsandbytes",
        category="bitsandbytes_cuda_error_oom",
        device_type="cuda",
        source_location=source or None,
        source_line=span.integer(_BNB, "line"),
        message=span.snippet,
    )


_BUILDERS: tuple[tuple[re.Pattern[str], Callable[[Span], OomFacts | None]], ...] = (
    (_RUNTIME, _runtime),
    (_DRIVER, _driver),
    (_CUBLAS, _cublas),
    (_CUDNN_STATUS, _cudnn_status),
    (_CUDNN_NO_ALGORITHM, _cudnn_no_algorithm),
    (_WORKSPACE, _workspace),
    (_NCCL, _nccl),
    (_BNB, _bitsandbytes),
)
