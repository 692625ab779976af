"""Every real OOM message in the corpus: the parser must extract every number it prints.

The corpus (``fixtures/oom-messages.jsonl``, a copy of shared/oom-samples) records for
each message what a parser should pull out. This test maps each of its keys to an
:class:`OomFacts` field and compares them all; a key with no mapping fails the test,
so a new corpus field cannot be skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.parse import parse_oom

CORPUS = Path(__file__).parent / "fixtures" / "oom-messages.jsonl"
ENTRIES = [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line]

# corpus key -> OomFacts field (numbers and the identifying strings).
FIELD_FOR_KEY = {
    "requested_bytes": "requested_bytes",
    "nccl_calloc_bytes": "requested_bytes",
    "total_bytes": "total_bytes",
    "device_limit_bytes": "total_bytes",
    "free_bytes": "free_bytes",
    "this_process_in_use_bytes": "process_in_use_bytes",
    "allocated_by_framework_bytes": "allocated_bytes",
    "already_allocated_bytes": "allocated_bytes",
    "currently_allocated_bytes": "allocated_bytes",
    "mps_allocated_bytes": "allocated_bytes",
    "pool_allocated_bytes": "allocated_bytes",
    "bfc_in_use_bytes": "allocated_bytes",
    "reserved_total_bytes": "reserved_bytes",
    "pool_total_bytes": "reserved_bytes",
    "reserved_unallocated_bytes": "reserved_unallocated_bytes",
    "cached_bytes": "reserved_unallocated_bytes",
    "allowed_bytes": "allowed_bytes",
    "pytorch_limit_bytes": "allowed_bytes",
    "max_allowed_bytes": "allowed_bytes",
    "bfc_limit_bytes": "allowed_bytes",
    "private_pools_bytes": "private_pools_bytes",
    "other_allocations_bytes": "other_allocations_bytes",
    "kv_cache_needed_bytes": "kv_cache_needed_bytes",
    "kv_cache_available_bytes": "kv_cache_available_bytes",
    "max_seq_len": "max_model_len",
    "kv_cache_tokens": "kv_cache_tokens",
    "estimated_max_model_len": "estimated_max_model_len",
    "dummy_requests": "dummy_requests",
    "workspace_required_bytes": "workspace_required_bytes",
    "workspace_given_bytes": "workspace_given_bytes",
    "gpu_index": "device_index",
    "device_ordinal": "device_index",
    "local_gpu": "device_index",
    "pid": "pid",
    "cuda_error_code": "cuda_error_code",
    "source_line": "source_line",
    "category": "category",
    "exception": "exception",
    "device_type": "device_type",
    "library_status": "library_status",
    "advice": "advice",
    "alloc_conf_var": "alloc_conf_var",
}
# Keys that hold the printed strings behind the *_bytes numbers, or descriptive notes.
DESCRIPTIVE_KEYS = {
    "requested", "total", "free", "this_process_in_use", "allocated_by_framework",
    "already_allocated", "currently_allocated", "mps_allocated", "pool_allocated",
    "reserved_total", "pool_total", "reserved_unallocated", "cached", "allowed",
    "pytorch_limit", "max_allowed", "private_pools", "other_allocations", "device_limit",
    "kv_cache_needed", "kv_cache_available", "flags", "notes", "pool", "buffer", "phase",
    "tensor_shape", "dtype", "tf_device", "allocator", "node", "op", "host", "api_call",
    "cuda_error", "cuda_error_string", "source_file", "source_location", "xla_kind",
    "total_allocation", "preallocated_temp", "fragmentation",
}  # fmt: skip
# vLLM never names its device in these messages (the corpus took it from the issue).
DEVICE_TYPE_NOT_IN_TEXT = {"vllm_kv_cache"}


def _expected_pairs(expected: dict[str, Any], facts: OomFacts) -> list[tuple[str, Any, Any]]:
    pairs = []
    for key, want in expected.items():
        if key in DESCRIPTIVE_KEYS or key in ("other_processes", "attempts", "bfc_warning"):
            continue
        if key == "additional_messages":
            continue
        assert key in FIELD_FOR_KEY, f"corpus key {key!r} has no OomFacts field"
        if key == "device_type" and facts.kind in DEVICE_TYPE_NOT_IN_TEXT:
            continue
        pairs.append((key, want, getattr(facts, FIELD_FOR_KEY[key])))
    return pairs


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
def test_extracts_every_expected_value(entry: dict[str, Any]) -> None:
    facts = parse_oom(entry["text"])
    expected = entry["expected"]
    for key, want, got in _expected_pairs(expected, facts):
        assert got == want, f"{key}: expected {want!r}, got {got!r}"
    if "other_processes" in expected:
        want_procs = [(p["pid"], p["in_use_bytes"]) for p in expected["other_processes"]]
        assert [(p.pid, p.used_bytes) for p in facts.other_processes] == want_procs
    if "attempts" in expected:
        assert facts.attempts_bytes == [a["requested_bytes"] for a in expected["attempts"]]
    if "bfc_warning" in expected:
        assert facts.nonfatal_requests_bytes == [expected["bfc_warning"]["requested_bytes"]]
    extra = expected.get("additional_messages", [])
    assert len(facts.additional_messages) == len(extra)
    for want_more, got_more in zip(extra, facts.additional_messages, strict=True):
        for key, want, got in _expected_pairs(want_more, got_more):
            assert got == want, f"additional {key}: expected {want!r}, got {got!r}"


def test_corpus_is_the_whole_sample() -> None:
    # A guard against an accidentally truncated fixture copy.
    assert len(ENTRIES) >= 110
