"""Diagnoses follow the numbers: which fix comes first, and the evidence it cites."""

from __future__ import annotations

import pytest

from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.report import render

GUIDE_EXAMPLE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process "
    "has 22.51 GiB memory in use. Of the allocated memory 20.87 GiB is allocated by PyTorch, and "
    "1.19 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
OLD_FRAGMENTED = (
    "RuntimeError: CUDA out of memory. Tried to allocate 16.00 GiB (GPU 0; 47.54 GiB total "
    "capacity; 23.76 GiB already allocated; 6.30 GiB free; 39.59 GiB reserved in total by PyTorch)"
)
NEIGHBOURS = (
    "CUDA out of memory. Tried to allocate 136.00 MiB. GPU 0 has a total capacity of 44.53 GiB of "
    "which 32.62 MiB is free. Process 899595 has 14.52 GiB memory in use. Process 1039101 has "
    "28.00 GiB memory in use. Process 795316 has 2.02 GiB memory in use. Of the allocated memory "
    "1.50 GiB is allocated by PyTorch, and 167.00 MiB is reserved by PyTorch but unallocated."
)


def fixes(text: str, **kwargs: object) -> list[str]:
    return [d.fix for d in explain(text, **kwargs).diagnoses]  # type: ignore[arg-type]


def test_own_working_set_first_for_the_guide_example() -> None:
    explanation = explain(GUIDE_EXAMPLE)
    assert explanation.diagnoses[0].fix == "reduce_activations"
    assert "20.87 GiB (88% of the card)" in explanation.diagnoses[0].evidence
    assert explanation.device == "cuda:0"
    assert explanation.process_in_use_bytes == 24_169_928_458  # 22.51 GiB


def test_fragmentation_first_when_the_cache_could_serve_the_request() -> None:
    explanation = explain(OLD_FRAGMENTED)
    first = explanation.diagnoses[0]
    assert first.fix == "fragmentation"
    assert "15.83 GiB reserved but unallocated" in first.evidence
    # Pre-2.1 wording: no expandable segments in that PyTorch.
    assert first.commands[0].startswith("export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:")
    assert (
        explanation.reserved_unallocated_bytes
        == explanation.reserved_bytes - explanation.allocated_bytes
    )  # type: ignore[operator]


def test_neighbours_first_and_own_host_pid_not_blamed() -> None:
    explanation = explain(NEIGHBOURS)
    assert explanation.diagnoses[0].fix == "other_processes"
    me = [p for p in explanation.other_processes if p.probably_this_process]
    assert [p.pid for p in me] == [795316]
    commands = explanation.diagnoses[0].commands
    assert any(c.startswith("kill 1039101") for c in commands)
    assert not any(c.startswith("kill 795316") for c in commands)


def test_growth_history_adds_memory_held_across_steps() -> None:
    gib = 2**30
    growth = [10 * gib, 12 * gib, 14 * gib, 16 * gib, 18 * gib, 20 * gib]
    assert "memory_held_across_steps" in fixes(GUIDE_EXAMPLE, growth=growth)
    assert "memory_held_across_steps" not in fixes(GUIDE_EXAMPLE, growth=[20 * gib] * 6)
    sawtooth = [10 * gib, 20 * gib, 10 * gib, 20 * gib, 10 * gib, 21 * gib]
    assert "memory_held_across_steps" not in fixes(GUIDE_EXAMPLE, growth=sawtooth)


def test_weights_too_large_while_loading() -> None:
    text = (
        'File "modeling_utils.py", line 4216, in _load_pretrained_model\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.49 GiB. GPU 0 has a total "
        "capacity of 15.47 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this "
        "process has 14.20 GiB memory in use. Of the allocated memory 13.90 GiB is allocated by "
        "PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
    )
    explanation = explain(text)
    assert explanation.diagnoses[0].fix == "model_too_large"
    assert any(c.startswith("gpuwatch fit --params") for c in explanation.diagnoses[0].commands)


@pytest.mark.parametrize(
    ("text", "command"),
    [
        (
            "ValueError: The model's max seq len (4096) is larger than the maximum number of tokens "
            "that can be stored in KV cache (3664).",
            "vllm serve MODEL --max-model-len 3664   # what the cache holds now",
        ),
        (
            "RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy requests.",
            "vllm serve MODEL --max-num-seqs 256",
        ),
    ],
)
def test_vllm_kv_cache(text: str, command: str) -> None:
    explanation = explain(text)
    assert explanation.kind == "vllm_kv_cache"
    assert explanation.diagnoses[0].fix == "kv_cache"
    assert command in explanation.diagnoses[0].commands


def test_nvml_sentinels_become_unknown_with_a_note() -> None:
    text = (
        "CUDA out of memory. Tried to allocate 3.98 GiB. GPU 0 has a total capacity of 31.84 GiB of "
        "which 16.30 GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB "
        "memory in use. Of the allocated memory 6.74 GiB is allocated by PyTorch, and 7.02 GiB is "
        "reserved by PyTorch but unallocated."
    )
    explanation = explain(text)
    assert explanation.process_in_use_bytes is None
    assert explanation.printed is not None and explanation.printed.process_in_use_bytes == 2**64
    assert any("2^64" in note for note in explanation.notes)


def test_sizeless_messages_still_say_where_and_what_to_run() -> None:
    explanation = explain(
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    )
    assert explanation.kind == "cublas"
    assert explanation.diagnoses[-1].fix == "unknown"
    assert "gpuwatch status" in explanation.diagnoses[-1].commands


def test_human_report_is_concise_with_evidence_and_commands() -> None:
    text = render(explain(GUIDE_EXAMPLE))
    assert (
        text.splitlines()[0]
        == "Out of memory on cuda:0: PyTorch CUDA allocator (torch.OutOfMemoryError)"
    )
    assert "evidence:" in text
    assert (
        "$ export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" not in text
    )  # 1.19 GiB < 2 GiB ask
    assert len(text.splitlines()) < 30


def test_a_request_beyond_any_device_is_a_corrupt_size_not_a_shortage() -> None:
    # A printed number over 1 EiB is an overflowed or negative size: no fix about memory
    # applies, and it is not compared with the card.
    explanation = explain(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "99999999999999999999999999.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which "
        "20.00 MiB is free."
    )
    assert explanation.category == "pytorch_caching_allocator_oom_absurd_size"
    assert explanation.requested_bytes is None
    assert [d.fix for d in explanation.diagnoses] == ["unknown"]
    assert "corrupt" in explanation.diagnoses[0].evidence
    assert any("over 1 EiB" in note for note in explanation.notes)
