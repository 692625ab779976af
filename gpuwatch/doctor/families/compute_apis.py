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
  Windows' own status for it, E_OUTOFMEMORY (``0x8007000E``, ``8007000E``, signed
  ``-2147024882``, or its text ``Not enough memory resources are available to complete this
  operation``), is DirectML's too where DirectML, Direct3D 12 or ONNX Runtime's DML provider
  is named around it (``...\\DmlExecutionProvider\\src\\BucketizedBufferAllocator.cpp(122)
  ... 8007000E Not enough memory resources ...``); without them it may be any Windows
  allocation, and is not read here.
* OpenCL: the status ``CL_MEM_OBJECT_ALLOCATION_FAILURE`` (-4), however the program words
  the call around it, or in words after a C++ exception's ``what():`` (Boost.Compute:
  ``Memory Object Allocation Failure``). Like Vulkan, OpenCL runs on any vendor's GPU.
  The status by its number is read only next to the ``cl*`` call that returned it
  (``OpenCL Error: clEnqueueNDRangeKernel -4``, ``clCreateBuffer failed with error -4``,
  ``error -4 when calling clEnqueueWriteBuffer``), and only three numbers: -4; -6,
  ``CL_OUT_OF_HOST_MEMORY`` (system RAM: kind ``host``); and -5, ``CL_OUT_OF_RESOURCES``,
  read as SYCL's family reads it: the device's memory for an allocation, unless the text
  around names a launch resource (work-group size, local memory, registers). NVIDIA's
  OpenCL also returns -5 for a kernel that read or wrote out of bounds, which its advice
  says. The same two statuses by name are read the same way, next to a ``cl*`` call.
"""

from __future__ import annotations

import itertools
import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    MAX_LINE_LOOKBACK_CHARS,
    Found,
    Span,
    exception_before,
    line_end,
    line_lookback,
    line_start,
    mentions,
    spans,
)

_VULKAN = re.compile(
    r"VK_ERROR_OUT_OF_DEVICE_MEMORY|ErrorOutOfDeviceMemory"
    # The same status without its VK_ prefix, where the API is named before it on the
    # line: "VK Error Code: ERROR_OUT_OF_DEVICE_MEMORY", "Vulkan: ERROR_OUT_OF_DEVICE_MEMORY".
    r"|\b(?:VK|Vulkan)\b[^\n]{0,40}?(?<![\w])ERROR_OUT_OF_DEVICE_MEMORY\b"
    # Rust's vulkano names the result OutOfDeviceMemory inside its OomError.
    r"|\bOomError\(OutOfDeviceMemory\)"
    # The call that returned it, with the result's value (-2).
    r"|\bvkAllocateMemory\b[^\n]{0,200}?(?<![\w.])-2\b"
    # The API's name and the plain words, as a title or a program's own summary says it
    # ("Vulkan out of memory with nvidia card").
    r"|\bVulkan\s+(?:error:?\s+)?out\s+of\s+(?:device\s+)?memory"
    # A renderer's own words with the Vulkan call that failed, in either order: s&box's
    # "OUT OF VIDEO MEMORY! ( vmaAllocateMemory )". The Vulkan Memory Allocator's calls
    # (vmaAllocateMemory, vmaCreateImage) and Vulkan's (vkAllocateMemory) name the API.
    r"|(?i:out\s+of\s+(?:video|device|gpu)\s+memory)[^\n]{0,80}?\b(?:vma|vk)[A-Z]\w*"
    r"|\b(?:vma|vk)[A-Z]\w*[^\n]{0,80}?(?i:out\s+of\s+(?:video|device|gpu)\s+memory)"
    # DXVK (Direct3D on Vulkan, under Wine and Proton): "DxvkMemoryAllocator: Memory
    # allocation failed", then "Size: 67108864" on a line of its own.
    r"|\bDxvkMemoryAllocator:\s+Memory\s+allocation\s+failed"
)
_DXVK_SIZE = re.compile(r"^\s*Size:\s*(?P<bytes>\d+)\s*$", re.MULTILINE)
# The line says the program went on: VMA's "... trying again in system memory as a fallback".
_WENT_ON = re.compile(r"fall(?:ing)?\s*back|trying\s+again|\bretry", re.IGNORECASE)
# Vulkan's own status for host memory: system RAM, not the GPU.
_VULKAN_HOST = re.compile(
    r"VK_ERROR_OUT_OF_HOST_MEMORY|ErrorOutOfHostMemory|\bOomError\(OutOfHostMemory\)"
)
_GGML_SIZE = re.compile(
    r"ggml_vulkan:\s+Device\s+memory\s+allocation\s+of\s+size\s+(?P<bytes>\d+)\s+failed"
)
# The same line alone (the status line after it cut off, or ik_llama.cpp's build, which
# prints it without the prefix): ggml's own words, with its Vulkan buffers (Vulkan0) or
# its prefix nearby.
_GGML_ALONE = re.compile(
    r"(?:ggml_vulkan:\s+)?Device\s+memory\s+allocation\s+of\s+size\s+(?P<bytes>\d+)\s+failed"
)
_GGML_VULKAN_CONTEXT = re.compile(r"ggml_vulkan|\bVulkan\d+\b|\bvk::")
GGML_CONTEXT_CHARS = 600
_DIRECTML = re.compile(
    r"(?:Could\s+not\s+allocate\s+tensor\s+with\s+(?P<bytes>\d+)\s+bytes\.\s+)?There\s+is\s+not\s+"
    r"enough\s+GPU\s+video\s+memory\s+available"
    # torch-directml's heap allocator, logged as a warning before the exception it raises.
    r"|\bDML\s+allocator\s+out\s+of\s+memory"
)
# Windows' E_OUTOFMEMORY, by its HRESULT (hexadecimal, or signed decimal as torch-directml's
# "Unknown error -2147024882" prints it), its name, or its text ...
_E_OUTOFMEMORY = re.compile(
    r"(?<![\w-])(?:0x)?8007000[Ee](?!\w)|(?<![\w-])-2147024882(?!\d)|\bE_OUTOFMEMORY\b"
    r"|Not\s+enough\s+memory\s+resources\s+are\s+available\s+to\s+complete\s+this\s+operation"
)
# ... in DirectML's (or Direct3D 12's) context: then it is the GPU's memory.
# Not "dmlc" (MXNet's and XGBoost's dmlc-core): "dml" as a word, a prefix or a camelCase hump.
_DIRECTML_CONTEXT = re.compile(
    r"(?i:DirectML|D3D12|Direct3D\s*12|torch_directml)|\b(?:dml|DML)\b|\bdml_|Dml[A-Z]"
)
DIRECTML_CONTEXT_CHARS = 600
# How many matches of a status a window's reading looks at before giving up: each costs a
# look along its line, so a line repeating the number thousands of times stays linear.
MAX_STATUS_TRIES = 16
_OPENCL = re.compile(
    r"CL_MEM_OBJECT_ALLOCATION_FAILURE|\bOpenCL\s+(?:error:?\s+)?out\s+of\s+(?:device\s+)?memory"
    # The status in words, as Boost.Compute's opencl_error says it.
    r"|(?<=what\(\):)\s+Memory\s+Object\s+Allocation\s+Failure"
)
_OPENCL_CALL = re.compile(r"\b(cl[A-Z]\w+)\b")
# An OpenCL call's status by its number, or -5 and -6 by name, next to the call. The call
# is an OpenCL API name ("clEnqueueNDRangeKernel", "clCreateBuffer"): "cl" and a capital.
_CL_CALL = r"(?<![\w.])(?P<{name}>cl[A-Z][A-Za-z]{{2,40}})\b"
# The statuses read: -4 CL_MEM_OBJECT_ALLOCATION_FAILURE, -5 CL_OUT_OF_RESOURCES, -6
# CL_OUT_OF_HOST_MEMORY. Not "-45" or "-6.5": the number ends there.
_CL_NUMBER = r"(?<![\w.-])(?P<{name}>-[456])(?![\w.])"
_CL_NAME = r"\b(?P<{name}>CL_OUT_OF_(?:RESOURCES|HOST_MEMORY))\b"
_ERROR_WORD = r"\b(?:error|err|failed|returned|returns|code|status|result)\b"
_OPENCL_STATUS = re.compile(
    # The call (with its arguments, or none), then the status right after it:
    # "clEnqueueNDRangeKernel -4", "clCreateBuffer: -4", "clFinish(queue) = -5" ...
    _CL_CALL.format(name="call") + r"(?:\([^()\n]{0,200}\))?[^\S\n]*[:=(,]?[^\S\n]*"
    + r"(?:" + _CL_NUMBER.format(name="code") + r"|" + _CL_NAME.format(name="name") + r")"
    # ... or after a word that says it is one: "clCreateBuffer failed with error -4",
    # "clCreateBuffer() returned CL_OUT_OF_HOST_MEMORY".
    + r"|" + _CL_CALL.format(name="call2") + r"[^\d\n]{0,40}?" + _ERROR_WORD + r"[^\S\n]*[:=(#]?[^\S\n]*"
    + r"(?:" + _CL_NUMBER.format(name="code2") + r"|" + _CL_NAME.format(name="name2") + r")"
    # The status first, then the call: "Error -4 when calling clEnqueueNDRangeKernel",
    # "OpenCL error CL_OUT_OF_RESOURCES in clFinish".
    + r"|\b(?i:error)[^\S\n]*(?:code[^\S\n]*)?[:=]?[^\S\n]*"
    + r"(?:" + _CL_NUMBER.format(name="code3") + r"|" + _CL_NAME.format(name="name3") + r")"
    + r"[^\d\n]{0,40}?\b(?:in|at|from|calling|during|for)[^\S\n]+" + _CL_CALL.format(name="call3")
)  # fmt: skip
_CL_STATUS_NAMES = {
    "-4": "CL_MEM_OBJECT_ALLOCATION_FAILURE",
    "-5": "CL_OUT_OF_RESOURCES",
    "-6": "CL_OUT_OF_HOST_MEMORY",
}
# Out of resources that are not memory: a kernel's launch limits (as in SYCL's family).
_LAUNCH_RESOURCE = re.compile(
    r"work[-_\s]?group|local\s+memory|registers?\b|private\s+memory|sub[-_\s]?group",
    re.IGNORECASE,
)
CONTEXT_CHARS = 300


def _ggml_alone(window: str) -> list[Found]:
    """ggml's "Device memory allocation of size N failed." with no Vulkan status after it,
    where ggml's Vulkan backend is named around it."""
    found = []
    for match in _GGML_ALONE.finditer(window):
        around = window[
            max(0, match.start() - GGML_CONTEXT_CHARS) : match.end() + GGML_CONTEXT_CHARS
        ]
        if not _GGML_VULKAN_CONTEXT.search(around):
            continue
        facts = OomFacts(
            kind="ggml",
            category="ggml_vulkan_alloc_failed",
            exception=exception_before(window, match.start()),
            requested_bytes=int(match["bytes"]),
            api_call="vkAllocateMemory",
            message=match[0],
        )
        found.append(Found(match.start(), facts))
    return found


def find(window: str) -> list[Found]:
    """The first Vulkan and the first OpenCL out-of-device-memory (repeats are one
    failure), and every DirectML one, in ``window``."""
    found = []
    vulkan = [
        span
        for span in spans(
            window, _VULKAN, limit=400, needs=("vk", "vma", "vulkan", "outofdevicememory")
        )
        if not _went_on(span) and not _pinned(span)
    ]
    for span in vulkan[:1]:
        start = max(0, span.start - CONTEXT_CHARS)
        size = _GGML_SIZE.search(window, start, span.start)
        dxvk = _DXVK_SIZE.search(window, span.start, span.end) if size is None else None
        # ggml's line with the size comes first: the message starts there.
        begins = size.start() if size else span.start
        ggml = size is not None or "ggml_vulkan" in window[start : span.start]
        facts = OomFacts(
            kind="ggml" if ggml else "vulkan",
            category="ggml_vulkan_alloc_failed" if ggml else "vulkan_out_of_device_memory",
            exception=exception_before(window, span.start),
            requested_bytes=int(size["bytes"]) if size else int(dxvk["bytes"]) if dxvk else None,
            api_call=_vulkan_call(window[start : span.end], window[span.line_lookback : span.end]),
            message=window[begins : span.end].strip()[:4000],
        )
        found.append(Found(begins, facts))
    if not vulkan:
        found.extend(_ggml_alone(window)[:1])
    if not vulkan:
        for span in spans(window, _VULKAN_HOST, limit=300, needs=("vk", "outofhostmemory"))[:1]:
            facts = OomFacts(
                kind="host",
                category="vulkan_out_of_host_memory",
                exception=exception_before(window, span.start),
                device_type="host",
                message=span.snippet,
            )
            found.append(Found(span.start, facts))
    opencl = spans(window, _OPENCL, limit=300)
    for span in opencl[:1]:
        begins = span.line_start
        call = _OPENCL_CALL.search(window, begins, span.end)
        facts = OomFacts(
            kind="opencl",
            category="opencl_mem_object_allocation_failure",
            exception=exception_before(window, span.start),
            api_call=call[1] if call else None,
            cuda_error="CL_MEM_OBJECT_ALLOCATION_FAILURE",
            cuda_error_code=-4,
            message=window[begins : span.end].strip()[:4000],
        )
        found.append(Found(span.start, facts))
    if not opencl:
        found.extend(_opencl_status(window))
    directml = spans(window, _DIRECTML, limit=300)
    if not directml:
        found.extend(_windows_out_of_memory(window))
    for span in directml:
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


def _windows_out_of_memory(window: str) -> list[Found]:
    """The first E_OUTOFMEMORY in ``window`` with DirectML or Direct3D 12 around it."""
    if not mentions(
        window, ("dml", "d3d12", "direct3d", "directml")
    ) or not _DIRECTML_CONTEXT.search(window):
        return []
    for match in itertools.islice(_E_OUTOFMEMORY.finditer(window), MAX_STATUS_TRIES):
        begins = line_start(window, match.start())
        low = max(0, begins - DIRECTML_CONTEXT_CHARS)
        if not _DIRECTML_CONTEXT.search(window, low, match.end() + DIRECTML_CONTEXT_CHARS):
            continue
        facts = OomFacts(
            kind="directml",
            category="directml_e_outofmemory",
            exception=exception_before(window, begins),
            device_type="dml",
            cuda_error="E_OUTOFMEMORY",
            message=window[begins : line_end(window, match.end())].strip()[:4000],
        )
        return [Found(begins, facts)]
    return []


def _opencl_status(window: str) -> list[Found]:
    """The first OpenCL status read by its number (or -5 and -6 by name) next to its call."""
    if not mentions(window, ("-4", "-5", "-6", "cl_out_of_")):
        return []
    for match in itertools.islice(_OPENCL_STATUS.finditer(window), MAX_STATUS_TRIES):
        code = match["code"] or match["code2"] or match["code3"]
        name = match["name"] or match["name2"] or match["name3"]
        status = name or _CL_STATUS_NAMES[code]
        begins = line_start(window, match.start())
        line = window[begins : line_end(window, match.end())]
        if "Native API" in line:
            continue  # SYCL's wrapper of an OpenCL status: the sycl family's
        around = window[max(0, begins - CONTEXT_CHARS) : match.end() + CONTEXT_CHARS]
        if status == "CL_OUT_OF_RESOURCES" and _LAUNCH_RESOURCE.search(around):
            continue
        host = status == "CL_OUT_OF_HOST_MEMORY"
        category = {
            "CL_MEM_OBJECT_ALLOCATION_FAILURE": "opencl_mem_object_allocation_failure",
            "CL_OUT_OF_RESOURCES": "opencl_out_of_resources",
            "CL_OUT_OF_HOST_MEMORY": "opencl_out_of_host_memory",
        }[status]
        facts = OomFacts(
            kind="host" if host else "opencl",
            category=category,
            exception=exception_before(window, begins),
            device_type="host" if host else None,
            api_call=match["call"] or match["call2"] or match["call3"],
            cuda_error=status,
            cuda_error_code=int(code) if code else int(_CODES[status]),
            message=line.strip()[:4000],
        )
        return [Found(begins, facts)]
    return []


_CODES = {name: code for code, name in _CL_STATUS_NAMES.items()}
_VULKAN_CALL = re.compile(r"\b(?:vma|vk)[A-Z]\w*")


def _vulkan_call(around: str, line: str) -> str | None:
    """The Vulkan (or VMA) call that failed, where the text names it: vulkan-hpp's
    ``vk::Device::allocateMemory`` around the match, or a call on its line."""
    if "allocateMemory" in around:
        return "vkAllocateMemory"
    call = _VULKAN_CALL.search(line)
    return call[0] if call else None


# ggml's Vulkan backend asks for pinned host memory to stage copies and, refused, goes
# on with ordinary memory: "ggml_vulkan: Failed to allocate pinned memory." then the
# status on the next line. System RAM for staging, not the device's memory.
_PINNED = re.compile(r"\bpinned\s+memory\b", re.IGNORECASE)


def _pinned(span: Span) -> bool:
    """Whether the line of the match, or the line before it, is about pinned memory."""
    begins = span.line_lookback
    # The line before only where the match's own line is read from its start.
    before = line_lookback(span.text, max(0, begins - 1)) if begins == span.line_start else begins
    return _PINNED.search(span.text, before, _line_end_read(span)) is not None


def _went_on(span: Span) -> bool:
    """Whether the line the match is on says the program went on without the memory."""
    return _WENT_ON.search(span.text, span.line_lookback, _line_end_read(span)) is not None


def _line_end_read(span: Span) -> int:
    """Where a pattern reads the span's line to: its end (or the span's, on the last line),
    at most MAX_LINE_LOOKBACK_CHARS past the match."""
    end = span.text.find("\n", span.start)
    return min(span.end if end == -1 else end, span.start + MAX_LINE_LOOKBACK_CHARS)
