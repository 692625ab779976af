"""The classes blind-37 showed missing or wrongly explained: NCCL's failures logged at its
WARN level without the NCCL tag; the device named a few lines from the failure, or by a
user's card name (``gtx 1660ti``); a word inside a known fixed phrase (ExLlamaV3); ``HBM
OOM`` and a TPU named by its slice; the ``mem`` abbreviation; and, as a near miss read as
an OOM, a fixed region or plan too small for what was put in it. Behind right families:
fragmentation offered where free memory alone covered the request, an impossible figure
printed as memory in use, a TPU program padded to the chip's tiles given batch advice and
a "who holds the GPU" diagnosis, NCCL's "may be unrelated" warning read as certain, a
failure while loading a model without the model's advice, and managed memory under WSL2.

The lines are written for the class they stand for, in wordings other than the blind
samples' (/tmp/audit/explain37 had the real ones), and each class has near misses. Each
class is checked through the Python API (the tables) and through ``gpuwatch explain``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from doctor.class_tables import class_tests
from doctor.cli_run import run

GIB = 2**30
MIB = 2**20

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    # NCCL's WARN level without its tag: NCCL 2.x's origin and source, or the level alone.
    (
        "gpu-node7:4242:4299 [2] init.cc:412 WARN Cuda failure 'out of memory'",
        {"kind": "nccl", "category": "nccl_cuda_oom", "device_index": 2, "pid": 4242},
    ),
    (
        "worker3:77:91 [1] transport/net.cc:88 WARN Failed to CUDA calloc 4194304 bytes",
        {"kind": "nccl", "requested_bytes": 4194304, "host": "worker3"},
    ),
    ("[WARN] Cuda failure 2 'out of memory'", {"kind": "nccl", "category": "nccl_cuda_oom"}),
    # NCCL's last warning relayed with XLA's caveat: a likely cause, not a certain one.
    (
        "NCCL operation ncclGroupEnd() failed: unhandled cuda error (run with NCCL_DEBUG=INFO "
        "for details). Last NCCL warning(error) log entry (may be unrelated) 'Cuda failure "
        "'out of memory''.",
        {"kind": "nccl", "category": "nccl_last_warning_oom"},
    ),
    # The device named a few lines away: a benchmark's header, a blank line, a template.
    (
        "[bench 3/7] fft_convolve [Device=1 dtype=cuda::std::complex<double>]\n"
        "  batch=64 length=1048576\n"
        "Error: allocator exception (OutOfMemory: Failed to allocate memory)",
        {"kind": "device", "device_type": "cuda"},
    ),
    (
        "Uncaught exception: could not allocate memory: failed with error out of memory\n\n"
        "500 frames 4032x3024, rtx 2070 super",
        {"kind": "device", "device_type": "cuda"},
    ),
    (
        "RuntimeError: failed to allocate the render target\n"
        "\n"
        "**Environment**\n"
        "- GPU: rx 6700 xt (12 GB)",
        {"kind": "device", "device_type": "hip"},
    ),
    # The card's memory abbreviated.
    ("Critical: Not enough GPU mem! (render_tile.cpp:88)", {"kind": "device"}),
    ("error: insufficient device mem for the 4096x4096 texture", {"kind": "device"}),
    ("fatal: out of GPU mem while building the BVH", {"kind": "device"}),
    # A word or two inside ExLlama's fixed phrase.
    (
        "RuntimeError: Insufficient VRAM in split for model and cache",
        {"kind": "exllama", "phase": "model load"},
    ),
    ("Insufficient VRAM on GPU 1 for model and cache", {"kind": "exllama"}),
    # HBM OOM, and a TPU named by its slice, on the line or a line away.
    ("with batch 32 the job dies with HBM OOM on the TPU", {"kind": "xla", "device_type": "tpu"}),
    (
        "batch 16 always ends in hbm oom.\nThe VM is a v4-32 slice.",
        {"kind": "xla", "category": "xla_tpu_memory_space_exhausted"},
    ),
    ("Getting HBM OOM on v5e-8 with seq len 8192", {"kind": "xla"}),
    # HBM OOM with no TPU around it, nor a slice (a model's version is none): a GPU's HBM.
    ("llama-v2-7b fine-tune: got hbm oom at step 10", {"kind": "device"}),
    # Managed memory: its own category, whatever library allocated it.
    (
        "MemoryError: std::bad_alloc: CUDA error at: /opt/rmm/mr/device/"
        "managed_memory_resource.hpp:80: cudaErrorMemoryAllocation out of memory",
        {"kind": "driver", "category": "cuda_managed_memory_oom"},
    ),
    (
        "cudaMallocManaged failed: cudaErrorMemoryAllocation: out of memory",
        {"kind": "driver", "category": "cuda_managed_memory_oom"},
    ),
    # The failure's own sentence says it was loading a model.
    (
        "[ModelManager]::ERROR --> Insufficient GPU memory to load the model. Aborting",
        {"kind": "device", "phase": "model load"},
    ),
    (
        "RuntimeError: CUDA error: out of memory while loading model weights",
        {"phase": "model load"},
    ),
]

NEGATIVE: list[str] = [
    # NCCL's WARN level naming another CUDA failure.
    "gpu-node7:4242:4299 [2] init.cc:412 WARN Cuda failure 'initialization error'",
    # A region, arena or plan too small for what was put in it, with a device around it.
    "CUDA_VISIBLE_DEVICES=0 ./chat --model llama\n"
    "InternalError: storage allocation failure, attempted to allocate 33562624 at offset 0 "
    "in region that is 33554432bytes",
    "running on cuda:0\nCheck failed: (offset + needed <= this->arena.size) is false: failed "
    "to allocate 8192 bytes",
    "GPU 0: workspace allocation failed: requested 4096 bytes in a pool of 2048 bytes",
    # Prose about out-of-memory errors with GPUs named around it: no error a program printed.
    "Two kinds of OOM are covered here: at start-up and at run time.\nBoth were "
    "reproduced on an RTX 4090 and an RX 7900 XTX.",
    "Reviewers asked why this fails to allocate memory in some cases.\n\nTested on "
    "GTX 1080 and RTX 3090.",
    # A failure with the device further away than the lines read around it.
    "Setup: GTX 1660 Ti\n1\n2\n3\n4\nError: could not allocate memory for frame 12",
    # The device's memory abbreviated, but not run out; "mem" alone is any memory.
    "GPU mem usage: 3.2 GB of 8 GB",
    "Error: not enough mem to start the build",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)


def _explain(text: str, capsys: pytest.CaptureFixture[str], *, human: bool = False) -> Any:
    """``gpuwatch explain [--json] --no-live --text TEXT``: the JSON, or the text."""
    args = ["explain", "--no-live", "--text", text]
    code, out, _ = run(args if human else ["explain", "--json", *args[1:]], capsys)
    assert code == 0
    return out if human else json.loads(out)


def _fixes(result: dict[str, Any]) -> list[str]:
    return [d["fix"] for d in result["diagnoses"]]


def _pytorch(requested: str, free: str, unallocated: str) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested}. GPU 0 has "
        f"a total capacity of 11.76 GiB of which {free} is free. Of the allocated memory 6.10 "
        f"GiB is allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated."
    )


@pytest.mark.parametrize(
    ("requested", "free", "unallocated"),
    [("20.00 MiB", "4.12 GiB", "96.00 MiB"), ("2.00 GiB", "5.50 GiB", "3.00 GiB")],
    ids=["tiny-request", "cache-larger-than-request"],
)
def test_free_memory_that_covered_the_request_is_not_fragmentation(
    requested: str, free: str, unallocated: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = _explain(_pytorch(requested, free, unallocated), capsys)
    assert "fragmentation" not in _fixes(result)
    only = result["diagnoses"][0]
    assert only["fix"] == "unknown"
    assert "not what ran out" in only["evidence"] and "commit limit" in only["evidence"]
    assert "what limits this process" in only["summary"]
    assert any("page file" in c for c in only["commands"])


def test_a_card_with_only_the_request_free_is_still_full_so_fragmentation_stays(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 30 MiB free for a 20 MiB request: the card is full, and the cache's split blocks are
    # what could have served it.
    result = _explain(_pytorch("20.00 MiB", "30.00 MiB", "1.20 GiB"), capsys)
    assert _fixes(result)[0] == "fragmentation"


def test_holders_on_a_rocm_card_with_free_memory_get_no_nvidia_tool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = _pytorch("20.00 MiB", "4.12 GiB", "96.00 MiB").replace("CUDA", "HIP")
    commands = [c for d in _explain(message, capsys)["diagnoses"] for c in d["commands"]]
    assert not any("nvidia-smi" in c for c in commands)
    assert any("page file" in c for c in commands)


def test_nccl_evidence_keeps_the_messages_may_be_unrelated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = (
        "jaxlib.xla_extension.XlaRuntimeError: INTERNAL: NCCL operation ncclCommInitRank(&comm, "
        "nranks, id, rank) failed: unhandled cuda error. Last NCCL warning(error) log entry "
        "(may be unrelated) 'Cuda failure 2 'out of memory''."
    )
    result = _explain(message, capsys)
    evidence = result["diagnoses"][0]["evidence"]
    assert "may be unrelated" in evidence and "no headroom left" not in evidence
    assert "export NCCL_DEBUG=WARN" in result["diagnoses"][0]["commands"][0]


def test_an_impossible_figure_on_a_device_is_set_aside_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = (
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,024,000 bytes "
        "(allocated so far: 9,123,456,789,012 bytes)."
    )
    result = _explain(message, capsys)
    assert result["allocated_bytes"] is None
    assert result["printed"]["allocated_bytes"] == 9123456789012
    assert any("more than any one accelerator holds" in n for n in result["notes"])
    # A pool a card can hold is kept.
    plausible = message.replace("9,123,456,789,012", "12,373,894,656")
    assert _explain(plausible, capsys)["allocated_bytes"] == 12373894656


def _tpu(padding: str, expansion: str) -> str:
    return (
        "Compilation failure: Ran out of memory in memory space hbm. Used 20.50G of 16.00G hbm. "
        "Exceeded hbm capacity by 4.50G.\n\n"
        "Total hbm usage >= 20.50G:\n    reserved        528.00M\n    program          19.98G\n\n"
        "  Largest program allocations in hbm:\n\n"
        "  1. Size: 12.00G\n"
        '     Operator: op_type="Gather" op_name="embed/Gather"\n'
        "     Shape: f32[3145728,16,2]{2,1,0:T(8,128)}\n"
        f"     Unpadded size: 384.00M\n     Extra memory due to padding: {padding} ({expansion})\n"
    )


def test_a_tpu_program_padded_to_the_tiles_is_told_to_reshape_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _explain(_tpu("11.62G", "32.0x expansion"), capsys)
    assert result["printed"]["padding_bytes"] == 12476879995  # 11.62 GiB, rounded half-up
    first = result["diagnoses"][0]
    assert "tiles" in first["summary"] and "without it the program would fit" in first["evidence"]
    assert any("minor" in c for c in first["commands"])
    # Nobody else holds a TPU's memory while its program compiles.
    assert "unknown" not in _fixes(result)
    text = _explain(_tpu("11.62G", "32.0x expansion"), capsys, human=True)
    assert "program needs 20.50 GiB" in text and "who holds the GPU" not in text


def test_little_padding_leaves_the_batch_advice_alone(capsys: pytest.CaptureFixture[str]) -> None:
    result = _explain(_tpu("96.00M", "1.2x expansion"), capsys)
    assert not any("tiles" in d["summary"] for d in result["diagnoses"])
    assert _fixes(result) == ["reduce_activations"]


def test_a_tpu_compile_oom_without_figures_looks_at_the_program_not_the_holders(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space vmem."
    [only] = _explain(message, capsys)["diagnoses"]
    assert "largest allocations" in only["summary"] and "GPU" not in only["summary"]
    assert not any("nvidia-smi" in c for c in only["commands"])


@pytest.mark.parametrize(
    "message",
    [
        "[ModelManagerService]::WARNING --> Insufficient GPU memory to load model. Aborting",
        "Error: not enough VRAM while loading the model (RTX 3060, 12 GB)",
    ],
)
def test_a_failure_while_loading_a_model_gets_the_models_advice(
    message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _explain(message, capsys)["diagnoses"][0]
    assert first["fix"] == "model_too_large"
    assert any("quantised" in c for c in first["commands"])


def test_a_model_loaded_before_the_failure_is_not_a_load_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = "I loaded the model fine; then: Error: not enough GPU memory for the 4k upscale"
    assert "model_too_large" not in _fixes(_explain(message, capsys))


def test_managed_memory_names_wsl2s_missing_oversubscription(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = (
        "MemoryError: std::bad_alloc: CUDA error at: /env/include/rmm/mr/device/"
        "managed_memory_resource.hpp:73: cudaErrorMemoryAllocation out of memory"
    )
    [only] = _explain(message, capsys)["diagnoses"]
    assert "WSL2" in only["evidence"] and "oversubscription" in only["evidence"]
    assert "at start-up" not in only["evidence"]


def test_the_blind_37_wordings_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    result = _explain("host1:10:11 [0] init.cu:218 WARN Cuda failure 'out of memory'", capsys)
    assert (result["kind"], result["device"]) == ("nccl", "cuda:0")
    assert _explain("it failed with hbm oom.\nI use v3-8", capsys)["kind"] == "xla"
    assert _explain("Critical: Not enough GPU mem!", capsys)["kind"] == "device"
    region = (
        "CUDA_VISIBLE_DEVICES=0 ./chat\nstorage allocation failure, attempted to allocate "
        "16785408 at offset 0 in region that is 16777216bytes"
    )
    code, _, err = run(["explain", "--no-live", "--text", region], capsys)
    assert code == 6 and "not an OOM message I recognise" in err
