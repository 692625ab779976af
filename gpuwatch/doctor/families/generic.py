"""Any other wording: a line that says a GPU's (or another accelerator's) memory ran out.

The families read the wordings gpuwatch knows, with their figures. Every fresh sample
of real reports still turns up wordings none of them knows (a framework's own sentence,
a vendor library, a translation), and "not an OOM message I recognise" helps nobody
who pasted one. This fallback runs only on a window where no family, and no fallback
before it, found anything, and recognises a line (kind ``device``) that says both:

* that memory ran short: *out of memory* (``OutOfDeviceMemory``), *not enough* or
  *insufficient* memory, memory *exhausted*, ``显存不足``; or that an allocation failed:
  *failed* / *unable* / *cannot* / *could not allocate* (``Failed to cudaMalloc``), an
  allocation or an allocating call that *failed* (``bm_alloc_gmem failed``, ``Failure in
  vkAllocateMemory``), where the line names no other error (*illegal*, *invalid*, ...);
* where: a GPU, accelerator or GPU-API word (GPU, CUDA, VRAM, HBM, NPU, ROCm, Vulkan,
  OpenCL, DirectX, wgpu, ...) on the line or the one before, also inside an identifier
  (``cudaMalloc``, ``cuda_malloc``), or *device* there where neither line speaks of the
  host.

It does not recognise a line that says the program went on (*not a failure*, *falling
back*, *instead*, *retrying*, *skipping*, *reducing*, there or wrapped onto the next
line; or a warning, info or debug level), one that only supposes the failure (*if*, *in
case*, *to avoid* before it in its sentence), nor one that puts the memory elsewhere: on
the host (*pinned*, *host* or *system memory*, the OOM killer) or in a GPU's on-chip
*shared memory*, nor a diagnosis told to the reader (*your GPU does not have enough VRAM*).
Only figures the wording makes unambiguous are read: the size after
*allocate* (or ``size =``, hexadecimal included) and the device's index.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial

from gpuwatch.doctor.facts import Kind, OomFacts
from gpuwatch.doctor.families import tensorrt
from gpuwatch.doctor.families.clauses import (
    CONTEXT_LINES,
    SIZE,
    Found,
    exception_before,
    forecast,
    lines_around,
    size_of,
)
from gpuwatch.doctor.units import SIZE_PATTERN, size_to_bytes

# Memory said to be short, in words.
# The GPU's memory called RAM: "GPU RAM", "video RAM" ("Not enough GPU RAM free (3686MB
# free, need at least 4122MB)"). RAM alone is the host's.
_GPU_RAM = r"(?:gpu|video|graphics)[\s_-]?ram"
# ... and its memory abbreviated after an accelerator word ("Not enough GPU mem!", "out of
# VRAM mem", "insufficient device mem"): "mem" alone is any memory.
_GPU_MEM = r"(?:gpu|video|graphics|vram|device|cuda|card)[\s_-]?mem\b"
_SHORT = re.compile(
    # Not "memoryless"; "OutOfMemoryError", "OutOfDeviceMemory", "OUTOFVIDEOMEMORY" are
    # the same words, and the last two say where.
    r"out[\s_-]?of[\s_-]?(?P<where>(?:device|gpu|video|graphics|vram|hbm)[\s_-]?)?memory(?-i:(?![a-z]))"
    rf"|out[\s_-]of[\s_-](?P<where_ram>{_GPU_RAM}|{_GPU_MEM})\b"
    # "OOM" also right after text in another script ("在evaluate阶段会出现OOM"), where \b sees
    # no boundary: only an ASCII letter or digit around it disqualifies it.
    r"|(?<![A-Za-z0-9_])OOM(?![A-Za-z0-9_])"
    rf"|(?:\bnot|n't)\s+(?:have\s+|had\s+)?enough\s+(?:[\w-]+\s+){{0,3}}?(?:memory|vram|hbm|{_GPU_RAM}|{_GPU_MEM})\b"
    rf"|\binsufficient\s+(?:[\w-]+\s+){{0,3}}?(?:memory|vram|hbm|{_GPU_RAM}|{_GPU_MEM})\b"
    rf"|\b(?:memory|vram|{_GPU_RAM}|{_GPU_MEM})\s+(?:is\s+|was\s+)?(?:insufficient|exhausted|full)\b"
    r"|\bexhausted\s+(?:[\w-]+\s+){0,2}?memory\b"
    r"|显存不足|显存不够|显存溢出|内存不足|内存不够",
    re.IGNORECASE,
)
# An allocation said to have failed: a word or an identifier that allocates ("allocate",
# "cudaMalloc", "vkAllocateMemory", "bm_alloc_gmem") next to a failure.
_ALLOCATES = r"\w*?alloc\w*"
_ALLOC_FAILED = re.compile(
    rf"\b(?:failed|unable|cannot|can't|could\s+not|couldn't)\s+(?:to\s+)?{_ALLOCATES}"
    rf"|(?:\b|_){_ALLOCATES}\s+(?:[\w-]+\s+){{0,3}}?(?:fail(?:ed|ure|s)?|error)\b"
    r"|alloc\w*?_(?:error|fail\w*)"
    rf"|\bfail(?:ed|ure)\s+in\s+{_ALLOCATES}",
    re.IGNORECASE,
)
# ... unless the line names an error that is not about memory: then the allocation is
# where that error surfaced ("cudaMalloc failed: an illegal memory access").
_OTHER_ERROR = re.compile(
    r"illegal|invalid|initiali[sz]|launch|not\s+supported|no\s+(?:cuda-capable\s+)?device"
    r"|unknown\s+error|not\s+permitted|timed?\s*out|misaligned|unspecified",
    re.IGNORECASE,
)


def _words(alternatives: str) -> str:
    """``alternatives`` (any case) as whole words, also inside identifiers: at a word's
    start or a camelCase hump ("cudaMalloc", "cuda_malloc", "DiscreteGpu"), never inside a
    longer lower-case word ("gpustat", "relationship")."""
    return rf"(?:(?<![A-Za-z])|(?<=[a-z])(?=[A-Z]))(?i:{alternatives})(?![a-z])"


# Words that put the memory on a GPU or another accelerator, or on its API.
_ACCELERATOR = re.compile(
    _words(
        r"gpus?|cuda|vram|hbm|npus?|tpus?|xpus?|dcu|mlu|ipu|hpu|musa|rocm|hip|nvidia|geforce"
        r"|radeon|tesla|metal|mps|vulkan|opencl|sycl|oneapi|directml|dml|direct3d|d3d\d*|w(?:eb)?gpu"
        r"|directx|directdraw|dderr|optix|accelerator|graphics\s+card|video\s+memory"
        # A card named by its model, as users write it: "gtx 1660ti", "RTX4090", "rx 6800".
        r"|gtx|rtx|quadro|rx\s?\d{3,4}"
    )
    + r"|(?<![A-Za-z])vk(?=[A-Z])|gmem|显存|显卡"
)
# "device" counts too, unless the line is about the host's memory.
_DEVICE = re.compile(r"\bdev(?:ice)?(?:_?id)?\b", re.IGNORECASE)
_HOST = re.compile(r"\b(?:CPU|host|system|RAM|swap|disk)\b|no\s+space\s+left", re.IGNORECASE)
# Memory the line itself puts elsewhere than the device's memory, whatever else it names:
# the host's ("ggml_cuda_host_malloc: failed to allocate ... of pinned memory", NumPy's
# "Unable to allocate 3.2 GiB for an array with shape", the kernel's OOM killer) or a
# GPU's on-chip shared memory (a kernel's launch limit, not its memory).
_ELSEWHERE = re.compile(
    r"\bpinned\b|_host_|\b(?:host|system|CPU)\s+(?:memory|RAM)\b|for\s+an\s+array\s+with\s+shape"
    r"|oom[\s_-]?kill|\bcgroup|shared\s+memory",
    re.IGNORECASE,
)
# A fixed region, arena or plan too small for what was put in it: a capacity check, not
# the device's memory running out ("storage allocation failure, attempted to allocate
# 16785408 at offset 0 in region that is 16777216bytes", "Check failed: (offset +
# needed_size <= this->buffer.size) is false", DeepSpeed's "num_elems 1024 > buffer 512").
_PLANNED_REGION = re.compile(
    r"\bin\s+(?:a\s+|the\s+)?(?:region|buffer|arena|pool|slab|chunk)\s+(?:that\s+is|of(?:\s+size)?)\s+\d"
    r"|\bat\s+offset\s+\d+\s+in\b"
    r"|Check\s+failed:\s*\([^()\n]{0,120}<=?[^()\n]{0,80}\b(?:size|capacity|len)\w*\s*\)"
    r"|\bnum_elems\s+\d+\s*>\s*buffer\b",
    re.IGNORECASE,
)
# A line a program printed for an error: it opens with the error's label or its type
# ("Fail: Unexpected error: matxException (...)", "Uncaught exception: Could not allocate
# memory: ...", "RuntimeError: ...", "[ERROR] ...").
_ERROR_LINE = re.compile(
    r"\W{0,4}(?:[\w.:]*(?:Error|Exception|Failure)\b"
    r"|(?i:error|exception|uncaught|unhandled|fatal|critical|fail(?:ed|ure)?|abort(?:ed|ing)?"
    r"|panic|terminate)\b)"
)
# The program said it went on: a warning, a fallback, a retry.
_WENT_ON = re.compile(
    r"not\s+a\s+failure|fall(?:ing)?\s*back|\binstead\b|\bretry(?:ing)?\b|attempting\s+to\s+free"
    r"|\bskipping\b|\breducing\b",
    re.IGNORECASE,
)
# A diagnosis told to the reader about their hardware ("Unfortunatly your GPU does not have
# enough VRAM for training. 4 GB is too low."): what it can hold, not a failure met.
_YOUR_HARDWARE = re.compile(
    r"\byour\s+(?:[\w-]+\s+){0,2}?(?:gpus?|cards?|graphics\s+card|device|machine|system|hardware)"
    r"\s+(?:does\s*n[o']t|do\s*n[o']t|has\s+not|hasn't|lacks|won't)\b",
    re.IGNORECASE,
)
# PyTorch's exception name is the PyTorch family's to read: cut short ("torch.cuda.
# OutOfMemoryError: CUDA o"), it is not another wording.
_PYTORCH_NAME = re.compile(r"\btorch\.(?:cuda\.)?OutOfMemory")
# The failure's words inside the name of code that tests for or handles one
# ("is_cuda_out_of_memory does not work reliably", "handle_oom", "catch_out_of_memory"):
# the identifier's start, right before the failure.
_HANDLER_NAME = re.compile(
    r"\b(?:is|has|check|handle|catch|detect|maybe|should|on|retry|with)_\w*$",
    re.IGNORECASE,
)
_LEVEL = re.compile(
    r"(?:^|[\s\[|(])(?:WARN(?:ING)?|INFO|DEBUG|TRACE)\b|\b(?i:level=(?:warn\w*|info|debug))\b"
    r"|^\s*\[?[WwIi]\s?\d{4}\b"
    # TensorRT's and TensorRT-LLM's one-letter levels: "[TRT] [W] ...", "[TRT-LLM] [I] ...".
    r"|\[[WIVD]\]"
)
# "allocate 2.00 GiB", "allocating 512MB", "size = 0xc0fb4000", "size: 6529024".
_REQUESTED = re.compile(
    r"\balloc\w*\s+(?:of\s+)?(?:size\s+)?" + SIZE
    + r"|\bsize\s*[=:]\s*(?:(?P<hex>0x[0-9a-fA-F]+)|(?P<plain>\d{4,})(?![\d.]|\s*[KMGTPkmgtp]))"
)  # fmt: skip
# What the line says was free, and what it needed: "(3686MB free, need at least 4122MB)".
# A number is matched from its first digit only (the lookbehind): tried from every digit of
# a long one, the pattern would cost its length squared.
_FREE = re.compile(r"(?<![\d,.])" + SIZE_PATTERN + r"\s+(?:free|available)\b")
_NEEDED = re.compile(r"\bneed(?:s|ed)?\s+(?:at\s+least\s+)?" + SIZE_PATTERN)
_INDEX = re.compile(
    r"(?:\bGPU|\bdevice|\bdev(?:_?id)?|\bcard|\b(?:cuda|npu|xpu|hip|mlu|tpu))\s*[#:=]?\s*(\d{1,3})\b",
    re.IGNORECASE,
)
_VENDORS = tuple(
    (name, re.compile(_words(words)))
    for name, words in (
        (
            "cuda",
            r"cuda|nvidia|geforce|tesla|cuda:\d+|gtx|rtx|quadro|[ahv]100|[hb]200|a[4-6]000|l40s?",
        ),
        ("hip", r"rocm|hip|radeon|amd|rx\s?\d{3,4}"),
        ("npu", r"npu|ascend"),
        ("tpu", r"tpu"),
        ("xpu", r"xpu"),
        ("mlu", r"mlu"),
        ("musa", r"musa"),
    )
)
# A framework's own tag on the line (or the one before) makes a wording this fallback reads
# that framework's failure: "[TRT-LLM] [E] ... insufficient GPU memory" is TensorRT-LLM's,
# whatever its words. (tag, kind, category, device type), the first tag found wins.
_FRAMEWORK_TAGS: tuple[tuple[re.Pattern[str], Kind, str, str], ...] = (
    (tensorrt.LLM_TAG, "tensorrt", "tensorrt_llm_out_of_memory", "cuda"),
    (tensorrt.TAG, "tensorrt", "tensorrt_out_of_memory", "cuda"),
)
MAX_LINE_CHARS = 2000


def find(window: str) -> list[Found]:
    """The first line of ``window`` that says an accelerator's memory ran out."""
    lines = [line[:MAX_LINE_CHARS] for line in window.split("\n")]
    offset = 0
    for n, line in enumerate(lines):
        start, offset = offset, offset + len(line) + 1
        previous = lines[n - 1] if n else ""
        following = lines[n + 1] if n + 1 < len(lines) else ""
        at = _failure_at(line, previous, following, partial(_around, lines, n))
        if at is not None:
            exception = exception_before(window, start + at)
            return [Found(start, _facts(line, previous, exception, _around(lines, n)))]
    return []


def says_failed_at(window: str, pos: int) -> bool:
    """Whether the line of ``window`` that holds ``pos`` says, as this fallback reads it,
    that the device's memory ran out (another family's check of a loose wording)."""
    begin = window.rfind("\n", 0, pos) + 1
    end = window.find("\n", pos)
    end = len(window) if end == -1 else end
    before = window.rfind("\n", 0, max(0, begin - 1)) + 1
    after = window.find("\n", end + 1)
    after = len(window) if after == -1 else after
    # Each cut at MAX_LINE_CHARS as it is sliced: a copy of a 64 KiB line per match would
    # cost the line's length for every match on it.
    previous = window[before : min(begin - 1, before + MAX_LINE_CHARS)] if begin else ""
    following = window[end + 1 : min(after, end + 1 + MAX_LINE_CHARS)] if end < len(window) else ""
    line = window[begin : min(end, begin + MAX_LINE_CHARS)]
    return (
        _failure_at(line, previous, following, lambda: lines_around(window, begin, end)) is not None
    )


# Levels below a warning: a line logged at one reports something the program handled.
_QUIET_LEVEL = re.compile(
    r"(?:^|[\s\[|(])(?:INFO|DEBUG|TRACE)\b|\b(?i:level=(?:info|debug))\b|^\s*\[?I\s?\d{4}\b"
)


def went_on_at(window: str, pos: int) -> bool:
    """Whether the line of ``window`` that holds ``pos`` says the program went on after it
    (*retrying*, *falling back*, *reducing*, ...) at an info or debug level: a handled
    failure logged, not the one that ended the run."""
    begin = window.rfind("\n", 0, pos) + 1
    end = window.find("\n", pos)
    line = window[begin : min(len(window) if end == -1 else end, begin + MAX_LINE_CHARS)]
    return bool(_WENT_ON.search(line) and _QUIET_LEVEL.search(line))


def _around(lines: list[str], n: int) -> str:
    """The :data:`CONTEXT_LINES` lines before ``lines[n]`` and after it."""
    return "\n".join(lines[max(0, n - CONTEXT_LINES) : n] + lines[n + 1 : n + 1 + CONTEXT_LINES])


def read_line(line: str, previous: str, following: str, around: str = "") -> OomFacts | None:
    """``line``, between the lines around it, as a message, or None (the parser's read
    of a line whose only anchor words are weak ones: text.py, ``weak_lines``; ``around``:
    the :data:`CONTEXT_LINES` lines on each side)."""
    line, previous = line[:MAX_LINE_CHARS], previous[:MAX_LINE_CHARS]
    at = _failure_at(line, previous, following[:MAX_LINE_CHARS], lambda: around)
    if at is None:
        return None
    exception = exception_before(f"{previous}\n{line}", len(previous) + 1 + at)
    return _facts(line, previous, exception, around)


# Every line _SHORT or _ALLOC_FAILED matches holds one of these (lower-cased): a
# substring test spares the patterns most lines of a long log.
_KEYWORDS = ("mem", "alloc", "oom", "vram", "hbm", "ram", "显存", "内存")


def says_failure(line: str) -> bool:
    """Whether ``line`` says memory ran short or an allocation failed (anywhere: the
    cheap first test of :func:`read_line`)."""
    return _failure(line) is not None


def _failure(line: str) -> re.Match[str] | None:
    """Where ``line`` says memory ran short, or else that an allocation failed."""
    lowered = line.lower()
    if not any(word in lowered for word in _KEYWORDS):
        return None
    return _SHORT.search(line) or _ALLOC_FAILED.search(line)


def _failure_at(line: str, previous: str, following: str, around: Callable[[], str]) -> int | None:
    """Where in ``line`` it says the device's memory ran out, or None when it does not.
    ``around``: the lines near it, asked for only where the line and the one before
    name no accelerator."""
    failure = _failure(line)
    if failure is None or (failure.re is _ALLOC_FAILED and _OTHER_ERROR.search(line)):
        return None
    named = failure.re is _SHORT and (failure["where"] or failure["where_ram"])
    if not named and _PLANNED_REGION.search(line):
        return None
    if any(p.search(line) for p in (_WENT_ON, _LEVEL, _PYTORCH_NAME, _ELSEWHERE, _YOUR_HARDWARE)):
        return None
    # A sentence wrapped onto the next line may say there that the program went on.
    if _WENT_ON.search(following):
        return None
    # The status printed under a failure on memory elsewhere is that failure's: ggml's
    # "Failed to allocate pinned memory." then "vk::Device::allocateMemory: ErrorOut...".
    if _ELSEWHERE.search(previous) and _failure(previous) is not None:
        return None
    if forecast(line, failure.start()):  # supposed, forecast, none, or built in code
        return None
    if _HANDLER_NAME.search(line, max(0, failure.start() - 80), failure.start()):
        return None
    if named or _ACCELERATOR.search(line) or _ACCELERATOR.search(previous):
        return failure.start()
    # "device" (a weak word) on the line, or on the line before ("In Device::create_buffer"
    # then "Not enough memory left."), where neither line speaks of the host.
    if any(_DEVICE.search(text) for text in (line, previous)) and not any(
        _HOST.search(text) for text in (line, previous)
    ):
        return failure.start()
    # A device named a few lines away (a benchmark's header, "GPU: RTX 3060" in an issue
    # template), where the line is an error a program printed (prose about OOMs names
    # GPUs around it too) and does not speak of the host.
    if _ERROR_LINE.match(line) and not _HOST.search(line) and _ACCELERATOR.search(around()):
        return failure.start()
    return None


def _facts(line: str, previous: str, exception: str | None, around: str) -> OomFacts:
    where = line + "\n" + previous
    requested = _REQUESTED.search(line) or _NEEDED.search(line)
    free = _FREE.search(line)
    index = _INDEX.search(line)
    # The vendor the line names, or else one the lines around it name.
    device_type = next(
        (name for text in (where, around) for name, pattern in _VENDORS if pattern.search(text)),
        None,
    )
    kind: Kind = "device"
    # Without a vendor, whose tool lists the device's holders is not known either.
    category = "device_out_of_memory_other_wording" if device_type else "device_out_of_memory"
    tagged = next((tag[1:] for tag in _FRAMEWORK_TAGS if tag[0].search(where)), None)
    if tagged is not None:
        kind, category, device_type = tagged
    return OomFacts(
        kind=kind,
        category=category,
        exception=exception,
        device_type=device_type,
        device_index=int(index[1]) if index else None,
        requested_bytes=_requested_bytes(requested),
        free_bytes=size_to_bytes(free["num"], free["unit"]) if free else None,
        message=line.strip()[:4000],
    )


def _requested_bytes(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    if match.re is _REQUESTED and match["hex"]:
        return int(match["hex"], 16)
    if match.re is _REQUESTED and match["plain"]:
        return int(match["plain"])
    if match.re is _NEEDED:
        return size_to_bytes(match["num"], match["unit"])
    return size_of(match)
