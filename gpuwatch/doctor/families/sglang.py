"""SGLang: its KV-cache pool (sized at start-up by ``--mem-fraction-static``) did not fit.

SGLang takes ``mem_fraction_static`` of the GPU for the weights and a pool of KV-cache
slots, profiles what is left after loading the weights, and refuses to start when no
slot fits: ``RuntimeError: Not enough memory. Please try to increase
--mem-fraction-static.`` (newer releases add ``Current value: mem_fraction_static=0.84``).
Raising the fraction gives the pool more of the card; the rest is left for activations
and CUDA graphs, which is why the documented fix for an out-of-memory *while serving* is
the opposite, a lower fraction.

While serving, a batch whose tokens find no free slot: ``Prefill out of memory. Try to
lower your batch size.`` (and ``Decode out of memory``) then ``Try to allocate N tokens.``.
Its ``Decode out of memory happened`` warning, after which requests are retracted and the
server goes on, is not a failure and is not read.

SGLang runs on several vendors' GPUs, so the device type is left unknown: kind ``device``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_STARTUP = re.compile(
    r"Not\s+enough\s+memory[.,]?\s+(?P<advice>(?:Please\s+)?try\s+to\s+increase\s+--?mem[-_]fraction[-_]static)"
)
_SERVING = re.compile(
    r"\b(?P<phase>Prefill|Decode)\s+out\s+of\s+memory[.,]\s+(?P<advice>Try\s+to\s+lower\s+your\s+batch\s+size)"
)
_FRACTION = re.compile(r"mem_fraction_static\s*=\s*(?P<fraction>[\d.]+)")


def find(window: str) -> list[Found]:
    """Every SGLang KV-pool refusal in ``window``."""
    found = []
    for span in spans(window, _STARTUP, limit=300, needs=("fraction",)):
        match = _STARTUP.match(window, span.start)
        assert match is not None
        fraction = _FRACTION.search(window, span.start, span.end)
        advice = match["advice"] + (f" (now {fraction['fraction']})" if fraction else "")
        facts = OomFacts(
            kind="device",
            category="sglang_kv_pool_does_not_fit",
            exception=exception_before(window, span.start),
            advice=advice,
            phase="start-up",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    for span in spans(window, _SERVING, limit=300, needs=("prefill", "decode")):
        match = _SERVING.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="device",
            category="sglang_kv_pool_exhausted",
            exception=exception_before(window, span.start),
            advice=match["advice"],
            phase=match["phase"].lower(),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
