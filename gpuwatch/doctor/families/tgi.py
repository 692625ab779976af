"""Hugging Face Text Generation Inference (TGI): its warm-up found too little memory.

At start-up TGI runs the largest prefill its settings allow, so that an out-of-memory
happens then rather than under load, and refuses to start when it fails: ``Not enough
memory to handle 4096 prefill tokens. You need to decrease `--max-batch-prefill-tokens```
(inside ``Error: Warmup(Generation("..."))`` or the router's ``ERROR warmup{...}`` line).
Its releases that also size the batch's KV cache say which total failed: ``Not enough memory
to handle 16000 total tokens with 2 prefill tokens. You need to decrease
`--max-batch-total-tokens` or `--max-batch-prefill-tokens``` (read into ``kv_cache_tokens``:
the tokens the batch's KV cache was to hold).
An allocator message during warm-up (``Allocation on device 0 would exceed allowed
memory``) is PyTorch's, read by :mod:`~gpuwatch.doctor.families.pytorch`.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, spans

_HEADER = re.compile(
    r"Not\s+enough\s+memory\s+to\s+handle\s+(?:(?P<total>\d+)\s+total\s+tokens\s+with\s+)?"
    r"(?P<tokens>\d+)\s+prefill\s+tokens"
)


def find(window: str) -> list[Found]:
    """Every TGI warm-up refusal in ``window``."""
    found = []
    for span in spans(window, _HEADER, limit=400):
        header = _HEADER.match(window, span.start)
        assert header is not None
        facts = OomFacts(
            kind="tgi",
            category="tgi_warmup_total_tokens" if header["total"] else "tgi_warmup_prefill_tokens",
            prefill_tokens=int(header["tokens"]),
            kv_cache_tokens=int(header["total"]) if header["total"] else None,
            phase="warm-up",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
