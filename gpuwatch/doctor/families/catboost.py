"""CatBoost's GPU trainer: its memory pool's refusal, and its tree-ctr estimate.

CatBoost takes a share of the GPU's free memory when training starts (``gpu_ram_part``,
0.95 by default) and serves every allocation from that pool; what it reports is the
pool, not the card. Wordings (``catboost/cuda``), with sizes in MB that are MiB:

* ``(NCudaLib::TOutOfMemoryError) .../stack_like_memory_pool.h:303: Error: Out of
  memory. Requested 8880 MB; Free 5902.061425 MB`` (before 2019 without the units:
  ``Requested 17476.96875; Free 2255.542871``).
* ``.../tree_ctr_memory_usage_estimator.h:133: Error: not enough memory for tree-ctrs:
  2666.668652 available, need at least 4902.937321``.
* The exception's name alone (``NCudaLib::TOutOfMemoryError``), where the figures were
  not pasted.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, Span, spans

MIB = 1024**2
_NUMBER = r"\d+(?:\.\d+)?"
_POOL = re.compile(
    rf"Out\s+of\s+memory\.\s+Requested\s+(?P<requested>{_NUMBER})(?:\s*MB)?\s*;"
    rf"\s*Free\s+(?P<free>{_NUMBER})"
)
_CTRS = re.compile(
    rf"not\s+enough\s+memory\s+for\s+[\w-]+:\s*(?P<free>{_NUMBER})\s+available,"
    rf"\s+need\s+at\s+least\s+(?P<requested>{_NUMBER})"
)
_NAMED = re.compile(r"NCudaLib::TOutOfMemoryError")
_LOCATION = re.compile(r"\b(\w+\.h):(\d+):\s*Error:\s*$")


def find(window: str) -> list[Found]:
    """Every CatBoost out-of-memory report in ``window``; the exception's name alone only
    where no report with figures is there."""
    found = [
        Found(span.start, _facts(span, pattern, category))
        for pattern, category in ((_POOL, "catboost_pool_exhausted"), (_CTRS, "catboost_tree_ctrs"))
        for span in spans(window, pattern, limit=600)
    ]
    if found:
        return found
    return [
        Found(
            span.start,
            OomFacts(
                kind="catboost",
                category="catboost_pool_exhausted",
                exception="NCudaLib::TOutOfMemoryError",
                device_type="cuda",
                message=span.snippet,
            ),
        )
        for span in spans(window, _NAMED, limit=300)
    ]


def _facts(span: Span, pattern: re.Pattern[str], category: str) -> OomFacts:
    match = pattern.match(span.text, span.start)
    assert match is not None
    location = _LOCATION.search(span.text, span.line_lookback, span.start)
    return OomFacts(
        kind="catboost",
        category=category,
        exception="NCudaLib::TOutOfMemoryError" if category == "catboost_pool_exhausted" else None,
        device_type="cuda",
        requested_bytes=round(float(match["requested"]) * MIB),
        free_bytes=round(float(match["free"]) * MIB),
        source_location=f"{location[1]}:{location[2]}" if location else None,
        message=span.snippet,
    )
