"""The fallback for wordings no family knows (gpuwatch/doctor/families/generic.py), by
class: what makes a line "a device's memory ran out", and what keeps a line that only
mentions GPU memory from reading as one. Lines are written for the class they stand for;
the held-out corpus (test_doctor_heldout.py) has the real ones.
"""

from __future__ import annotations

import pytest

from gpuwatch.doctor.parse import parse_oom
from gpuwatch.errors import NotRecognized


@pytest.mark.parametrize(
    ("text", "device_type", "index", "requested"),
    [
        # Memory said to be short, with a device word on the line.
        ("Error: the renderer ran out of GPU memory while building the BVH", None, None, None),
        ("Error: the renderer ran out of GPU memory on the GeForce", "cuda", None, None),
        ("FATAL: not enough video memory to create the swap chain (adapter 1)", None, None, None),
        ("RuntimeError: insufficient device memory on card 2", None, 2, None),
        ("error: NPU memory is exhausted, stop training", "npu", None, None),
        ("训练时显存不足，程序退出", None, None, None),
        # The failure names where: no other device word needed.
        ("panicked at 'Err value: DeviceError(OutOfDeviceMemory)'", None, None, None),
        ("Failed to create surface: DDERR_OUTOFVIDEOMEMORY", None, None, None),
        # An allocation that failed, in an identifier that says where.
        ("Failed to cudaMalloc 16000000000 bytes", "cuda", None, None),
        ("fatal: cuda_malloc(): out of memory!", "cuda", None, None),
        ("Failure in hipMallocManaged at 191 miner.cpp", "hip", None, None),
        ("[lib][error] bm_alloc_gmem failed, dev_id = 3, size = 0x1000", None, 3, 4096),
        ("ERROR: failed to allocate 2.50 GiB on ROCm device 0", "hip", 0, 2684354560),
        # The device word on the line before (a C++ exception and its what()).
        (
            "terminate called after throwing 'engine::gpu_error'\n  what():  buffer allocation failed",
            None,
            None,
            None,
        ),
    ],
    ids=lambda value: str(value)[:40],
)
def test_a_line_that_says_device_memory_ran_out_is_recognised(
    text: str, device_type: str | None, index: int | None, requested: int | None
) -> None:
    facts = parse_oom(text)
    assert facts.kind == "device"
    assert facts.device_type == device_type
    assert facts.device_index == index
    assert facts.requested_bytes == requested
    # Without a vendor, the category says so: whose tool lists the holders is unknown.
    expected = "device_out_of_memory_other_wording" if device_type else "device_out_of_memory"
    assert facts.category == expected


@pytest.mark.parametrize(
    "text",
    [
        # It went on: a warning, a fallback, a retry.
        "WARNING: not enough GPU memory for the texture cache, continuing with less",
        "W1023 04:15:50 alloc.cc:12] GPU allocation failed, will be retried",
        'level=DEBUG msg="insufficient VRAM to load any model layers"',
        "Unable to allocate GPU memory, using unified memory instead",
        "Out of GPU memory for the cache: falling back to the CPU",
        # The host's memory, whatever else the line names.
        "ggml_cuda_host_malloc: failed to allocate 512.00 MiB of pinned memory: out of memory",
        "numpy.core._exceptions.MemoryError: Unable to allocate 3.2 GiB for an array with shape (100, 100) on the GPU node",
        "Memory cgroup out of memory: Killed process 1234 (python), the GPU job",
        "oom-kill: the GPU worker was killed",
        "MemoryError: cannot allocate memory",  # errno 12: no device named
        "OSError: [Errno 28] No space left on device",
        # A GPU's on-chip shared memory: a kernel's launch limit, not its memory.
        "triton: insufficient shared memory on the GPU: required 98304, limit 65536",
        # Another error, surfacing at an allocation.
        "cudaMalloc failed: an illegal memory access was encountered",
        "hipMalloc error: invalid device ordinal",
        # Only mentions memory.
        "GPU 0 has 24.00 GiB total, 20.1 GiB allocated by the model",
        "memoryless GPU buffers are enabled",
        "cuda out of memoryless mode",
        # PyTorch's exception name cut short is PyTorch's, not another wording.
        "torch.cuda.OutOfMemoryError: CUDA o",
    ],
    ids=lambda value: value[:40],
)
def test_a_line_that_only_mentions_gpu_memory_is_not_recognised(text: str) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(text)


def test_a_known_family_wins_over_the_fallback() -> None:
    # Both would read it; the family knows the figures.
    text = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert parse_oom(text).kind == "pytorch_allocator"


NOISE = "".join(f"step {n}: allocated {n} tensors, not enough data yet\n" * 20 for n in range(60))


def test_many_weak_anchor_lines_do_not_crowd_out_a_known_message() -> None:
    # Weak anchor words ("alloc", "enough") never open a window of their own.
    log = NOISE + "RuntimeError: CUDA error: out of memory\n" + NOISE
    assert parse_oom(log).kind == "driver"


def test_a_line_with_only_weak_anchor_words_is_found_among_them() -> None:
    # 1,200 lines with "alloc" and "enough" before it: each is read on its own.
    log = NOISE + "FATAL: not enough video memory to create the swap chain\n" + NOISE
    facts = parse_oom(log)
    assert (facts.kind, facts.message) == (
        "device",
        "FATAL: not enough video memory to create the swap chain",
    )
