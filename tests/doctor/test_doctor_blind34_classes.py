"""The classes blind-34 showed missing: a batch scheduler's or a person's report of the
OOM killer, Thrust's bad_alloc with CUDA's text, a cuDNN call's status by its number,
Vulkan's status without its VK_ prefix; and, as near misses read as OOMs, a Vulkan status
under a failed pinned-memory allocation, a failure told of in general ("when a ... error
occurs"), what an API is allowed to return, a change's title naming what it fixes, and
errors quoted as alternatives in a page's list of symptoms.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    (
        "srun: error: node17: tasks 0-3: Out Of Memory",
        {"kind": "host", "category": "cgroup_oom_killer", "device_type": "host"},
    ),
    (
        "slurmstepd: error: Detected 2 oom_kill events in StepId=4242.batch. Some of the "
        "step tasks have been OOM Killed.",
        {"kind": "host", "category": "cgroup_oom_killer"},
    ),
    (
        "After epoch 3 the trainer was killed by the Linux OOM killer.",
        {"kind": "host", "category": "linux_oom_killer"},
    ),
    (
        "preprocess.py got oom-killed while tokenizing the corpus",
        {"kind": "host", "device_type": "host"},
    ),
    (
        "terminate called after throwing an instance of 'thrust::system::detail::bad_alloc'\n"
        "  what():  std::bad_alloc: cudaErrorMemoryAllocation: out of memory",
        {"kind": "driver", "device_type": "cuda"},
    ),
    (
        "cudnnFindConvolutionBackwardDataAlgorithm failed: 2  convDesc=[mode : CUDNN_CONVOLUTION]",
        {
            "kind": "cudnn",
            "category": "cudnn_alloc_failed",
            "library_status": "CUDNN_STATUS_ALLOC_FAILED",
            "api_call": "cudnnFindConvolutionBackwardDataAlgorithm",
        },
    ),
    (
        "cudnnGetConvolutionForwardWorkspaceSize: 2",
        {"kind": "cudnn", "library_status": "CUDNN_STATUS_ALLOC_FAILED"},
    ),
    (
        "[Renderer] Vulkan: ERROR_OUT_OF_DEVICE_MEMORY while creating the shadow atlas",
        {"kind": "vulkan", "category": "vulkan_out_of_device_memory"},
    ),
]

NEGATIVE: list[str] = [
    # Kubernetes' reason run together, in a pull request or code, stays what it was.
    "Restart only the pods whose reason is OOMKilled",
    # Slurm's other task failures.
    "srun: error: node17: task 0: Exited with exit code 1",
    # The OOM killer only supposed or advised about.
    "If the job is killed by the OOM killer, lower --mem-per-cpu.",
    # A plain C++ std::bad_alloc carries no CUDA text: host RAM, not read as the GPU.
    "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc",
    # cuDNN calls that returned other statuses.
    "cudnnFindConvolutionForwardAlgorithm failed: 3",
    "cudnnConvolutionForward: 2.5 ms per call",
    # Vulkan's status for host memory, and the device status with no API word.
    "VK Error Code: ERROR_OUT_OF_HOST_MEMORY",
    # A pinned staging buffer refused: ggml goes on with ordinary memory.
    "ggml_vulkan: Failed to allocate pinned memory.\n"
    "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
    # A failure told of in general.
    "When an out of memory error occurs, the allocator prints a summary of its segments.",
    "Whenever a CUDA out of memory happens, the server restarts the worker.",
    # What an API is specified to return.
    "zeMemAllocDevice is allowed to return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
    # A change's title naming what it fixes.
    "[CUDA] fix the pool growth error when >40GB, cudaMalloc failed: out of memory on device",
    "Fixes CUDA out of memory error during cudagraph capture",
    # Errors quoted as alternatives in a page's list of symptoms.
    "- Symptom: `RuntimeError: CUDA error: out of memory` or `CUBLAS_STATUS_ALLOC_FAILED`",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)
