"""Vulkan, DirectML and OpenCL: device memory ran out under a compute API other than CUDA.

* Vulkan (llama.cpp's ggml-vulkan, MLC-LLM/TVM, Mesa drivers): the result code
  ``VK_ERROR_OUT_OF_DEVICE_MEMORY`` or vulkan-hpp's ``vk::Device::allocateMemory:
  ErrorOutOfDeviceMemory``, after ggml's ``ggml_vulkan: Device memory allocation of size N
  failed.``; vulkano's ``OomError(OutOfDeviceMemory)``; and ``vkAllocateMemory`` with
  the result's value, -2. Vulkan runs on every vendor's GPU (an NVIDIA one included), so
  the device type is left unknown.
* DirectML (torch-directml on Windows): ``Could not allocate tensor with N bytes. There is
  not enough GPU video memory available!`` (its second sentence alone is DirectML's too),
  and its heap allocator's ``DML allocator out of memory!``.
* OpenCL: the status ``CL_MEM_OBJECT_ALLOCATION_FAILURE`` (-4), however the program words
  the call around it, or in words after a C++ exception's ``what():`` (Boost.Compute:
  ``Memory Object Allocation Failure``). Like Vulkan, OpenCL runs on any vendor's GPU.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_VULKAN = re.compile(
    r"VK_ERROR_OUT_OF_DEVICE_MEMORY|ErrorOutOfDeviceMemory"
    # Rust's vulkano names the result OutOfDeviceMemory inside its OomError.
    r"|\bOomError\(OutOfDeviceMemory\)"
    # The call that returned it, with the result's value (-2).
    r"|\bvkAllocateMemory\b[^\n]{0,200}?(?<![\w.])-2\b"
    # The API's name and the plain words, as a title or a program's own summary says it
    # ("Vulkan out of memory with nvidia card").
    r"|\bVulkan\s+(?:error:?\s+)?out\s+of\s+(?:device\s+)?memory"
)
_GGML_SIZE = re.compile(
    r"ggml_vulkan:\s+Device\s+memory\s+allocation\s+of\s+size\s+(?P<bytes>\d+)\s+failed"
)
_DIRECTML = re.compile(
    r"(?:Could\s+not\s+allocate\s+tensor\s+with\s+(?P<bytes>\d+)\s+bytes\.\s+)?There\s+is\s+not\s+"
    r"enough\s+GPU\s+video\s+memory\s+available"
    # torch-directml's heap allocator, logged as a warning before the exception it raises.
    r"|\bDML\s+allocator\s+out\s+of\s+memory"
)
_OPENCL = re.compile(
    r"CL_MEM_OBJECT_ALLOCATION_FAILURE|\bOpenCL\s+(?:error:?\s+)?out\s+of\s+(?:device\s+)?memory"
    # The status in words, as Boost.Compute's opencl_error says it.
    r"|(?<=what\(\):)\s+Memory\s+Object\s+Allocation\s+Failure"
)
_OPENCL_CALL = re.compile(r"\b(cl[A-Z]\w+)\b")
CONTEXT_CHARS = 300


def find(window: str) -> list[Found]:
    """The first Vulkan and the first OpenCL out-of-device-memory (repeats are one
    failure), and every DirectML one, in ``window``."""
    found = []
    for span in spans(window, _VULKAN, limit=400)[:1]:
        start = max(0, span.start - CONTEXT_CHARS)
        size = _GGML_SIZE.search(window, start, span.start)
        # ggml's line with the size comes first: the message starts there.
        begins = size.start() if size else span.start
        ggml = size is not None or "ggml_vulkan" in window[start : span.start]
        facts = OomFacts(
            kind="ggml" if ggml else "vulkan",
            category="ggml_vulkan_alloc_failed" if ggml else "vulkan_out_of_device_memory",
            exception=exception_before(window, span.start),
            requested_bytes=int(size["bytes"]) if size else None,
            api_call="vkAllocateMemory" if "allocateMemory" in window[start : span.end] else None,
            message=window[begins : span.end].strip()[:4000],
        )
        found.append(Found(begins, facts))
    for span in spans(window, _OPENCL, limit=300)[:1]:
        begins = span.line_start
        call = _OPENCL_CALL.search(window, begins, span.end)
        facts = OomFacts(
            kind="opencl",
            category="opencl_mem_object_allocation_failure",
            exception=exception_before(window, span.start),
            api_call=call[1] if call else None,
            message=window[begins : span.end].strip()[:4000],
        )
        found.append(Found(span.start, facts))
    for span in spans(window, _DIRECTML, limit=300):
        match = _DIRECTML.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="directml",
            category="directml_tensor_alloc_failed",
            exception=exception_before(window, span.start),
            device_type="dml",
            requested_bytes=int(match["bytes"]) if match["bytes"] else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
