"""A failure only forecast, or only built in code, is not a failure, whichever family
knows its wording.

Documentation, pull requests and how-to articles name the errors an API may return;
people paste them, and blind-30's near misses showed four families and the fallback
reading such a sentence as an OOM. The rule (families/clauses.py, ``forecast``) looks
only at the failure's own sentence, before it: what a log line says after the failure
("If reserved but unallocated memory is large ...") or on another line does not count.
"""

from __future__ import annotations

import pytest

from gpuwatch.doctor.parse import parse_oom
from gpuwatch.errors import NotRecognized

FORECASTS = {
    "vulkan-may-produce": "Allocating memory for Vulkan resources may produce "
    "VK_ERROR_OUT_OF_DEVICE_MEMORY, so the allocator retries with a smaller block.",
    "blender-may-display": "Blender may display an error that reads \u201cSystem is out of "
    "GPU memory\u201d when a scene's textures do not fit.",
    "driver-will-return": "The Vulkan driver will return OOM errors when the shared GPU "
    "memory has filled up.",
    "pytorch-might-raise": "Large batches might raise torch.OutOfMemoryError: CUDA out of "
    "memory. Tried to allocate 2.00 GiB",
    "cuda-can-return": "cudaMallocAsync can return cudaErrorMemoryAllocation (out of memory) "
    "when the pool's release threshold is too low.",
    "opencl-could-return": "clCreateBuffer could return CL_MEM_OBJECT_ALLOCATION_FAILURE if "
    "the buffer is larger than the device allows.",
    "commit-prose": "This commit adds the case for UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY to "
    "the cases where the constructor throws.",
    "pr-prose": "The PR maps hipErrorOutOfMemory to a Python MemoryError.",
    "advice-to-the-reader": "Keep the batch small, otherwise you will see a CUDA Out Of Memory "
    "(OOM) Error and your training will crash.",
    # Supposed, or counted as none, in any family (the CLI audit's prose).
    "to-avoid": "To avoid CUDA out of memory errors, reduce the batch size.",
    "tip-if-you-hit": "Tip: if you hit CUDA out of memory, try a smaller batch size.",
    "reduce-the-chance": "Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce "
    "the chance of CUDA out of memory errors",
    "zero-count": "Training finished: 0 CUDA out of memory errors, 3 epochs.",
    "no-oom": "Peak GPU memory: 78.5 GiB of 80 GiB, no out of memory.",
    # A page or a change about the error (blind-33's near misses, in other words).
    "can-cause": "Preallocating the pool can sometimes cause out-of-memory (OOM) errors.",
    "defined": "A CUDA out of memory error occurs when the model and its activations need "
    "more memory than the GPU has free.",
    "mitigate-title": "Mitigate the CUDA OutOfMemory error after long translation jobs",
    "hints-title": "Add hints on CUDA out of memory errors to the trainer's log",
    "how-to-title": "Docs: how to fix CUDA out of memory when fine-tuning",
    # Built in code, not printed by a failure.
    "passed-to-a-call": "This returns false: `is_oom(RuntimeError('CUDA error: out of memory'))`",
    "the-string-code-looks-for": "The helper only checks for the string `CUDA out of memory.`",
    # The words inside the name of code that tests for an OOM (families/generic.py).
    "handler-name": "`lightning.utilities.memory.is_cuda_out_of_memory` does not work reliably",
}


@pytest.mark.parametrize("text", FORECASTS.values(), ids=FORECASTS.keys())
def test_a_forecast_failure_is_not_recognised(text: str) -> None:
    with pytest.raises(NotRecognized):
        parse_oom(text)


FAILURES = {
    # A negated modal is a failure that happened.
    "could-not-allocate": (
        "RuntimeError: could not allocate 2.00 GiB on device 0: CUDA error: out of memory",
        "driver",
    ),
    # What PyTorch says after the failure, in its own sentences, is advice.
    "advice-after": (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 3.06 MiB is free. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
        "avoid fragmentation.",
        "pytorch_allocator",
    ),
    # The forecast on the line before does not reach the failure's own line.
    "forecast-line-before": (
        "Note: a large batch may cause this error.\nRuntimeError: CUDA error: out of memory",
        "driver",
    ),
    # A person asking about a failure they met, or what causes it.
    "why-would-return": (
        "Why would cudaMalloc return out of memory on GPU 0 when nvidia-smi shows 20 GiB free?",
        "driver",
    ),
    "what-can-lead-to": (
        'what issues can lead to this error which is "RuntimeError: CUDA error: out of memory"?',
        "driver",
    ),
    # An exception's repr in a log, after a colon, is one that was raised.
    "repr-in-a-log": (
        "worker 3 failed: RuntimeError('CUDA error: out of memory')",
        "driver",
    ),
    # "When" starts a sentence that is not a question.
    "when-not-a-question": (
        "When I start the second run, RuntimeError: CUDA error: out of memory",
        "driver",
    ),
    # "if" in a question about one that happened, or on the code line of a traceback
    # before the failure's own line; a count that is not zero.
    "if-in-a-question": ("What should I do if I get CUDA out of memory?", "pytorch_allocator"),
    "if-on-the-line-before": (
        '  File "train.py", line 9, in step\n    if batch is not None: loss = model(batch)\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "pytorch_allocator",
    ),
    "a-count-of-two": (
        "2 CUDA out of memory errors in the last hour: RuntimeError: CUDA error: out of memory",
        "driver",
    ),
    # A person telling of one they met, in the words of a definition.
    "occurs-when-i": (
        "RuntimeError: CUDA out of memory occurs when I run the second epoch",
        "pytorch_allocator",
    ),
    "how-to-question": ("How to fix CUDA out of memory?", "pytorch_allocator"),
    # A person telling of a failure they keep meeting.
    "will-throw-narrative": (
        "Every run will throw torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "1.50 GiB (GPU 0; 7.79 GiB total capacity; 5.10 GiB already allocated)",
        "pytorch_allocator",
    ),
}


@pytest.mark.parametrize(("text", "kind"), FAILURES.values(), ids=FAILURES.keys())
def test_a_failure_that_happened_is_still_recognised(text: str, kind: str) -> None:
    assert parse_oom(text).kind == kind
