"""vLLM start-up failures: the KV cache does not fit in the memory vLLM may use.

vLLM profiles the model, then reserves ``gpu_memory_utilization`` x total memory minus
what the weights and activations took for its KV cache, and refuses to start when
that cache cannot hold one sequence of ``max_model_len`` tokens:

* V0: ``The model's max seq len (4096) is larger than the maximum number of tokens that
  can be stored in KV cache (3664).`` and ``No available memory for the cache blocks.``
* V1: ``To serve at least one request with the model's max seq len (131072), (16.00 GiB
  KV cache is needed, which is larger than the available KV cache memory (0.71 GiB).
  Based on the available memory, the estimated maximum model length is 5632.``; later
  versions drop the stray ``(`` before the needed size and end with ``Estimated maximum
  model length is 57344.``
* ``CUDA out of memory occurred when warming up sampler with 1024 dummy requests.``
  (what is left after the KV reservation is too small for ``max_num_seqs``).
* 0.9+: ``Free memory on device cuda:1 (19.77/22.05 GiB) on startup is less than desired
  GPU memory utilization (0.9, 19.84 GiB).`` Something else holds the card, or the
  utilization asks for more than is free.

The text rarely names the device type (vLLM runs on CUDA, ROCm, TPU and XPU alike), so
``device_type`` is left ``None`` unless the start-up check names the device.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, compile_clause, exception_before, spans
from gpuwatch.doctor.units import size_to_bytes

_MAX_LEN_V0 = re.compile(
    r"The\s+model's\s+max\s+seq\s+len\s+\((?P<len>\d+)\)\s+is\s+larger\s+than\s+the\s+maximum"
    r"\s+number\s+of\s+tokens\s+that\s+can\s+be\s+stored\s+in\s+KV\s+cache\s+\((?P<tokens>\d+)\)"
)
_NO_CACHE_BLOCKS = re.compile(r"No\s+available\s+memory\s+for\s+the\s+cache\s+blocks")
_V1 = re.compile(
    r"To\s+serve\s+at\s+least\s+one\s+request\s+with\s+the\s+models?'s\s+max\s+seq\s+len"
    r"\s+\((?P<len>\d+)\)"
)
# The needed size with vLLM's stray parenthesis before it, "(16.00 GiB KV cache is
# needed", or without it since vLLM fixed that, "3.09 GiB KV cache is needed".
_V1_NEEDED = compile_clause(r"(?:\(\s*)?", r"\s+KV\s+cache\s+is\s+needed")
_V1_AVAILABLE = compile_clause(r"available\s+KV\s+cache\s+memory\s+\(\s*", r"\s*\)")
# "the estimated maximum model length is 5632" within a sentence, or a sentence of its own
# in later versions: "Estimated maximum model length is 57344." (digits may be grouped).
_V1_ESTIMATE = re.compile(r"estimated\s+maximum\s+model\s+length\s+is\s+(\d[\d,]*)", re.IGNORECASE)
# The same refusal quoted without its head ("To serve at least one request ..."): the
# needed size starts it.
_V1_HEADLESS = compile_clause(
    r"(?<![\w.(])", r"\s+KV\s+cache\s+is\s+needed,?\s+which\s+is\s+larger\s+than\s+the\s+available"
)
V1_HEAD_LOOKBACK_CHARS = 300
_SAMPLER = re.compile(
    r"CUDA\s+out\s+of\s+memory\s+occurred\s+when\s+warming\s+up\s+sampler\s+with\s+(?P<n>\d+)"
    r"\s+dummy\s+requests"
)


_STARTUP_FREE = re.compile(
    r"Free\s+memory\s+on\s+device(?:\s+(?P<type>[a-z]+):(?P<index>\d+))?\s+"
    r"\((?P<free>\d+(?:\.\d+)?)/(?P<total>\d+(?:\.\d+)?)\s+(?P<unit>[KMG]iB)\)\s+on\s+startup\s+"
    r"is\s+less\s+than\s+desired\s+GPU\s+memory\s+utilization\s+\((?P<ratio>\d*\.?\d+),\s+"
    r"(?P<want>\d+(?:\.\d+)?)\s+(?P=unit)\)"
)


def find(window: str) -> list[Found]:
    """Every vLLM KV-cache start-up failure in ``window``."""
    found = []
    for span in spans(window, _MAX_LEN_V0, limit=600):
        match = _MAX_LEN_V0.match(window, span.start)
        assert match is not None
        facts = _facts(window, span.start, "vllm_max_model_len_exceeds_kv_cache", span.snippet)
        facts.max_model_len = int(match["len"])
        facts.kv_cache_tokens = int(match["tokens"])
        found.append(Found(span.start, facts))
    for span in spans(window, _NO_CACHE_BLOCKS, limit=400):
        found.append(
            Found(span.start, _facts(window, span.start, "vllm_no_kv_cache_memory", span.snippet))
        )
    for span in spans(window, _V1, limit=1000):
        match = _V1.match(window, span.start)
        assert match is not None
        facts = _facts(window, span.start, "vllm_v1_kv_cache_insufficient", span.snippet)
        facts.max_model_len = int(match["len"])
        facts.kv_cache_needed_bytes = span.size(_V1_NEEDED)
        facts.kv_cache_available_bytes = span.size(_V1_AVAILABLE)
        facts.estimated_max_model_len = span.integer(_V1_ESTIMATE)
        found.append(Found(span.start, facts))
    for span in spans(window, _V1_HEADLESS, limit=600):
        if _V1.search(window, max(0, span.start - V1_HEAD_LOOKBACK_CHARS), span.start):
            continue  # the sentence's head is there: read above
        facts = _facts(window, span.start, "vllm_v1_kv_cache_insufficient", span.snippet)
        facts.kv_cache_needed_bytes = span.size(_V1_NEEDED)
        facts.kv_cache_available_bytes = span.size(_V1_AVAILABLE)
        facts.estimated_max_model_len = span.integer(_V1_ESTIMATE)
        found.append(Found(span.start, facts))
    for span in spans(window, _SAMPLER, limit=400):
        match = _SAMPLER.match(window, span.start)
        assert match is not None
        facts = _facts(window, span.start, "vllm_sampler_warmup_oom", span.snippet)
        facts.dummy_requests = int(match["n"])
        found.append(Found(span.start, facts))
    for span in spans(window, _STARTUP_FREE, limit=400):
        match = _STARTUP_FREE.match(window, span.start)
        assert match is not None
        facts = _facts(window, span.start, "vllm_startup_free_memory_low", span.snippet)
        unit = match["unit"]
        facts.free_bytes = size_to_bytes(match["free"], unit)
        facts.total_bytes = size_to_bytes(match["total"], unit)
        facts.allowed_bytes = size_to_bytes(match["want"], unit)  # ratio x total
        if match["index"]:
            facts.device_type, facts.device_index = match["type"], int(match["index"])
        found.append(Found(span.start, facts))
    return found


def _facts(window: str, start: int, category: str, message: str) -> OomFacts:
    return OomFacts(
        kind="vllm_kv_cache",
        category=category,
        exception=exception_before(window, start),
        message=message,
    )
