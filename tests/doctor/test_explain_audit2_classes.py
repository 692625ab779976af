"""explain-audit2: a blind audit's 60 real messages and 17 near misses, and the classes of
its findings (fixtures/explain-audit2/README.md).

The findings, by class: a cap on one allocation (IPEX's 4 GB, Metal's buffer size) is a
limit, not a working set; advice names the device the tensors are on (autocast's
device_type; no torch advice for CuPy or Metal); cudaMallocAsync's unreported memory is
other processes' or its own pool's; a DataLoader worker killed with its pid elided or left
out; Paddle's exception name alone; a framework's CPU device gets host advice; CuPy's pool
and MPS's other allocations are shown and used; a person's "CPU OOM" is host RAM.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.doctor.explain import Explanation, explain
from gpuwatch.doctor.figures import CONTEXT_ALLOWANCE_BYTES
from gpuwatch.doctor.parse import parse_oom
from gpuwatch.doctor.report import render
from gpuwatch.doctor.units import GIB, MIB
from gpuwatch.errors import NotRecognized

HERE = Path(__file__).parent / "fixtures" / "explain-audit2"
BAR = 0.95
NEAR_MISS_KINDS = {"NOT", "NOTGPU"}


def _load(name: str) -> list[dict[str, Any]]:
    text = (HERE / name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line]


OOM = _load("oom.jsonl")
NEAR = _load("near-misses.jsonl")


def _explain(text: str) -> Explanation | None:
    try:
        return explain(text)
    except NotRecognized:
        return None


def _commands(explanation: Explanation) -> list[str]:
    return [c for d in explanation.diagnoses for c in d.commands]


# ---------------------------------------------------------------- the fixture set


def _tuning_urls() -> dict[str, set[str]]:
    tuning = (Path(__file__).parent / "fixtures" / "oom-messages.jsonl").read_text("utf-8")
    texts: dict[str, set[str]] = {}
    for line in tuning.splitlines():
        entry = json.loads(line)
        texts.setdefault((entry["source"] or {}).get("url"), set()).add(entry["text"].strip())
    return texts


def test_the_set_is_what_the_audit_gathered_and_its_overlap_is_recorded() -> None:
    assert len(OOM) == 60 and len(NEAR) == 17
    assert all(e["source"].startswith("https://github.com/") for e in OOM + NEAR)
    assert {e["kind"] for e in NEAR} <= NEAR_MISS_KINDS
    # The audit meant to leave out every source of the other corpora, but its list missed
    # the tuning corpus' nested source URLs: 27 of its messages come from an issue the
    # tuning corpus cites (12 with the same text). Each says so, and the rate below is
    # also taken without them.
    tuning = _tuning_urls()
    for entry in OOM + NEAR:
        texts = tuning.get(entry["source"])
        want = (
            None
            if texts is None
            else "same text"
            if entry["text"].strip() in texts
            else "same issue"
        )
        assert entry.get("tuning_overlap") == want, entry["id"]


def test_at_least_95_percent_recognised_overall_and_per_kind() -> None:
    misses: list[str] = []
    by_kind: Counter[str] = Counter()
    right: Counter[str] = Counter()
    for entry in OOM:
        got = _explain(entry["text"])
        by_kind[entry["kind"]] += 1
        if got is not None and got.kind == entry["kind"]:
            right[entry["kind"]] += 1
        else:
            misses.append(f"{entry['id']}: expected {entry['kind']}, got {got and got.kind}")
    rate = sum(right.values()) / len(OOM)
    assert rate >= BAR, f"{rate:.1%}; misses:\n" + "\n".join(misses)
    low = {k: f"{right[k]}/{n}" for k, n in by_kind.items() if right[k] / n < BAR}
    assert not low, f"kinds under {BAR:.0%}: {low}; misses:\n" + "\n".join(misses)
    unseen = [e for e in OOM if "tuning_overlap" not in e]
    unseen_right = sum(
        1 for e in unseen if (got := _explain(e["text"])) is not None and got.kind == e["kind"]
    )
    assert unseen_right / len(unseen) >= BAR, (
        f"{unseen_right}/{len(unseen)} of those not in the tuning corpus"
    )


@pytest.mark.parametrize("entry", NEAR, ids=lambda e: e["id"])
def test_no_near_miss_is_read_as_a_gpu_oom(entry: dict[str, Any]) -> None:
    got = _explain(entry["text"])
    if entry["kind"] == "NOT":
        assert got is None, f"recognised as {got and got.kind}/{got and got.category}"
    else:  # system RAM: unrecognised, or host
        assert got is None or got.kind == "host", f"{got.kind}/{got.category}"


_UNITS = {"B": 1, "bytes": 1, "KiB": 1024, "MiB": MIB, "GiB": GIB, "KB": 1000, "MB": 10**6,
          "GB": 10**9}  # fmt: skip
_FIELDS = {
    "requested": "requested_bytes",
    "total": "total_bytes",
    "free": "free_bytes",
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "reserved_unallocated": "reserved_unallocated_bytes",
    "process": "process_in_use_bytes",
    "allowed": "allowed_bytes",
}


def _candidates(printed: str) -> list[float]:
    """Bytes a printed figure may mean: binary, or decimal where the unit is."""
    if re.fullmatch(r"\d+", printed):
        return [int(printed)]
    number, unit = re.fullmatch(r"([\d.]+)\s*(\w+)", printed.strip()).groups()  # type: ignore[union-attr]
    values = [float(number) * _UNITS[unit]]
    if unit in ("KB", "MB", "GB"):
        values.append(float(number) * {"KB": 1024, "MB": MIB, "GB": GIB}[unit])
    return values


@pytest.mark.parametrize("entry", [e for e in OOM if e.get("expect")], ids=lambda e: e["id"])
def test_figures_and_first_fix(entry: dict[str, Any]) -> None:
    got = _explain(entry["text"])
    assert got is not None
    for key, want in entry["expect"].items():
        if key == "fix":
            assert got.diagnoses and got.diagnoses[0].fix == want
            continue
        value = getattr(got, _FIELDS[key])
        if want is None:
            assert value is None, key
            continue
        assert value is not None, key
        assert any(abs(value - c) <= max(0.006 * c, 10 * 1024) for c in _candidates(want)), (
            f"{key}: {value} for {want}"
        )


# ---------------------------------------------------------------- finding 1: one-allocation caps


_IPEX = (
    "RuntimeError: Current platform can NOT allocate memory block with size larger than 4GB! "
    "Tried to allocate {size} (GPU  0; 15.56 GiB total capacity; {allocated} already allocated; "
    "{reserved} reserved in total by PyTorch)"
)


@pytest.mark.parametrize(
    ("size", "allocated", "reserved"),
    [("6.85 GiB", "0 bytes", "0 bytes"), ("5.46 GiB", "556.67 MiB", "2.70 GiB")],
)
def test_ipex_4gb_cap_is_a_limit_on_one_allocation(
    size: str, allocated: str, reserved: str
) -> None:
    got = explain(_IPEX.format(size=size, allocated=allocated, reserved=reserved))
    assert got.printed is not None and got.printed.per_allocation_limit_bytes == 4 * GIB
    first = got.diagnoses[0]
    assert first.fix == "memory_limit"
    assert "4.00 GiB" in first.evidence and "one block" in first.evidence
    assert any("UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1" in c for c in first.commands)
    assert any("split" in c for c in first.commands)
    assert "one-allocation cap 4.00 GiB" in render(got)


def test_a_request_under_the_cap_is_not_blamed_on_it() -> None:
    facts = parse_oom(_IPEX.format(size="3.00 GiB", allocated="0 bytes", reserved="0 bytes"))
    facts.per_allocation_limit_bytes = 4 * GIB
    from gpuwatch.doctor.diagnosis import diagnose
    from gpuwatch.doctor.figures import read_figures

    assert all(d.fix != "memory_limit" for d in diagnose(facts, read_figures(facts)))


def test_metal_buffer_over_its_maximum_is_the_same_limit() -> None:
    got = explain(
        "[metal::malloc] Attempting to allocate 25769803776 bytes which is greater than the "
        "maximum allowed buffer size of 21474836480 bytes."
    )
    assert got.diagnoses[0].fix == "memory_limit"
    assert not any("torch.autocast" in c for c in _commands(got))  # MLX, not torch


# ---------------------------------------------------------------- device-correct advice


@pytest.mark.parametrize(
    ("text", "device"),
    [
        (
            "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 10.00 GiB. GPU 0 has a "
            "total capacity of 15.11 GiB of which 1.11 GiB is free. Of the allocated memory "
            "12.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.",
            "xpu",
        ),
        (
            "torch.OutOfMemoryError: NPU out of memory. Tried to allocate 22.00 GiB (NPU 2; 60.97 "
            "GiB total capacity; 30.00 GiB already allocated; 1.20 GiB free; 30.50 GiB reserved "
            "in total by PyTorch)",
            "npu",
        ),
        (_IPEX.format(size="6.85 GiB", allocated="0 bytes", reserved="0 bytes"), "xpu"),
        (
            "RuntimeError: MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: "
            "1.00 GB, max allowed: 18.13 GB). Tried to allocate 2.00 GB on private pool.",
            "mps",
        ),
    ],
)
def test_autocast_names_the_device_the_tensors_are_on(text: str, device: str) -> None:
    autocasts = [c for c in _commands(explain(text)) if "autocast" in c]
    assert autocasts, "no autocast advice to check"
    assert all(f'device_type="{device}"' in c for c in autocasts), autocasts


def test_cupy_gets_no_torch_advice() -> None:
    got = explain(
        "cupy.cuda.memory.OutOfMemoryError: out of memory to allocate 1073741824 bytes (total 1073741824 bytes)"
    )
    assert not any("torch." in c for c in _commands(got))


# ---------------------------------------------------------------- finding 2: cudaMallocAsync


_ASYNC = """torch.cuda.OutOfMemoryError: Allocation on device 5 would exceed allowed memory. (out of memory)
Currently allocated     : 54.14 GiB
Requested               : 686.41 MiB
Device limit            : 79.35 GiB
Free (according to CUDA): 27.19 MiB
PyTorch limit (set by user-supplied memory fraction)
                        : 17179869184.00 GiB
"""


def test_async_backend_estimates_what_its_tensors_do_not_hold() -> None:
    got = explain(_ASYNC)
    assert got.total_bytes and got.free_bytes is not None and got.allocated_bytes
    beyond = got.total_bytes - got.free_bytes - got.allocated_bytes - CONTEXT_ALLOWANCE_BYTES
    assert got.other_processes_bytes == beyond
    fixes = [d.fix for d in got.diagnoses]
    assert fixes[:2] == ["other_processes", "fragmentation"]
    pool = got.diagnoses[1]
    assert any("backend:native" in c for c in pool.commands)
    assert any("empty_cache" in c for c in pool.commands)
    assert "pool" in got.diagnoses[0].summary  # not "other processes" as a certainty
    assert any("cudaMallocAsync" in n and "cannot tell" in n for n in got.notes)


def test_async_backend_with_a_full_card_of_its_own_tensors_blames_no_one() -> None:
    text = _ASYNC.replace("54.14 GiB", "78.50 GiB")
    fixes = [d.fix for d in explain(text).diagnoses]
    assert "other_processes" not in fixes and "fragmentation" not in fixes
    assert fixes[0] == "reduce_activations"


# ---------------------------------------------------------------- finding 3: DataLoader


@pytest.mark.parametrize(
    ("text", "pid"),
    [
        ("RuntimeError: DataLoader worker (pid 22048) is killed by signal: Killed.", 22048),
        ("RuntimeError: DataLoader worker (pid ...) is killed by signal: Killed", None),
        ("RuntimeError: DataLoader worker (pid XXXXX) is killed by signal: Killed.", None),
        ("RuntimeError: DataLoader worker (pid(s) 4242) is killed by signal: Killed.", 4242),
        ("RuntimeError: DataLoader worker is killed by signal: Killed.", None),
        ("DataLoader worker (pid <redacted>) is killed by signal: Bus error.", None),
    ],
)
def test_dataloader_worker_killed_whatever_its_pid_says(text: str, pid: int | None) -> None:
    facts = parse_oom(text)
    assert facts.kind == "host"
    assert facts.category.startswith("dataloader_")
    assert facts.pid == pid


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: DataLoader worker (pid 2085) is killed by signal: Terminated.",
        "RuntimeError: DataLoader worker (pid ...) is killed by signal: Segmentation fault.",
    ],
)
def test_dataloader_worker_killed_by_another_signal_is_not_an_oom(text: str) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(text)


# ---------------------------------------------------------------- finding 4: Paddle's name


def test_paddle_bad_alloc_name_alone() -> None:
    got = explain(
        "terminate called after throwing an instance of 'paddle::memory::allocation::BadAlloc'\n"
        "  what():\n"
    )
    assert (got.kind, got.category) == ("paddle", "paddle_bad_alloc")
    assert got.diagnoses[0].fix == "unknown"
    assert "paste the whole message" in " ".join(_commands(got))


def test_paddle_bad_alloc_with_its_message_keeps_the_figures() -> None:
    got = explain(
        "terminate called after throwing an instance of 'paddle::memory::allocation::BadAlloc'\n"
        "  what():  ResourceExhaustedError: \n\nOut of memory error on GPU 0. Cannot allocate "
        "56.000000MB memory on GPU 0, 7.782776GB memory has been allocated and available "
        "memory is only 12.750000MB.\n"
    )
    assert got.category == "paddle_out_of_memory" and got.requested_bytes == 56 * MIB


# ---------------------------------------------------------------- finding 5: CPU devices


@pytest.mark.parametrize(
    "text",
    [
        "OOM when allocating tensor with shape[24,1,2304,1152,3] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
        "RuntimeError: Out of memory error on CPU 0. Cannot allocate 3.000000GB memory on CPU 0, "
        "10.5GB memory has been allocated and available memory is only 100.000000MB.",
    ],
)
def test_a_frameworks_cpu_device_gets_host_advice(text: str) -> None:
    got = explain(text)
    assert got.device_type == "cpu"
    commands = " ".join(_commands(got))
    for gpu_only in ("set_memory_growth", "empty_cache", "nvidia-smi", "autocast", "XLA_PYTHON"):
        assert gpu_only not in commands
    assert "free -h" in commands
    assert "system RAM" in got.diagnoses[0].summary


# ---------------------------------------------------------------- findings 6 and 7: pools


def test_cupy_pool_total_is_shown_and_used() -> None:
    got = explain(
        "cupy.cuda.memory.OutOfMemoryError: out of memory to allocate 1073741824 bytes "
        "(total 12373894656 bytes)"
    )
    assert "pool holds 11.52 GiB" in render(got)
    first = got.diagnoses[0]
    assert first.fix == "memory_held_across_steps" and "11.52 GiB" in first.evidence
    assert any("free_all_blocks" in c for c in first.commands)


def test_a_small_cupy_pool_is_not_the_story() -> None:
    got = explain(
        "cupy.cuda.memory.OutOfMemoryError: out of memory to allocate 4294967296 bytes "
        "(total 1073741824 bytes)"
    )
    assert all(d.fix != "memory_held_across_steps" for d in got.diagnoses)


def test_mps_other_allocations_are_shown_and_used() -> None:
    got = explain(
        "RuntimeError: MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: "
        "17.35 GiB, max allowed: 27.20 GiB). Tried to allocate 292.50 MiB on private pool. Use "
        "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
        "(may cause system failure)."
    )
    assert "other allocations 17.35 GiB" in render(got)
    first = got.diagnoses[0]
    assert first.fix == "memory_limit" and "17.35 GiB" in first.evidence
    assert any("offload" in c for c in first.commands)
    assert all("17.35 GiB" in d.evidence for d in got.diagnoses)  # every diagnosis says it


def test_mps_with_few_other_allocations_stays_a_working_set() -> None:
    got = explain(
        "RuntimeError: MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: "
        "1.00 GB, max allowed: 18.13 GB). Tried to allocate 2.00 GB on private pool."
    )
    assert got.diagnoses[0].fix == "reduce_activations"
    assert "other allocations 1.00 GiB" in render(got)


# ---------------------------------------------------------------- finding 8: host RAM in words


@pytest.mark.parametrize(
    "text",
    [
        "When using ZeRO Stage 3 with NVMe offload I see CPU OOM errors during the partitioning",
        "the job hits a CPU out of memory when loading the checkpoint",
        "It crashed with CPU OOM after 3 epochs",
    ],
)
def test_a_person_telling_of_cpu_oom_is_host(text: str) -> None:
    facts = parse_oom(text)
    assert (facts.kind, facts.device_type) == ("host", "host")


@pytest.mark.parametrize(
    "text",
    [
        "To avoid CPU OOM, set low_cpu_mem_usage=True",
        "Does ZeRO-3 cause CPU OOM?",
        "CPU OOM protection is enabled",
        "If you see CPU OOM errors, lower the number of workers.",
    ],
)
def test_cpu_oom_as_advice_or_question_is_not_a_failure(text: str) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(text)


def test_a_gpu_message_beside_cpu_oom_prose_is_the_one_explained() -> None:
    facts = parse_oom(
        "I see CPU OOM errors sometimes, but this time:\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert facts.kind == "pytorch_allocator"
