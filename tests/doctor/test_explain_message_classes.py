"""explain on the message alone: a printed per-process cap, terminal colour and log
prefixes, a partial process list, two processes of one size, fragmentation that cannot
serve the request, later OOM messages, and near misses and wordings at the edges."""

from __future__ import annotations

import pytest

from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.parse import parse_oom
from gpuwatch.doctor.report import render
from gpuwatch.errors import NotRecognized

GIB = 2**30
MIB = 2**20


@pytest.mark.parametrize(
    "text",
    [
        # 2.x sentences with "allowed".
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 1 has a "
        "total capacity of 79.15 GiB of which 50.00 GiB is free. 20.00 GiB allowed; Of the "
        "allocated memory 17.60 GiB is allocated by PyTorch, and 1.40 GiB is reserved by "
        "PyTorch but unallocated.",
        # 1.x parentheses.
        "RuntimeError: CUDA out of memory. Tried to allocate 3.00 GiB (GPU 1; 79.15 GiB total "
        "capacity; 17.60 GiB already allocated; 50.00 GiB free; 20.00 GiB allowed; 19.00 GiB "
        "reserved in total by PyTorch)",
    ],
)
def test_a_printed_cap_that_refused_the_request_is_the_diagnosis(text: str) -> None:
    explanation = explain(text)
    first = explanation.diagnoses[0]
    assert first.fix == "memory_limit"
    assert "20.00 GiB" in first.evidence and "22.00 GiB" in first.evidence
    # (19 + 3) / 79.15 = 0.278: the fraction that would have let it through.
    assert any("set_per_process_memory_fraction(0.28)" in c for c in first.commands)
    assert all("Virtual memory" not in c for d in explanation.diagnoses for c in d.commands)
    assert not any("was at least the request" in n for n in explanation.notes)


def test_a_cap_with_room_left_is_not_blamed() -> None:
    text = (
        "RuntimeError: CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 23.69 GiB total "
        "capacity; 20.00 GiB already allocated; 300.00 MiB free; 23.00 GiB allowed; 20.50 GiB "
        "reserved in total by PyTorch)"
    )
    assert "memory_limit" not in [d.fix for d in explain(text).diagnoses]


def test_terminal_colour_anywhere_is_removed_before_reading() -> None:
    text = (
        "\x1b[1;31mtorch.OutOfMemoryError\x1b[0m: \x1b[31mCUDA out of memory. Tried to allocate "
        "\x1b[1m512.00 MiB\x1b[22m. GPU 0 has a total capacity of \x1b[33m15.77 GiB\x1b[0m of which "
        "\x1b[33m20.00 MiB\x1b[0m is free. Including non-PyTorch memory, this process has 15.70 "
        "GiB memory in use. Of the allocated memory 13.00 GiB is allocated by PyTorch, and 2.10 "
        "GiB is reserved by PyTorch but unallocated.\x1b]8;;https://x.invalid\x07link\x1b]8;;\x07"
    )
    facts = parse_oom(text)
    assert facts.exception == "torch.OutOfMemoryError"
    assert (facts.requested_bytes, facts.free_bytes) == (512 * MIB, 20 * MIB)
    assert "\x1b" not in facts.message


@pytest.mark.parametrize(
    "prefix",
    [
        "Jun  3 04:05:06 trainer-07 python3[991]: ",  # syslog / journald
        "2025-06-03T04:05:06+0200 trainer-07 python3[991]: ",  # journalctl -o short-iso
        "2025-06-03T04:05:06.987654321Z stdout F ",  # Kubernetes CRI log file
    ],
)
def test_log_prefixes_on_every_wrapped_line_are_stripped(prefix: str) -> None:
    lines = [
        "RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 1; 15.78 GiB",
        "total capacity; 10.00 GiB already allocated; 400.00 MiB free; 14.00 GiB reserved",
        "in total by PyTorch)",
    ]
    facts = parse_oom("\n".join(prefix + line for line in lines))
    assert facts.total_bytes is not None and facts.total_bytes > 15 * GIB
    assert facts.reserved_bytes == 14 * GIB and facts.device_index == 1


def test_memory_the_process_list_leaves_out_still_counts_as_others() -> None:
    # 69.5 GiB in use beyond this process's 8 GiB, only 6 GiB of it listed.
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 1.65 GiB is free. Process 4444 has 6.00 GiB "
        "memory in use. Including non-PyTorch memory, this process has 8.00 GiB memory in use. "
        "Of the allocated memory 7.00 GiB is allocated by PyTorch, and 200.00 MiB is reserved "
        "by PyTorch but unallocated."
    )
    explanation = explain(text)
    others = explanation.other_processes_bytes
    assert others is not None and abs(others - 69.5 * GIB) < MIB  # not the 6 GiB listed
    assert explanation.diagnoses[0].fix == "other_processes"
    assert "about 69.50 GiB" in explanation.diagnoses[0].evidence
    assert any("63.50 GiB of the card is held by processes the message does not list" in n
               for n in explanation.notes)  # fmt: skip


def test_two_processes_of_this_process_size_are_both_kept_from_kill() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 1.60 GiB is free. Process 3100 has 11.00 GiB "
        "memory in use. Process 3200 has 11.02 GiB memory in use. Of the allocated memory "
        "10.00 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but "
        "unallocated."
    )
    explanation = explain(text)
    assert [p.probably_this_process for p in explanation.other_processes] == [True, True]
    commands = [c for d in explanation.diagnoses for c in d.commands]
    assert not any(c.startswith("kill ") for c in commands)
    assert any("Process 3100 or Process 3200" in n for n in explanation.notes)


def test_fragmentation_too_small_for_the_request_says_it_is_not_enough_alone() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a "
        "total capacity of 11.72 GiB of which 50.00 MiB is free. Including non-PyTorch memory, "
        "this process has 11.60 GiB memory in use. Of the allocated memory 8.00 GiB is "
        "allocated by PyTorch, and 2.90 GiB is reserved by PyTorch but unallocated. If "
        "reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    fragmentation = next(d for d in explain(text).diagnoses if d.fix == "fragmentation")
    assert "not enough alone" in fragmentation.summary
    assert "would not have served it" in fragmentation.evidence
    # The wording names expandable_segments, so it is PyTorch >= 2.1: no line for older.
    assert not any("PyTorch < 2.1" in c for c in fragmentation.commands)


def test_later_oom_messages_are_named_in_the_report() -> None:
    text = (
        "RuntimeError: CUDA out of memory. Tried to allocate 4.00 GiB (GPU 0; 15.78 GiB total "
        "capacity; 12.00 GiB already allocated; 1.00 GiB free; 13.00 GiB reserved in total by "
        "PyTorch)\nbatch 16 did not fit, trying 8\n"
        + "x\n" * 30
        + "NCCL WARN Cuda failure 'out of memory'\nhost9:77:78 [5] NCCL INFO done\n"
    )
    report = render(explain(text))
    assert "1 more OOM message later in the text" in report
    assert "NCCL" in report.split("more OOM message")[1]


@pytest.mark.parametrize(
    "text",
    [
        "torch.cuda.OutOfMemoryError gets raised whenever the caching allocator cannot find a block.",
        "torch.OutOfMemoryError will be thrown if the batch is too large; catch it and retry.",
        "[INFO] CUDA out of memory at batch 64, retrying with batch 32",
        "DEBUG falling back to CPU after HIP out of memory",
    ],
)
def test_prose_about_the_type_and_handled_oom_logs_are_not_oom_messages(text: str) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(text)


def test_an_unhandled_oom_line_is_still_read() -> None:
    assert parse_oom("ERROR CUDA out of memory at batch 64").kind == "pytorch_allocator"


def test_accelerate_giving_up_on_every_batch_size_means_nothing_fits() -> None:
    text = (
        "  raise RuntimeError('...')\nRuntimeError: No executable batch size found, reached zero."
    )
    explanation = explain(text)
    assert explanation.category == "accelerate_no_executable_batch_size"
    assert explanation.diagnoses[0].fix == "model_too_large"
    assert "Accelerate" in render(explanation).splitlines()[0]


def test_vllm_kv_cache_refusal_quoted_without_its_head_is_read() -> None:
    text = (
        "ValueError: 6.50 GiB KV cache is needed, which is larger than the available KV cache "
        "memory (1.75 GiB). Try increasing `gpu_memory_utilization`."
    )
    facts = parse_oom(text)
    assert facts.kind == "vllm_kv_cache"
    assert (facts.kv_cache_needed_bytes, facts.kv_cache_available_bytes) == (
        int(6.5 * GIB),
        int(1.75 * GIB),
    )
