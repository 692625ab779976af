"""Finding OOM messages in arbitrary text and repairing their layout.

Real messages arrive hard-wrapped at 80 columns (splitting words), re-wrapped by
mail clients, with every line prefixed by a logger (``[rank0]: ``, ``(EngineCore
pid=207) ERROR 04-19 09:40:35 [core.py:1132] ``, timestamps, ``SUBPROCESS: ``), with
CRLF endings, or as a Rust debug string with literal ``\\n``. And they may sit in the
middle of a 10 MB training log.

So the text is never matched as a whole. :func:`windows` finds anchor words with
plain substring search (linear), cuts a bounded window of lines around each, and
:func:`repair` undoes the layout damage inside that window only. The family
patterns then use ``\\s+`` between words, which also covers wraps at spaces.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from gpuwatch.doctor.families.clauses import CONTEXT_LINES

# Lower-case words at least one of which every recognised message contains. Finding
# them with str.find keeps a 10 MB log to a handful of linear scans.
ANCHORS = (
    "out of memory",
    "outofmemory",
    "out_of_memory",
    "resource_exhausted",
    "resource exhausted",
    "oom when allocating",
    "alloc_failed",
    "allocation_failed",  # CURAND_STATUS_ALLOCATION_FAILED
    "allocator_failure",  # NVJPEG_STATUS_ALLOCATOR_FAILURE
    "attempting to allocate",  # MLX's [metal::malloc]
    "allocating <= available",  # Paddle before 1.5
    "not available to allocate",  # MIOpen
    "prefill tokens",  # TGI's warm-up
    "cumemoryallocate failed",  # HAMi-core
    "hami-core",
    "outofdevicememory",  # Vulkan's ErrorOutOfDeviceMemory
    "out_of_device_memory",  # VK_ERROR_OUT_OF_DEVICE_MEMORY
    "gpu video memory",  # DirectML
    "mem_object_allocation_failure",  # OpenCL
    "pt_devmem",  # Intel Gaudi
    "el0004",  # Ascend CANN
    "207001",  # Ascend CANN's ACL_ERROR_RT_MEMORY_ALLOCATION
    "exitcode: -9",  # torchrun: a SIGKILLed worker
    "exitcode  : -9",
    "(sigkill)",
    "cudnn",
    "kv cache",
    "cache blocks",
    "allocation on device",
    "failed to alloc",
    "tried to allocate",
    "workspace size",
    "ran out of memory",
    "errormemoryallocation",  # cudaErrorMemoryAllocation, HIP's older hipErrorMemoryAllocation
    "cublas_status_not_initialized",
    "unhandled cuda error",
    "ncclunhandledcudaerror",
    "shared memory segment",
    "failed to extend /dev/shm",
    "failed to cuda",
    "dst tensor is not initialized",
    "that was not possible",
    "unable to allocate",
    "free memory on device",
    "out of gpu",  # Blender Cycles: "System is out of GPU memory"
    "memory allocation failed",  # MXNet's GPU pool before 0.9
    "insufficient vram",  # ExLlamaV2's loader
    "you tried to allocate",  # PyTorch's CPU allocator (host RAM)
    "pagedkvcache",  # TensorRT-LLM: maxTokensInPagedKvCache must be large enough
    "executor creation failed",  # TensorRT-LLM: "... due to insufficient GPU memory"
    "memory isn't enough",  # MindSpore
    "more than total mem size",  # MindSpore's pool
    "not enough memory for",  # CatBoost's tree-ctr estimate
    "success (2 vs",  # glog's check of a status: cudaSuccess, CUFFT_SUCCESS (2 vs. 0)
    "allocator out of memory",  # DirectML's "DML allocator out of memory!"
    "vkallocatememory",  # Vulkan's call, with its result -2
    "memory object allocation failure",  # OpenCL's status in words (Boost.Compute)
    "mtlcommandbuffererrordomain",  # Metal's status as an NSError
    "gpu api call",  # OpenCV's cv::Error::GpuApiCallError (-217)
    "curesult",  # the CUDA driver API's status by its number: "CUresult error result=2"
    "] call to cu",  # Numba: "CudaAPIError: [2] Call to cuMemAlloc results in ..."
    "driver api error",  # NVIDIA's samples: "Driver API error = 0002"
    "npp_memory_allocation_err",  # NPP's statuses
    "npp_mem_alloc_err",
    "npp_no_memory_error",
    "nppexception",  # ManagedCuda: NPPException: "Device allocation error"
    "memory_allocation_error",  # Poplar's graph_ / stream_memory_allocation_error
    "circular buffers",  # tt-metal: circular buffers that clash with (or grow beyond) L1
    "out_of_resources",  # SYCL: UR_RESULT_ERROR_ / PI_ERROR_OUT_OF_RESOURCES
    "out_of_host_memory",  # SYCL, Level Zero, Vulkan: system RAM
    "outofhostmemory",  # vulkan-hpp's ErrorOutOfHostMemory, vulkano's OutOfHostMemory
    "rmm failure",  # RMM: "RMM failure at:...: Maximum pool size exceeded"
    # PyTorch's wording as users shorten it ("CUDA OOM when calling ...", "Cuda oom error"):
    # the device words of families/pytorch.py's first line.
    "cuda oom",
    "hip oom",
    "xpu oom",
    "npu oom",
    "musa oom",
    "mlu oom",
    # XLA on a TPU in words: "Getting out of hbm memory error on TPU", "failed with hbm oom".
    "out of hbm",
    "hbm oom",
    # Compilation refused before it ran out: "Aborting compilation early because it's
    # unlikely to have enough memory. Requires 3.47E, has 14.49G available."
    "unlikely to have enough memory",
    # A launcher's report of a worker killed by SIGKILL, like torchrun's "exitcode: -9":
    # DeepSpeed's "[launch.py:320:sigkill_handler] [...] exits with return code = -9".
    "return code = -9",
    "return code -9",
    "exit code -9",
    "out of device memory",  # the same in words ("vmaAllocateMemory: out of device memory")
    "out of video memory",  # a renderer's "OUT OF VIDEO MEMORY! ( vmaAllocateMemory )"
    "out of video ram",  # the same, the GPU's memory called RAM ("out of GPU RAM": "out of gpu")
    "requested more gpu memory",  # NVIDIA's OpenGL dialog
    "not enough memory left",  # wgpu's DeviceError::OutOfMemory
    "--mem-fraction-static",  # SGLang's KV pool at start-up
    # OpenCL's calls, whose status by its number (-4, -5, -6) follows them; errors name
    # them, ordinary logs seldom do.
    "clenqueue",
    "clcreate",
    "clfinish",
    "clbuildprogram",
    "clwaitforevents",
    "cl_out_of_host_memory",  # OpenCL's host-memory status by name
    "returned error 10",  # NVIDIA's Video Codec SDK: "nvEncOpenEncodeSessionEx(...) returned error 10"
    "requires more system memory",  # Ollama: the model does not fit in system RAM
    "device memory allocation of size",  # ggml's Vulkan backend
    "execution failed: insufficient memory",  # MLX: "[METAL] Command buffer execution failed"
    "ptxas fatal",  # the CUDA compiler out of system RAM ...
    "died due to signal 9",  # ... or killed for it: "nvcc error : 'cicc' died due to signal 9"
    # The Linux kernel's OOM killer ("Out of memory: Killed process" has "out of memory"),
    # and a container's kill as Kubernetes and Docker report it.
    "killed process",
    "oom-kill",  # "oom-kill:constraint=...", "python3 invoked oom-killer:", "OOM-killed"
    "oomkilled",
    # ... and as a batch scheduler or a person tells of it: slurmstepd's "Detected 1
    # oom_kill event(s)", "killed by OOM killer", "OOM-killed on a large dataset".
    "oom_kill event",
    "oom killer",
    "oomkiller",
    "oom killed",
    # Thrust's exception carries CUDA's text: "std::bad_alloc: out of memory" (has
    # "out of memory"), thrown as thrust::system::detail::bad_alloc.
    "thrust::system::detail::bad_alloc",
    # cuDNN's status by its number after the call (cudnn.torch: "... failed: 2") has
    # "cudnn"; Vulkan's status without its VK_ prefix ("VK Error Code:
    # ERROR_OUT_OF_DEVICE_MEMORY") has "out_of_device_memory".
    # PyTorch's DataLoader: a worker SIGKILLed, or SIGBUS for want of shared memory.
    "killed by signal: killed",
    # Paddle's C++ exception by its name alone: "terminate called after throwing an instance
    # of 'paddle::memory::allocation::BadAlloc'".
    "memory::allocation::badalloc",
    # Host RAM run out, in a person's words: "I see CPU OOM errors during ...".
    "cpu oom",
    "cpu-oom",
    "killed by signal: bus error",
    "unexpected bus error",
    # AWS Neuron's runtime: 'nrt_tensor_allocate status=4 message="Allocation Failure"' (not
    # "status=4" alone: web logs are full of "status=404").
    "nrt_tensor_allocate",
    'message="allocation failure',
    "nrt_resource",  # AWS Neuron's runtime status NRT_RESOURCE
    "'nerr_resource'",  # ... and the older neuron-rtd's
    # Windows' E_OUTOFMEMORY (DirectML, Direct3D 12): its HRESULT, signed, by name, in words.
    "8007000e",
    "-2147024882",
    "e_outofmemory",
    "not enough memory resources",
    # Accelerate's batch-size search after every size ran out: "No executable batch size
    # found, reached zero."
    "no executable batch size found",
)

# Words of the wordings no family knows (families/generic.py). Logs that hold no OOM
# at all are full of them ("allocated", "not enough data"), so they never open a window
# of their own: only the line they are on is read, with the lines around it
# (:func:`weak_lines`), and only where the windows found no message.
WEAK_ANCHORS = (
    "enough",
    "insufficient",
    "exhausted",
    "alloc",
    "outof",
    "out-of-memory",  # prose: "I encountered an out-of-memory error when executing ..."
    " oom",
    "memory is full",
    "显存",
    "内存不",
)

CONTEXT_BEFORE_CHARS = 1500  # exception names, BFC stats dumps printed before the error
CONTEXT_AFTER_CHARS = 6000  # 15 "Process N has ..." clauses plus advice fit easily
LINE_SLACK_CHARS = 500  # how far to look for a line boundary at a window's edge
MAX_WINDOW_CHARS = 64 * 1024
MAX_WINDOWS = 32  # bounds the work on a log with thousands of OOM lines
MAX_HITS_PER_ANCHOR = 256
MIN_WRAP_WIDTH = 60
MAX_WEAK_LINES = 1024
MAX_WEAK_HITS_PER_ANCHOR = 4096
MAX_WEAK_LINE_CHARS = 1000
# The lines read on each side of a weak line for the device it is about.
WEAK_CONTEXT_LINES = CONTEXT_LINES

_LINE_PREFIXES = tuple(
    re.compile(p)
    for p in (
        r"^\s*\[rank\d+\]:\s?",
        # vLLM worker tags: "(EngineCore pid=207) ", "(VllmWorker rank=7 pid=10948) "
        r"^\s*\(\w+(?: rank=\d+)? pid=\d+\)\s",
        # vLLM/logging level + date + source: "ERROR 04-19 09:40:35 [core.py:1132] "
        r"^\s*(?:ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[?[\w.]+:\d+\]\s?",
        # Kubernetes' container log files (CRI): "2024-05-01T12:00:00.123456789Z stderr F "
        # (before the timestamps below, which would leave its stream and tag).
        r"^\s*\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)\s+(?:stdout|stderr)\s+[FP]\s",
        # syslog and journald: "May 01 12:00:00 gpu-host python[4242]: ", and journalctl's
        # short-iso "2024-05-01T12:00:00+0000 gpu-host python[4242]: "
        r"^\s*(?:[A-Z][a-z]{2}\s+\d{1,2}\s\d\d:\d\d:\d\d"
        r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?[+-]\d\d:?\d\d)"
        r"\s+[\w.-]+\s+[\w.@/-]+(?:\[\d+\])?:\s",
        # ISO-ish timestamps, optionally followed by a "|" column separator
        r"^\s*\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?\]?:?\s*(?:\|\s*)?",
        r"^\s*[\w.-]+-\d+\s+\|\s",  # docker compose: "vllm-1  | "
        r"^\s*SUBPROCESS:\s",
        r"^\s*\[(?:info|error|warning|debug)\]\s",  # Elixir logger
        r"^\s*>+\s?",  # e-mail / markdown quotes, Python REPL
        # "uniq -c" counts and pasted line numbers ("      2 [rank0]: ...", " 14 jpype..."),
        # indented, and never a wrapped figure ("1246069 has ...", "0 bytes is free").
        r"^\s+\d{1,7}\s+(?!has\b|is\b|(?:[KMGTPE]i?B|[Bb]ytes?|B)(?![A-Za-z]))(?=\S)",
        r"^\d{1,7}:(?=\[)",  # grep -n: "6507:[2025-09-02 05:37:31] ..."
        r"^\s*`+",
    )
)


# Terminal escape sequences: CSI (colours, "\x1b[1;35m"), OSC (titles, hyperlinks, ended by
# BEL or ST) and the two-character ones. Python 3.13 colours tracebacks on a terminal, and
# coloured loggers colour figures inside a message ("Tried to allocate \x1b[1m1.00 GiB").
_ESCAPES = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]{0,2048}(?:\x07|\x1b\\)?|[@-Z\\-_])|\x9b[0-?]*[ -/]*[@-~]"
)


def strip_escapes(text: str) -> str:
    """``text`` without terminal escape sequences (colour, titles, hyperlinks): the first
    repair, done on the whole text so that anchors and figures coloured apart match."""
    if "\x1b" not in text and "\x9b" not in text:
        return text
    return _ESCAPES.sub("", text)


def windows(text: str) -> list[list[str]]:
    """Repaired windows of ``text`` that contain an anchor word, in text order.

    Each window comes as one or two readings: with lines that look hard-wrapped
    re-joined, and (when that changed anything) without, because word-wrapped text
    can look hard-wrapped too; the parser keeps the reading that yields more.
    Overlapping windows are merged (up to :data:`MAX_WINDOW_CHARS`); at most
    :data:`MAX_WINDOWS` are returned, so the cost is bounded for any input.
    """
    spans = _merge(_anchor_spans(text, ANCHORS))
    readings = []
    for start, end in spans[:MAX_WINDOWS]:
        joined = repair(text[start:end])
        plain = repair(text[start:end], join_hard_wraps=False)
        readings.append([joined] if joined == plain else [plain, joined])
    return readings


def weak_lines(text: str, keep: Callable[[str], bool]) -> list[tuple[str, str, str, str]]:
    """Each line with a weak anchor on it that ``keep`` accepts as it stands, with the
    lines before and after it, each repaired, and the :data:`WEAK_CONTEXT_LINES` lines on
    each side of it (one text, repaired); in text order. ``keep`` is asked first (it
    spares the repairs of the lines it turns down), and its refusals do not count
    against the bounds: the first :data:`MAX_WEAK_HITS_PER_ANCHOR` lines of each anchor
    word are looked at, and at most :data:`MAX_WEAK_LINES` are returned."""
    lowered = text.lower()
    starts: set[int] = set()
    for anchor in WEAK_ANCHORS:
        pos = lowered.find(anchor)
        hits = 0
        while pos != -1 and hits < MAX_WEAK_HITS_PER_ANCHOR:
            starts.add(text.rfind("\n", 0, pos) + 1)
            hits += 1
            end = text.find("\n", pos)
            pos = -1 if end == -1 else lowered.find(anchor, end)
    pieces: list[tuple[str, str, str, str]] = []
    for start in sorted(starts):
        if len(pieces) == MAX_WEAK_LINES:
            break
        line = _line_at(text, start)
        if not keep(separate_scripts(line)):
            continue
        # start - 1 is the newline that ends the line before.
        previous = _line_at(text, text.rfind("\n", 0, start - 1) + 1) if start else ""
        after = text.find("\n", start)
        following = _line_at(text, after + 1) if after != -1 else ""
        around = _lines_before(text, start) + _lines_after(text, after)
        pieces.append(
            (repair(previous), repair(line), repair(following), repair("\n".join(around)))
        )
    return pieces


def _lines_before(text: str, start: int) -> list[str]:
    """The :data:`WEAK_CONTEXT_LINES` lines before the line that begins at ``start``."""
    lines: list[str] = []
    while start and len(lines) < WEAK_CONTEXT_LINES:
        start = text.rfind("\n", 0, start - 1) + 1
        lines.insert(0, _line_at(text, start))
    return lines


def _lines_after(text: str, end: int) -> list[str]:
    """The :data:`WEAK_CONTEXT_LINES` lines after the newline at ``end`` (-1: none)."""
    lines: list[str] = []
    while end != -1 and len(lines) < WEAK_CONTEXT_LINES:
        lines.append(_line_at(text, end + 1))
        end = text.find("\n", end + 1)
    return lines


def _line_at(text: str, start: int) -> str:
    """The line that begins at ``start``, cut at :data:`MAX_WEAK_LINE_CHARS`."""
    end = text.find("\n", start, start + MAX_WEAK_LINE_CHARS)
    return text[start : end if end != -1 else start + MAX_WEAK_LINE_CHARS]


def _anchor_spans(text: str, anchors: tuple[str, ...]) -> list[tuple[int, int]]:
    lowered = text.lower()
    hits: list[int] = []
    for anchor in anchors:
        pos = lowered.find(anchor)
        found = 0
        while pos != -1 and found < MAX_HITS_PER_ANCHOR:
            hits.append(pos)
            found += 1
            # Skip ahead a full window: later hits inside it add nothing.
            pos = lowered.find(anchor, pos + CONTEXT_AFTER_CHARS // 2)
    spans = []
    for pos in sorted(set(hits)):
        # Cut at line boundaries when one is near; a log without newlines is cut anyway.
        low = max(0, pos - CONTEXT_BEFORE_CHARS)
        start = text.rfind("\n", max(0, low - LINE_SLACK_CHARS), low) + 1 or low
        high = min(len(text), pos + CONTEXT_AFTER_CHARS)
        end = text.find("\n", high, high + LINE_SLACK_CHARS)
        spans.append((start, high if end == -1 else end))
    return spans


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1] and end - merged[-1][0] <= MAX_WINDOW_CHARS:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def repair(text: str, *, join_hard_wraps: bool = True) -> str:
    """Undo layout damage: line endings, literal ``\\n``, hard wraps, log prefixes, and
    English glued to text in a script written without spaces (:func:`separate_scripts`)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Rust/JSON debug strings carry the newlines as the two characters "\n".
    text = text.replace("\\n", "\n").replace("\\t", " ")
    text = text.translate(_PUNCTUATION).replace("**", "")
    lines = text.split("\n")
    if join_hard_wraps:
        lines = _join_hard_wraps(lines)
    return separate_scripts("\n".join(_strip_prefixes(line) for line in lines))


# Letters of the scripts written without spaces between words: CJK ideographs (and their
# radicals and compatibility forms), Japanese kana, Hangul syllables, Thai. Python's \b
# counts them as word characters, so an English phrase glued to them ("训练出现exits with
# return code = -9", "実行するとCUDA out of memoryが出ます") has no word boundary there.
_SPACELESS_SCRIPT = (
    "\u0e00-\u0e7f\u2e80-\u2fdf\u3040-\u30ff\u3100-\u312f\u3190-\u31ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
)
_GLUED = re.compile(
    rf"(?<=[{_SPACELESS_SCRIPT}])(?=[A-Za-z0-9_])|(?<=[A-Za-z0-9_])(?=[{_SPACELESS_SCRIPT}])"
)


def separate_scripts(text: str) -> str:
    """``text`` with a space wherever an ASCII letter or digit touches a letter of a script
    written without spaces: the one boundary rule for every family's English phrases, so
    each can keep ``\\b`` at its ends."""
    return text if text.isascii() else _GLUED.sub(" ", text)


_PUNCTUATION = str.maketrans(
    {"\u00a0": " ", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\t": " "}
)


def _join_hard_wraps(lines: list[str]) -> list[str]:
    """Re-join lines a terminal cut at a fixed width in the middle of a word.

    The width is the longest line length, if at least two lines have it; a line of
    that length is joined to the next without a space only when the cut falls
    between two letters or digits (a wrap at a space needs nothing: patterns
    accept any whitespace between words).
    """
    lengths = Counter(len(line) for line in lines)
    if not lengths:
        return lines
    width = max(lengths)
    if width < MIN_WRAP_WIDTH or lengths[width] < 2:
        return lines
    out: list[str] = []
    carry = ""
    for i, line in enumerate(lines):
        line = carry + line
        carry = ""
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if len(line) % width == 0 and line[-1:].isalnum() and nxt[:1].isalnum():
            carry = line
            continue
        out.append(line)
    if carry:
        out.append(carry)
    return out


def _strip_prefixes(line: str) -> str:
    # A line can carry several prefixes ("6507:[2025-09-02 05:37:31] ..."), so apply
    # the list until nothing changes (bounded: each pass removes at least a character).
    for _ in range(4):
        before = line
        for prefix in _LINE_PREFIXES:
            line = prefix.sub("", line, count=1)
        if line == before:
            break
    return line
