"""NCCL / RCCL: the collective library could not get memory for its buffers.

Wordings (from NCCL's ``checks.h`` / ``alloc.h`` / ``shmutils.cc`` and PyTorch's
``ProcessGroupNCCL``), each prefixed by NCCL's ``host:pid:tid [gpu]`` when logged:

* ``NCCL WARN Cuda failure 'out of memory'``; NCCL >= 2.19 adds the CUDA error number
  (``Cuda failure 2 'out of memory'``). RCCL prints the same "Cuda failure" text on AMD.
  NCCL 2.x before the tag printed ``host:pid:tid [gpu] init.cu:218 WARN Cuda failure
  'out of memory'``: its WARN level, with or without the tag, is where it logs failures.
* ``NCCL WARN Failed to CUDA calloc 6291456 bytes`` (also ``CUDA host alloc``, pinned RAM).
* ``NCCL WARN Error while creating shared memory segment /dev/shm/nccl-XXXX (size N)`` and
  ``failed to extend /dev/shm/nccl-XXXX to N bytes``: /dev/shm (a container's 64 MiB
  default) is full; host memory, not the GPU. Through PyTorch this arrives as
  ``ncclSystemError ... Last error: Error while creating shared memory segment``.
* PyTorch: ``NCCL error in: ...ProcessGroupNCCL.cpp:N, unhandled cuda error[ (run with
  NCCL_DEBUG=INFO for details)], NCCL version X`` then ``ncclUnhandledCudaError: Call to
  CUDA function failed.`` and, since NCCL 2.12, ``Last error:`` with the CUDA failure.
  Older torch: ``NCCL Error 1: unhandled cuda error``. Where NCCL names the CUDA failure
  (its ``Last error:`` line, each line behind a logger's or a host's prefix, or its own
  ``NCCL WARN Cuda failure`` just before), only an out-of-memory one (its text, or the
  number 2) makes this an OOM: ``Cuda failure 'initialization error'``, ``1 'invalid
  argument'`` or ``999 'unknown error'`` are other errors. Where nothing names it,
  out-of-memory is the usual cause (``nccl_unhandled_cuda_error``, an OOM suspect).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, Span, exception_before, spans

# NCCL logs its fatal errors at its WARN level: "NCCL WARN ...", and in NCCL 2.x before
# the tag (and under PyTorch's old THD) "host:pid:tid [gpu] init.cu:218 WARN ...". WARN
# there is where NCCL prints what failed, not a warning that the program went on.
_WARN = r"(?:NCCL\s+WARN|(?<![\w-])WARN|\[WARN\])\s+"
_CUDA_FAILURE_OOM = re.compile(_WARN + r"(?:Cuda|HIP)\s+failure\s+(?:\d+\s+)?'out\s+of\s+memory'")
_CALLOC = re.compile(
    _WARN
    + r"Failed\s+to\s+CUDA\s+(?P<host>host\s+)?(?:calloc|alloc|malloc)\s+(?P<bytes>\d+)\s+bytes"
)
_SHM = re.compile(
    r"(?:Error\s+while\s+creating\s+shared\s+memory\s+segment\s+(?P<segment>/\S+)\s+\(size\s+(?P<size>\d+)\)"
    r"|failed\s+to\s+extend\s+(?P<extended>/dev/shm/\S+)\s+to\s+(?P<to>\d+)\s+bytes)"
)
_UNHANDLED = re.compile(r"unhandled\s+cuda\s+error|ncclUnhandledCudaError")
# How far after "unhandled cuda error" PyTorch prints NCCL's "Last error:" line, and how far
# before it NCCL's own WARN line with the failure may be.
LAST_ERROR_LOOKAHEAD_CHARS = 800
CUDA_FAILURE_LOOKBACK_CHARS = 800
# The CUDA failure NCCL names: "Cuda failure 'initialization error'", NCCL >= 2.19's "Cuda
# failure 1 'invalid argument'", RCCL's "HIP failure ...". Found wherever it is within the
# bounds, so a prefix on each line ("rank0: ", "worker-1: ") does not hide it.
_CUDA_FAILURE = re.compile(
    r"(?:Cuda|CUDA|HIP)\s+failure\s+(?:(?P<code>\d+)\s+)?'(?P<what>[^'\n]{1,80})'"
)
# NCCL's "Last error:" with a failure that is about memory, in NCCL's other words: its
# "Failed to CUDA calloc N bytes" (or alloc, malloc; not "host alloc", pinned RAM) behind
# the unhandled error.
_LAST_ERROR_MEMORY = re.compile(
    r"Last\s+error:[^\n]{0,200}\n?[^\n]{0,200}?Failed\s+to\s+CUDA\s+(?:calloc|alloc|malloc)\b"
)
_OUT_OF_MEMORY = re.compile(r"out\s+of\s+memory", re.IGNORECASE)
# XLA relays NCCL's last logged warning with a caveat: "Last NCCL warning(error) log entry
# (may be unrelated) 'Cuda failure 2 'out of memory''". An out-of-memory named only there
# is a likely cause, not a certain one.
_MAY_BE_UNRELATED = re.compile(r"\(may\s+be\s+unrelated\)[^\n]{0,40}$")
UNRELATED_CATEGORY = "nccl_last_warning_oom"
# "host:pid:tid [gpu]" right before the message on its line.
# Matched from a name's first character only: tried from every character of a long word,
# the pattern would cost the word's length squared.
_ORIGIN = re.compile(r"(?<![\w.-])(?P<host>[\w.-]+):(?P<pid>\d+):\d+\s+\[(?P<gpu>\d+)\]")


def find(window: str) -> list[Found]:
    """Every NCCL/RCCL out-of-memory (or likely one) in ``window``."""
    found: list[Found] = []
    for header, build in _BUILDERS:
        for span in spans(window, header, limit=800):
            facts = build(span)
            if facts is not None:
                found.append(Found(span.start, facts))
    return found


def _origin(span: Span) -> tuple[str | None, int | None, int | None]:
    matches = list(_ORIGIN.finditer(span.text, span.line_lookback, span.start))
    if not matches:
        return None, None, None
    last = matches[-1]
    return last["host"], int(last["pid"]), int(last["gpu"])


def _amd(span: Span) -> bool:
    # RCCL prints the same "Cuda failure" text on AMD GPUs; its paths say hipify/rccl.
    line = span.text[span.line_lookback : span.start].lower()
    return "rccl" in line or "hipify" in line or "HIP failure" in span.text[span.start : span.end]


def _cuda_oom(span: Span) -> OomFacts:
    host, pid, gpu = _origin(span)
    calloc = _CALLOC.search(span.text, span.start, span.end)
    return OomFacts(
        kind="nccl",
        category="nccl_cuda_oom",
        device_type="hip" if _amd(span) else "cuda",
        device_index=gpu,
        host=host,
        pid=pid,
        requested_bytes=int(calloc["bytes"]) if calloc and not calloc["host"] else None,
        message=span.snippet,
    )


def _calloc(span: Span) -> OomFacts:
    host, pid, gpu = _origin(span)
    match = _CALLOC.match(span.text, span.start)
    assert match is not None
    pinned = bool(match["host"])
    return OomFacts(
        kind="nccl",
        category="nccl_host_alloc_failed" if pinned else "nccl_cuda_oom",
        device_type="host" if pinned else ("hip" if _amd(span) else "cuda"),
        device_index=None if pinned else gpu,
        host=host,
        pid=pid,
        requested_bytes=int(match["bytes"]),
        message=span.snippet,
    )


def _shm(span: Span) -> OomFacts:
    host, pid, _ = _origin(span)
    match = _SHM.match(span.text, span.start)
    assert match is not None
    return OomFacts(
        kind="nccl",
        category="nccl_shm_exhausted",
        exception=exception_before(span.text, span.start),
        device_type="host",
        host=host,
        pid=pid,
        requested_bytes=int(match["size"] or match["to"]),
        source_location=match["segment"] or match["extended"],
        message=span.snippet,
    )


def _named_failure(span: Span) -> str | None:
    """The category of the CUDA failure NCCL names around the unhandled error: an
    out-of-memory, one only in a log entry the message says may be unrelated, ``""`` for
    another error, ``None`` where none is named."""
    # Both header wordings appear in one message; look past the span for "Last error".
    low = max(0, span.start - CUDA_FAILURE_LOOKBACK_CHARS)
    high = span.start + LAST_ERROR_LOOKAHEAD_CHARS
    named = list(_CUDA_FAILURE.finditer(span.text, low, high))
    oom = [f for f in named if f["code"] == "2" or _OUT_OF_MEMORY.fullmatch(f["what"])]
    if oom and all(_MAY_BE_UNRELATED.search(span.text, low, f.start()) for f in oom):
        return UNRELATED_CATEGORY
    if oom or _LAST_ERROR_MEMORY.search(span.text, span.start, high):
        return "nccl_cuda_oom"
    return "" if named else None


def _unhandled(span: Span) -> OomFacts | None:
    named = _named_failure(span)
    if named == "":
        return None  # the CUDA failure is named, and it is not memory
    host, pid, gpu = _origin(span)
    return OomFacts(
        kind="nccl",
        category=named or "nccl_unhandled_cuda_error",
        exception=exception_before(span.text, span.start),
        device_type="cuda",
        device_index=gpu,
        host=host,
        pid=pid,
        cuda_error="ncclUnhandledCudaError",
        message=span.snippet,
    )


_BUILDERS: tuple[tuple[re.Pattern[str], Callable[[Span], OomFacts | None]], ...] = (
    (_CUDA_FAILURE_OOM, _cuda_oom),
    (_CALLOC, _calloc),
    (_SHM, _shm),
    (_UNHANDLED, _unhandled),
)
