"""Bad input: random text, truncation, CRLF, wrapping, non-UTF-8, a 10 MB log, non-OOM logs.

The parser must never raise anything but NotRecognized, must stay fast (every pattern
is linear and only bounded windows are scanned), and must extract nothing from logs
that merely talk about memory.

Time bounds are on the parse's own CPU time (``process_time``): tests run side by side
(``./dev test`` runs a worker per core) take the machine's cores, not this process's CPU.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.doctor.parse import parse_oom
from gpuwatch.doctor.units import format_size, parse_size
from gpuwatch.errors import NotRecognized

FIXTURES = Path(__file__).parent / "fixtures"
NON_OOM_LOGS = sorted((FIXTURES / "non-oom").glob("*.log"))
CORPUS = [json.loads(line) for line in (FIXTURES / "oom-messages.jsonl").read_text().splitlines()]
MESSAGE = next(e["text"] for e in CORPUS if e["id"] == "pt2-new-005")
FAST = settings(max_examples=60, deadline=1000)


def parse_or_none(text: str) -> object:
    try:
        return parse_oom(text)
    except NotRecognized:
        return None


@pytest.mark.parametrize("path", NON_OOM_LOGS, ids=[p.name for p in NON_OOM_LOGS])
def test_non_oom_logs_are_not_recognised(path: Path) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        # A C++ file's own "out of memory" with nothing naming CUDA may be the host's.
        ("what():  src/parser/tokenizer.cpp(120): out of memory", None),
        ("what():  src/kernels/device_helpers.cuh(456): out of memory", "driver"),
        (
            "what():  thirdParty/mallocMC/SimpleCudaMalloc_impl.hpp(42):\nerror: out of memory",
            "driver",
        ),
        (
            "terminate called after throwing an instance of 'thrust::system::system_error'\n"
            "  what():  src/common/alloc.h(31): out of memory",
            "driver",
        ),
    ],
    ids=["host-file", "cuda-file", "cuda-path", "thrust-line-before"],
)
def test_a_source_location_out_of_memory_is_cuda_only_where_cuda_is_named(
    text: str, kind: str | None
) -> None:
    facts = parse_or_none(text)
    assert (None if facts is None else facts.kind) == kind  # type: ignore[attr-defined]


@FAST
@given(st.text(max_size=2000))
def test_random_text_never_raises_anything_else(text: str) -> None:
    parse_or_none(text)


@FAST
@given(st.integers(min_value=0, max_value=len(MESSAGE)))
def test_truncated_messages_never_raise(cut: int) -> None:
    facts = parse_or_none(MESSAGE[:cut])
    if facts is not None:
        # Whatever survives the cut must be what the full message says, never a guess.
        # Cut after its first line, the category names that wording, not a version.
        full = parse_oom(MESSAGE)
        for key, value in facts.model_dump(exclude={"message", "other_processes"}).items():  # type: ignore[attr-defined]
            if key == "category" and value == "pytorch_caching_allocator_oom_first_line":
                continue
            assert value in (None, [], getattr(full, key)), key


@FAST
@given(st.binary(max_size=3000))
def test_non_utf8_bytes_decoded_at_the_boundary(raw: bytes) -> None:
    parse_or_none((raw + MESSAGE.encode()).decode("utf-8", errors="replace"))


@FAST
@given(st.sampled_from([e["text"] for e in CORPUS]), st.sampled_from(["\r\n", "\n", "\r"]))
def test_line_endings_do_not_change_the_numbers(text: str, ending: str) -> None:
    assert parse_oom(text.replace("\n", ending)).requested_bytes == parse_oom(text).requested_bytes


@FAST
@given(st.integers(min_value=30, max_value=120))
def test_word_wrapping_at_any_width_keeps_the_numbers(width: int) -> None:
    words, lines, line = MESSAGE.replace("\n", " ").split(" "), [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    wrapped = parse_oom("\n".join([*lines, line]))
    assert wrapped.model_dump(exclude={"message"}) == parse_oom(MESSAGE).model_dump(
        exclude={"message"}
    )


def test_ten_megabyte_log_is_bounded_and_finds_the_oom() -> None:
    noise = (FIXTURES / "non-oom" / "hf-trainer.log").read_text() * 8000
    log = (
        noise[: 5 * 2**20] + "\n[rank0]: " + MESSAGE.replace("\n", " ") + "\n" + noise[: 5 * 2**20]
    )
    assert len(log) > 10 * 2**20
    started = time.process_time()
    facts = parse_oom(log)
    assert time.process_time() - started < 5
    assert facts.requested_bytes == 144_703_488


def test_ten_megabyte_log_of_anchor_words_is_bounded() -> None:
    log = "out of memory Tried to allocate cudnn kv cache " * 250_000
    started = time.process_time()
    with pytest.raises(NotRecognized):
        parse_oom(log)
    assert time.process_time() - started < 5


def test_long_path_like_tokens_beside_anchor_words_are_bounded() -> None:
    # A path pattern tried from every character of a long token costs the token's length
    # squared: 40 lines like this took 10 s before file paths were matched from their
    # first character only; linear, they take well under a second.
    log = ("CUDA kernel failed: out of memory at " + "x." * 4000 + "\n") * 40
    started = time.process_time()
    # No family knows this wording; it still says CUDA ran out (families/generic.py).
    assert parse_oom(log).kind == "device"
    assert time.process_time() - started < 5


@FAST
@given(st.integers(min_value=0, max_value=2**44))
def test_format_then_parse_round_trips_within_printed_precision(num_bytes: int) -> None:
    printed = format_size(num_bytes)
    unit = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[printed.split()[1]]
    assert abs(parse_size(printed) - num_bytes) <= unit * 0.005 + 0.5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.19 GiB", 1_277_752_771),
        ("1024.00 KiB", 2**20),
        ("0 bytes", 0),
        ("129.21 MB", 135_486_505),  # MPS's MB is binary
        ("90.48M", 94_875_156),  # TF prints the exact 94873600 beside it
        ("25,600,000 bytes", 25_600_000),
        ("2.60GiB", 2_791_728_742),
    ],
)
def test_parse_size_is_binary(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "device_type", "conf"),
    [
        (
            "Tried to allocate 20.00 MiB (GPU 0; 1.96 GiB total capacity; 1.24 GiB already "
            "allocated; 2.88 MiB free; 1.25 GiB reserved in total by PyTorch)",
            "cuda",
            None,
        ),
        (
            "Tried to allocate 386.00 MiB (NPU 2; 60.97 GiB total capacity; 59.57 GiB already "
            "allocated; 16.54 MiB free; 60.06 GiB reserved in total by PyTorch)",
            "npu",
            "PYTORCH_NPU_ALLOC_CONF",
        ),
    ],
    ids=["cuda", "npu"],
)
def test_the_allocator_figures_without_a_head_name_their_device(
    text: str, device_type: str, conf: str | None
) -> None:
    facts = parse_oom(text)
    assert (facts.kind, facts.device_type, facts.alloc_conf_var) == (
        "pytorch_allocator",
        device_type,
        conf,
    )
    assert facts.requested_bytes is not None and facts.free_bytes is not None


def test_named_runtime_calls_and_checks_in_long_lines_are_bounded() -> None:
    # The runtime call's name, a comparison with cudaSuccess and a tool's "Failed to
    # allocate N GPU memory" start patterns of their own; each is tried from a word's
    # first character only, and its gap is bounded.
    log = (
        ("cudaMallocX " * 3000 + "x." * 3000 + " out of memory\n")
        + ("a == " * 6000 + "cudaSuccess (3 vs 0) out of memory\n")
        + ("Failed to allocate " + "1" * 20000 + " GPU memor out of memory\n")
    ) * 20
    started = time.process_time()
    with contextlib.suppress(NotRecognized):
        parse_oom(log)
    assert time.process_time() - started < 5


_PYTORCH_HEAD = (
    "CUDA out of memory. Tried to allocate {}.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which "
)


def _numbered(line: str, size: int = 2**20) -> str:
    """``line`` formatted with 0, 1, 2, ... until ``size`` characters: every window differs,
    so none is read once for all (parse.py reads a repeated window's text once)."""
    lines, length = [], 0
    while length < size:
        lines.append(line.format(len(lines)))
        length += len(lines[-1])
    return "".join(lines)


@pytest.mark.parametrize(
    "log",
    [
        # The audit's input: lines of one length, joined as hard-wrapped into one line of
        # 64 KiB with a message every 180 characters (9 s for 1.8 MB before the bounds).
        (_PYTORCH_HEAD.format(20) + "a" * 80 + "\n") * 6000,
        # The same with a different message on every line (and a different window).
        _numbered((_PYTORCH_HEAD + "a" * 80)[:180] + "\n"),
        # Users' short form, which the first-line fallback and the generic reader check.
        _numbered("CUDA OOM {} "),
        # NCCL's origin ("host:pid:tid [gpu]") is read back along the line from each match.
        _numbered("host:{}:1 [0] NCCL WARN Cuda failure 'out of memory' "),
        _numbered("RESOURCE_EXHAUSTED: Out of memory while trying to allocate {}.00G. "),
    ],
    ids=["audit", "audit-numbered", "cuda-oom", "nccl", "xla"],
)
def test_logs_dense_with_anchor_words_are_bounded(log: str) -> None:
    # A window of one line holding a message every few characters: each match was read
    # back to the start of its line (the exception's name, NCCL's origin), so a window cost
    # its matches times its length, and up to 32 windows are read: 9 s to 220 s of CPU for
    # one or two MB. A family now reads at most 64 matches of a header per window, and a
    # line at most 2 KiB back from a match (families/clauses.py).
    assert 2**20 <= len(log) < 2 * 2**20
    started = time.process_time()
    with contextlib.suppress(NotRecognized):
        parse_oom(log)
    assert time.process_time() - started < 5


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('Exception in thread "main" java.lang.OutOfMemoryError', None),
        ("java.lang.OutOfMemoryError: Java heap space", "host"),
        ("Caused by: java.lang.OutOfMemoryError", None),
    ],
    ids=["java-thread", "java-heap", "java-caused-by"],
)
def test_javas_out_of_memory_error_is_not_pytorchs(text: str, kind: str | None) -> None:
    # PyTorch's exception name alone ends a line too ("...报错OutOfMemoryError"); Java's
    # dotted name is not it. The JVM's heap running out is host RAM (blind-32); its name
    # alone says nothing of which memory.
    if kind is None:
        with pytest.raises(NotRecognized):
            parse_oom(text)
    else:
        assert parse_oom(text).kind == kind
