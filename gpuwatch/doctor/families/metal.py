"""Apple Metal: a command buffer aborted because the GPU (unified memory) ran out.

``Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)`` is the
``MTLCommandBufferError`` text (as an NSError: ``Error Domain=MTLCommandBufferErrorDomain
Code=8 "Insufficient Memory (IOAF code 8)"``); llama.cpp's Metal backend prints it after
``ggml_metal_graph_compute: command buffer N failed with status 5`` and MLX raises it as
``[METAL] Command buffer execution failed: ...``. PyTorch's MPS allocator has its own
wording (:mod:`~gpuwatch.doctor.families.mps`). No sizes are printed: the fix is a
smaller context or model, or fewer other apps holding unified memory.

llama.cpp's Metal backend before it printed the error's description logged only its
status, ``command buffer N failed with status 5`` (``MTLCommandBufferStatusError``, any
error), and some builds the description's words on the next line (``out of memory``): that
status is read as an out-of-memory only where the line or the two after it say memory ran
out (``out of memory``, ``Insufficient Memory``).

MLX's allocator says so before a command buffer runs: ``[malloc_or_wait] Unable to
allocate N bytes.`` (``[malloc]`` in later releases) when unified memory is used up, and
``[metal::malloc] Attempting to allocate N bytes which is greater than the maximum
allowed buffer size of M bytes.`` when one buffer is larger than Metal allows at all.
"""

from __future__ import annotations

import itertools
import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, line_start, spans

_HEADER = re.compile(
    r"(?:Insufficient\s+Memory\s+\(\w+:)?kIOGPUCommandBufferCallbackErrorOutOfMemory\)?"
    # The same status as an NSError, as Swift prints it: the domain's code 8, in words.
    r"|MTLCommandBufferErrorDomain\s+Code=8\b|Insufficient\s+Memory\s+\(IOAF\s+code\s+8\)"
    # MLX's exception, also without the status code after it.
    r"|\[METAL\]\s+Command\s+buffer\s+execution\s+failed:\s+Insufficient\s+Memory\b"
)
_GGML = re.compile(r"ggml_metal|llama_|ggml_backend")
# MTLCommandBufferStatusError (5): an error of any kind, until the words after it say which.
_STATUS_ERROR = re.compile(r"command\s+buffer\s+\d+\s+failed\s+with\s+status\s+5\b")
_SAYS_MEMORY = re.compile(r"out\s+of\s+memory|insufficient\s+memory", re.IGNORECASE)
STATUS_LINES_AFTER = 2
MAX_STATUS_TRIES = 16  # each costs a look along three lines: a line repeating it stays linear
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
    found.extend(_status_error(window))
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
                per_allocation_limit_bytes=int(match["limit"])
                if header is _MLX_TOO_LARGE
                else None,
                api_call="MLX",
                message=window[match.start() : match.end() + 1].strip(),
            )
            found.append(Found(match.start(), facts))
    return found


def _status_error(window: str) -> list[Found]:
    """Each ``command buffer N failed with status 5`` whose line, or one of the two after
    it, says memory ran out."""
    found = []
    for match in itertools.islice(_STATUS_ERROR.finditer(window), MAX_STATUS_TRIES):
        end = match.end()
        for _ in range(STATUS_LINES_AFTER + 1):  # the rest of its line, then two more
            newline = window.find("\n", end + 1)
            end = len(window) if newline == -1 else newline
        if not _SAYS_MEMORY.search(window, match.end(), end):
            continue
        begins = line_start(window, match.start())
        facts = OomFacts(
            kind="metal",
            category="metal_command_buffer_oom",
            exception=exception_before(window, begins),
            device_type="metal",
            api_call="llama.cpp (ggml Metal)" if _GGML.search(window, begins, end) else None,
            message=window[begins:end].strip()[:4000],
        )
        found.append(Found(begins, facts))
    return found
