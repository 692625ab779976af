"""Hugging Face Accelerate's batch-size search gave up: even one sample does not fit.

``accelerate.utils.find_executable_batch_size`` runs the training function, and on each
out-of-memory error halves the batch size and tries again. When it reaches zero it raises
``RuntimeError: No executable batch size found, reached zero.``: every size down to 1 ran
out of memory, so the batch is not what is too large. The model (weights, gradients,
optimizer state) or one sample's activations are, or other processes hold the card.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

CATEGORY = "accelerate_no_executable_batch_size"
_HEADER = re.compile(r"No\s+executable\s+batch\s+size\s+found(?:,\s+reached\s+zero)?")


def find(window: str) -> list[Found]:
    """The first give-up of the batch-size search in ``window`` (it raises once)."""
    for span in spans(window, _HEADER, limit=200)[:1]:
        facts = OomFacts(
            kind="pytorch_allocator",
            category=CATEGORY,
            exception=exception_before(window, span.start),
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []
