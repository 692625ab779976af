"""XLA out-of-memory: JAX, TensorFlow's XLA path, PyTorch/XLA, Elixir EXLA; GPU and TPU.

Wordings (XLA's ``Status`` texts; the prefix is ``RESOURCE_EXHAUSTED:`` since 2021,
``Resource exhausted:`` before, raised as ``XlaRuntimeError``, ``JaxRuntimeError``,
``RuntimeError`` or TF's ``ResourceExhaustedError``):

* GPU, at run time: ``Out of memory while trying to allocate N bytes.``, often after a
  BFC ``Stats:`` dump (``Limit:``, ``InUse:`` in bytes), and PjRt's ``Failed to allocate
  request for 2.99GiB (3206250496B) on device ordinal 0``.
* GPU with the cudaMallocAsync allocator: ``gpu_async_0 cuMemAllocAsync failed to
  allocate N bytes: RESOURCE_EXHAUSTED: : CUDA_ERROR_OUT_OF_MEMORY ... Reported by
  CUDA: Free memory/Total memory: F/T``.
* TPU, at compile time: ``Ran out of memory in memory space hbm. Used 9.08G of 7.48G
  hbm. Exceeded hbm capacity by 1.60G.`` (also ``vmem``, on-chip vector memory), with
  ``XLA:TPU compile permanent error.`` in newer releases. The program's largest
  allocations follow, the first with ``Extra memory due to padding: 31.00G (32.0x
  expansion)`` where the tensor's two minor dimensions are padded to the chip's tiles.
* TPU, at run time: ``Attempting to reserve 3.95G at the bottom of memory. That was not
  possible. There are 1.92G free, 0B reserved, and 1.92G reservable.`` (or ``Attempting
  to allocate 180.59M. ...``), sometimes followed by ``HBM capacity 8.00G``.

TPU sizes use single-letter binary units (``9.08G``), like TensorFlow's.
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
    line_end,
    lines_around,
    name_near,
    size_of,
    spans,
)

_EXHAUSTED = r"(?:RESOURCE_EXHAUSTED|Resource\s+exhausted):\s+"
# The size in bytes ("6291456 bytes"), or human-readable ("2.50GiB") as some releases print it.
_OOM = re.compile(
    _EXHAUSTED + r"Out\s+of\s+memory\s+(?:while\s+trying\s+to\s+allocate|allocating)"
    rf"\s+(?:(?P<bytes>\d+)\s+bytes|{SIZE})"
)
_REQUEST = re.compile(
    rf"{_EXHAUSTED}Failed\s+to\s+allocate\s+request\s+for\s+{SIZE}"
    r"(?:\s+on\s+device\s+ordinal\s+(?P<ordinal>\d+))?"
)
_ASYNC = re.compile(r"cuMemAllocAsync\s+failed\s+to\s+allocate\s+(?P<bytes>\d+)\s+bytes")
_ASYNC_FREE_TOTAL = re.compile(r"Free\s+memory/Total\s+memory:\s*(?P<free>\d+)/(?P<total>\d+)")
_TPU_SPACE = re.compile(r"Ran\s+out\s+of\s+memory\s+in\s+memory\s+space\s+(?P<space>\w+)")
_TPU_USED = compile_clause(r"Used\s+", r"\s+of\s")
_TPU_CAPACITY = compile_clause(r"Used\s+\S+\s+of\s+", r"\s+[a-z]+\b")
_TPU_NOT_POSSIBLE = re.compile(
    r"Attempting\s+to\s+(?:reserve|allocate)\s+\S+(?:\s+at\s+the\s+bottom\s+of\s+memory)?\."
    r"\s+That\s+was\s+not\s+possible"
)
_TPU_WANTED = compile_clause(r"Attempting\s+to\s+(?:reserve|allocate)\s+")
_TPU_FREE = compile_clause(r"There\s+are\s+", r"\s+free")
_HBM_CAPACITY = compile_clause(r"HBM\s+capacity\s+")
# The largest allocation listed after a TPU's compile-time OOM, padded to the chip's tiles.
_PADDING = compile_clause(r"Extra\s+memory\s+due\s+to\s+padding:\s+")
# How far the listing of the program's largest allocations reaches after the message.
TPU_LISTING_CHARS = 3000
# Compilation refused up front, newer releases: "Compilation failure: Aborting compilation
# early because it's unlikely to have enough memory. Requires 3.47E, has 14.49G
# available." (the program's need, then what the device has).
_ABORTED = re.compile(
    r"Aborting\s+compilation\s+early\s+because\s+it(?:'s|\s+is)\s+unlikely\s+to\s+have"
    r"\s+enough\s+memory"
)
_ABORTED_NEEDS = compile_clause(r"Requires\s+")
_ABORTED_HAS = compile_clause(r"has\s+", r"\s+available")
# A TPU's HBM said to have run out in words (an issue title: "Getting out of hbm memory
# error on TPU", "it failed with hbm oom"), where the line or the lines around it name the
# TPU, XLA or a TPU slice ("v3-8", "v5e-16", "v5litepod-8"): HBM alone is also a GPU's.
_HBM_IN_WORDS = re.compile(r"(?i:\bout\s+of\s+(?:TPU\s+)?HBM\b|\bHBM\s+OOM\b)")
_TPU_NAMED = re.compile(r"\bTPU|\bXLA|(?<![\w.-])v[2-9][a-z]*-\d{1,4}\b", re.IGNORECASE)
_BFC_LIMIT = re.compile(r"(?:^|\n)\s*Limit:\s+(\d+)")
_BFC_IN_USE = re.compile(r"(?:^|\n)\s*InUse:\s+(\d+)")
_TPU = re.compile(r"\bTPU\b|\bHBM|\bhbm\b")
_RESOURCE_EXHAUSTED_ERROR = re.compile(r"([\w.]*ResourceExhaustedError)\b")
STATS_LOOKBACK_CHARS = 1500


def find(window: str) -> list[Found]:
    """Every XLA OOM in ``window``."""
    found = []
    for header in (_OOM, _REQUEST, _ASYNC):
        for span in spans(window, header, limit=1500):
            found.append(Found(span.start, _gpu_facts(span, header)))
    for span in spans(window, _TPU_SPACE, limit=TPU_LISTING_CHARS):
        found.append(Found(span.start, _tpu_space(span)))
    for span in spans(window, _TPU_NOT_POSSIBLE, limit=600):
        found.append(Found(span.start, _tpu_not_possible(span)))
    for span in spans(window, _ABORTED, limit=300, needs=("aborting compilation",)):
        found.append(Found(span.start, _aborted(span)))
    if not found:
        hbm = spans(window, _HBM_IN_WORDS, limit=300, needs=("out of hbm", "out of tpu", "hbm oom"))
        on_a_tpu = [span for span in hbm if _on_a_tpu(span)]
        found.extend(Found(span.start, _hbm_in_words(span)) for span in on_a_tpu[:1])
    return found


def _on_a_tpu(span: Span) -> bool:
    """Whether the line of ``span``, or the lines around it, name a TPU or XLA."""
    begin, end = span.line_start, line_end(span.text, span.start)
    return bool(
        _TPU_NAMED.search(span.text, begin, end)
        or _TPU_NAMED.search(lines_around(span.text, begin, end))
    )


def _aborted(span: Span) -> OomFacts:
    return OomFacts(
        kind="xla",
        category="xla_compile_aborted_not_enough_memory",
        exception=_exception(span),
        device_type="tpu" if _TPU.search(span.text, span.start, span.end) else None,
        requested_bytes=span.size(_ABORTED_NEEDS),
        free_bytes=span.size(_ABORTED_HAS),
        phase="compile",
        message=span.snippet,
    )


def _hbm_in_words(span: Span) -> OomFacts:
    return OomFacts(
        kind="xla",
        category="xla_tpu_memory_space_exhausted",
        exception=_exception(span),
        device_type="tpu",
        message=span.snippet,
    )


def _exception(span: Span) -> str | None:
    return exception_before(span.text, span.start) or name_near(
        span.text, span.start, _RESOURCE_EXHAUSTED_ERROR
    )


def _gpu_facts(span: Span, header: re.Pattern[str]) -> OomFacts:
    window = span.text
    match = header.match(window, span.start)
    assert match is not None
    stats_start = max(0, span.start - STATS_LOOKBACK_CHARS)
    limit = _BFC_LIMIT.search(window, stats_start, span.end)
    in_use = _BFC_IN_USE.search(window, stats_start, span.end)
    facts = OomFacts(
        kind="xla",
        category="xla_resource_exhausted",
        exception=_exception(span),
        device_type="tpu" if _TPU.search(window, stats_start, span.end) else "gpu",
        # "Limit: 0" is the async allocator's "no limit set".
        allowed_bytes=int(limit[1]) if limit and int(limit[1]) else None,
        allocated_bytes=int(in_use[1]) if in_use else None,
        message=span.snippet,
    )
    if header is _REQUEST:
        facts.requested_bytes = size_of(match)
        facts.device_index = int(match["ordinal"]) if match["ordinal"] else None
    elif match["bytes"]:
        facts.requested_bytes = int(match["bytes"])
    else:
        facts.requested_bytes = size_of(match)
    if header is _ASYNC:
        facts.device_type = "gpu"
        figures = _ASYNC_FREE_TOTAL.search(window, span.start, span.end)
        if figures:
            facts.free_bytes, facts.total_bytes = int(figures["free"]), int(figures["total"])
    return facts


def _tpu_space(span: Span) -> OomFacts:
    return OomFacts(
        kind="xla",
        category="xla_tpu_memory_space_exhausted",
        exception=_exception(span),
        device_type="tpu",
        requested_bytes=span.size(_TPU_USED),
        total_bytes=span.size(_TPU_CAPACITY),
        padding_bytes=span.size(_PADDING),
        phase="compile",
        message=span.snippet,
    )


def _tpu_not_possible(span: Span) -> OomFacts:
    return OomFacts(
        kind="xla",
        category="xla_tpu_allocation_not_possible",
        exception=_exception(span),
        device_type="tpu",
        requested_bytes=span.size(_TPU_WANTED),
        free_bytes=span.size(_TPU_FREE),
        total_bytes=span.size(_HBM_CAPACITY),
        message=span.snippet,
    )
