"""The classes blind-35 showed missing: PyTorch's wording in any case and as users shorten
it ("CUDA OUT OF MEMORY", "Cuda Out of Memory", "CUDA OOM"), a failure told inside the
teller's own supposition or an indirect question, the loose wordings' "out-of-memory"
with hyphens and "OOM" glued to Chinese text, a launcher's report of a worker's return
code -9, and XLA's compilation aborted for want of memory or a TPU's HBM run out in
words; and, as near misses read as OOMs, a failure denied ("doesn't look like ... OOM"),
two error texts compared, a question put to the reader, an error made the subject of a
statement about it in general, a page's heading naming what it explains, and a diagnosis
told to the reader about their hardware.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    # PyTorch's wording in another case, and shortened, with the device word kept.
    (
        'Got "CUDA OUT OF MEMORY" again at epoch 3, even with batch size 2',
        {"kind": "pytorch_allocator", "device_type": "cuda"},
    ),
    ("Xpu Out Of Memory when fine-tuning on an Arc A770", {"kind": "xpu"}),
    (
        "Training crashes with a CUDA OOM after two epochs on a 12 GB card",
        {"kind": "pytorch_allocator", "category": "pytorch_caching_allocator_oom_first_line"},
    ),
    ("HIP OOM on RX 7900 XTX with batch 8", {"kind": "hip"}),
    # The teller's own supposition, met each time; an indirect question.
    (
        "If I raise the batch size to 64 it crashes with RuntimeError: CUDA out of memory.",
        {"kind": "pytorch_allocator", "exception": "RuntimeError"},
    ),
    (
        "I was wondering whether anyone knows why it still reports CUDA out of memory on a "
        "24GB card",
        {"kind": "pytorch_allocator"},
    ),
    # Loose wordings: hyphens, and "OOM" right after Chinese text.
    (
        "We hit an out-of-memory error on the GPU while exporting the model to ONNX.",
        {"kind": "device"},
    ),
    ("加载模型之后显存直接OOM，请问怎么办", {"kind": "device"}),
    # A launcher's report of a worker killed by SIGKILL.
    (
        "[2024-02-01 10:00:00,000] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python3', "
        "'-u', 'train.py', '--local_rank=0'] exits with return code = -9",
        {"kind": "host", "category": "worker_sigkilled_host_oom_suspect"},
    ),
    ("Worker 3 exited with exit code -9 while packing the dataset", {"kind": "host"}),
    # XLA's compilation refused, and a TPU's HBM run out in words.
    (
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Compilation failure: "
        "Aborting compilation early because it's unlikely to have enough memory. Requires "
        "40.12G, has 15.48G available.",
        {
            "kind": "xla",
            "category": "xla_compile_aborted_not_enough_memory",
            "phase": "compile",
            "free_bytes": 16621523436,
        },
    ),
    ("Keep running out of HBM on a TPU v4 pod with the 7B config", {"kind": "xla"}),
]

NEGATIVE: list[str] = [
    # A failure denied.
    "Doesn't look like a CUDA out of memory error to me; check the driver first.",
    "It isn't a GPU OOM: the kernel faulted on an illegal address.",
    # Two error texts compared, the way a reply explains what one means.
    'Seeing "XPU out of memory" is the same as seeing "CUDA out of memory" on NVIDIA: the '
    "card is full.",
    # A question put to the reader.
    "Ever hit the infamous CUDA out of memory error halfway through an epoch?",
    # The error made the subject of a statement about it in general.
    'The "CUDA out of memory" error is one of the most common problems in deep learning.',
    # A page's heading naming what it explains.
    "Troubleshooting CUDA out of memory errors in PyTorch",
    # A diagnosis told to the reader about their hardware.
    "Your GPU doesn't have enough VRAM for this model; try the 4-bit version.",
    # A guard, not a class the old code missed: the shortened form in a program's warning
    # that it went on stays unrecognised (read only where the fallback reads its line).
    "WARNING: CUDA OOM during validation, skipping batch 17",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)
