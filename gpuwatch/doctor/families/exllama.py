"""ExLlamaV2's loader: the model and its cache do not fit the GPUs it may use.

ExLlamaV2 (text-generation-webui's ExLlamav2 loader, TabbyAPI) places the layers itself
before any allocation fails, and says so in its own words:

* ``Insufficient VRAM for model and cache``: the automatic split (``load_autosplit``)
  filled every GPU and the weights plus the KV cache for ``max_seq_len`` still did not fit.
  ExLlamaV3 (TabbyAPI) words it ``Insufficient VRAM in split for model and cache``: a few
  words inside the phrase are read as the same refusal.
* ``Insufficient space in device allocation``: a manual ``gpu_split`` gave the GPUs less
  than the layers need.

Neither prints figures: the fix is the model's footprint (a lower bits-per-weight
quantisation), the cache's (a shorter context, a quantised cache), or the split.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

# A few words may sit inside the fixed phrase: ExLlamaV3 says "Insufficient VRAM in split
# for model and cache".
_HEADER = re.compile(
    r"Insufficient\s+VRAM\s+(?:[\w-]+\s+){0,3}?for\s+model\s+and\s+cache"
    r"|(?P<split>Insufficient\s+space\s+in\s+device\s+allocation)"
)


def find(window: str) -> list[Found]:
    """The first ExLlamaV2 refusal in ``window`` (it raises once, then stops)."""
    found = []
    for span in spans(window, _HEADER, limit=300)[:1]:
        header = _HEADER.match(window, span.start)
        assert header is not None
        facts = OomFacts(
            kind="exllama",
            category="exllama_split_too_small" if header["split"] else "exllama_autosplit_full",
            exception=exception_before(window, span.start),
            phase="model load",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
