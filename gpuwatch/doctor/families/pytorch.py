"""PyTorch's own OOM messages: the caching allocator (every wording since 1.0), the
cudaMallocAsync backend, and the legacy THC ``cuda runtime error (2)``.

Wordings (docs/doctor.md has the timeline and the sources):

* 1.0-2.0, parenthesised: ``Tried to allocate X (GPU n; T total capacity; A already
  allocated; F free; [M allowed; ]R reserved in total by PyTorch)``; before 1.4 the last
  clause was ``C cached``, which is reserved-but-unallocated (it can be below A).
* 2.1+, sentences: ``Tried to allocate X. GPU n has a total capac[i]ty of T of which F is
  free. [Process P has U memory in use. ]* [Including non-PyTorch memory, this process
  has U memory in use. ][M allowed; ]Of the allocated memory A is allocated by PyTorch,
  [with P allocated in private pools (e.g., CUDA Graphs), ]and R is reserved by PyTorch
  but unallocated.`` The same sentences on ROCm (``HIP out of memory``) and XPU.
* Out-of-tree devices (Ascend ``NPU``, Moore Threads ``MUSA``, Cambricon ``MLU``, ...)
  ship a copy of the caching allocator and print its messages with their own device
  word (``NPU out of memory. Tried to allocate 22.00 MiB (NPU 0; 60.97 GiB total
  capacity; ...``): any upper-case device word before ``out of memory. Tried to
  allocate`` is read the same way. Cut right after ``out of memory`` (an issue title),
  only the device words PyTorch and those backends use are trusted.
* cudaMallocAsync: ``Allocation on device n would exceed allowed memory. (out of memory)``
  followed by a ``Currently allocated / Requested / Device limit / Free / PyTorch limit``
  table.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import Kind, OomFacts, ProcessUse
from gpuwatch.doctor.families import generic
from gpuwatch.doctor.families.clauses import (
    SIZE,
    Found,
    Span,
    compile_clause,
    exception_before,
    line_end,
    line_lookback,
    size_of,
    spans,
)
from gpuwatch.doctor.units import ABSURD_REQUEST_BYTES, parse_size

# The device words of PyTorch and of the out-of-tree backends that copy its allocator.
_DEVICE_WORDS = r"CUDA|HIP|XPU|NPU|MUSA|MLU|GCU|DCU|SDAA"
_HEADER = re.compile(
    # A known device word even glued to what comes before ("whyCUDA out of ..."), or any
    # upper-case word.
    rf"(?:(?:(?P<dev>{_DEVICE_WORDS}|\b[A-Z][A-Z0-9]{{1,7}})\s+out\s+of\s+memory\.?"
    # IPEX's per-allocation limit: "Current platform can NOT allocate memory block with
    # size larger than 4GB! Tried to allocate ..." (an XPU-only message).
    r"|(?P<ipex>(?:Current\s+platform\s+)?can\s+NOT\s+allocate\s+memory\s+block\s+with\s+size\s+larger\s+than\s+"
    r"(?=\S)(?P<cap>\d+(?:\.\d+)?[KMGT]i?B)?\S*)"
    # The exception's name right before it: a message quoted without its first sentence.
    r"|(?P<named>OutOfMemoryError:))\s+"
    # No head at all, the 1.x figures right after the size: "Tried to allocate 20.00 MiB
    # (GPU 0; 1.96 GiB total capacity; ...)". The parenthesis is the allocator's own.
    r"|(?P<bare>(?=Tried\s+to\s+allocate\s+\S+(?:\s+[KMGT]?i?B)?\s+\(\s*(?P<paren>[A-Z]{2,5})\s+\d+\s*;)))"
    r"Tried\s+to\s+allocate\b"
)
# The first line alone ("RuntimeError: MUSA out of memory", an issue title), for the
# device words above only: "GPU out of memory" alone could be anyone's wording. Read
# only where no family found a whole message (:data:`~gpuwatch.doctor.families.FALLBACKS`):
# other families' wordings start the same way ("CUDA out of memory occurred when warming
# up sampler", vLLM's).
# In any case: issue text writes "cuda out of memory" as often as the exception does, and
# right after text in another script ("就会出现cuda out of memory"), where \b sees no
# boundary: only an ASCII letter or digit before the word disqualifies it, and likewise
# after it ("遇到过cuda out of memory的情况？", a title that goes on in Chinese).
# PyTorch's exception name alone at the end of a line ("45G显存也报错OutOfMemoryError", a
# title) says the same; Java's java.lang.OutOfMemoryError (a dotted name other than
# torch's) and any name followed by its message are not this. Jupyter and IPython head a
# traceback with the name alone, the message only at its end (which may not be pasted):
# "OutOfMemoryError                          Traceback (most recent call last)".
#
# Issue text also writes the device word and the rest in its own case ("CUDA OUT OF
# MEMORY", a title's "Cuda Out of Memory"), and shortens it: "CUDA OOM", "Cuda oom error"
# (users' name for the same exception; "OOM" alone, with no device word, is anyone's).
#
# PyTorch's qualified name, unlike the bare one (Java's too), names this failure wherever
# it stands as a token: ComfyUI's error toast pasted as one line ("torch.OutOfMemoryError 3
# KSampler torch.OutOfMemoryError Allocation on device"), "I get torch.OutOfMemoryError when
# I run KSampler". Not where code handles it or prose describes the type (_NAME_IN_CODE_*,
# _NAME_DESCRIBED_BEFORE, _NAME_DEFINED_AFTER), and not followed by a colon: then its
# message says what it is, and is read for itself ("torch.cuda.OutOfMemoryError: CUDA o",
# cut short, is no wording).
_FIRST_LINE = re.compile(
    rf"(?<![A-Za-z0-9_])(?P<dev>(?i:{_DEVICE_WORDS}))\s+(?i:out\s+of\s+memory|(?P<oom>oom))(?![A-Za-z0-9_])"
    r"|(?P<name>(?:(?<![\w.])(?:torch\.(?:cuda\.)?)?|(?<=[^\x00-\x7f]))OutOfMemoryError)"
    r"(?:[ \t]*$|[ \t]+Traceback\s+\(most\s+recent\s+call\s+last\))"
    r"|(?P<qualified>(?<![\w.])torch\.(?:cuda\.)?OutOfMemoryError)(?![\w.]|[ \t]*:)",
    re.MULTILINE,
)
# The qualified name in code, or in prose about handling it: caught, tested for, raised by
# hand, called, passed, assigned ("except (RuntimeError, torch.OutOfMemoryError) as e:",
# "isinstance(e, torch.cuda.OutOfMemoryError)", "retry on torch.OutOfMemoryError").
_NAME_IN_CODE_BEFORE = re.compile(
    r"(?:\bexcept\b|\bcatch(?:es|ing)?\b|\bisinstance\s*\(|\braises?\b|\bpytest\.raises\b"
    r"|\bhandl(?:e|es|ing)\b|\bretr(?:y|ies|ying)\s+on\b)[^\n]{0,40}$"
    r"|[(,=\[][ \t]*[`'\"]?$",
    re.IGNORECASE,
)
_NAME_IN_CODE_AFTER = re.compile(r"[`'\"]?[ \t]*(?:[(),=\]]|as\s+\w)")
# The type described rather than met: after an article or a determiner ("it's a plain
# `torch.cuda.OutOfMemoryError` a bit further down", a pull request's account of what users
# see) or a relation between types ("an alias of torch.OutOfMemoryError"), or the subject
# of a definition ("torch.OutOfMemoryError is a subclass of ..."); not where the teller met
# it ("I get a torch.OutOfMemoryError", "it threw a ...").
_NAME_DESCRIBED_BEFORE = re.compile(
    r"\b(?:a|an|the|any|this|that|plain|clean|generic|proper"
    r"|(?:alias|subclass|instance|type|kind|variant)\s+of|instead\s+of|in\s+favou?r\s+of"
    r"|same\s+as|renamed\s+to)\s+[`'\"]?$",
    re.IGNORECASE,
)
_NAME_MET_BEFORE = re.compile(
    r"\b(?:get|gets|got|getting|hit|hits|hitting|see|saw|seeing|encounter(?:s|ed|ing)?"
    r"|r[au]n(?:ning)?\s+into|throws|threw|raised|gives|gave|shows|showed|reported"
    r"|(?:crash|fail)(?:s|ed|ing)?\s+with)\s+(?:\w+\s+){0,2}?[`'\"]?$",
    re.IGNORECASE,
)
# ... or of what the type is for: "torch.cuda.OutOfMemoryError is raised when the allocator
# cannot ...", "... gets thrown if", "... can be raised by".
_NAME_DEFINED_AFTER = re.compile(
    r"[`'\"]?\s+(?:(?:is|are)\s+(?:a|an|the|now|just|also|only|not)\b"
    r"|(?:is|are|gets?|(?:will|can|may|might|would|should)\s+be)\s+(?:raised|thrown)\b)",
    re.IGNORECASE,
)
NAME_LOOKBACK_CHARS = 120
_REQUESTED = compile_clause(r"Tried\s+to\s+allocate\s+")
_ABSURD = re.compile(r"Tried\s+to\s+allocate\s+more\s+than\s+1EB")
_SENTENCE_GPU = re.compile(r"\b[A-Z]{2,5}\s+(\d+)\s+has\s+(?:a\s+)?total\b")
# The 1.x wording puts its figures in parentheses after the size; without those
# clauses (2.1+ sentences, or a message cut right after the size) it is the new form.
_PAREN_FORM = re.compile(r"\(\s*[A-Z]{2,5}\s+\d+\s*;|total\s+capacity\s*;|already\s+allocated")
_PAREN_GPU = re.compile(r"\(\s*[A-Z]{2,5}\s+(\d+)\s*;")
# "has a total capacity of T" (and PyTorch's "capacty" typo), or a paraphrase's "has total T".
_SENTENCE_TOTAL = compile_clause(r"has\s+(?:a\s+)?total\s+(?:capaci?ty\s+of\s+)?")
_SENTENCE_FREE = compile_clause(r"of\s+which\s+", r"\s+is\s+free")
_PAREN_TOTAL = compile_clause("", r"\s+total\s+capacity")
_PAREN_ALLOCATED = compile_clause("", r"\s+already\s+allocated")
_PAREN_FREE = compile_clause("", r"\s+free\b")
_PAREN_RESERVED = compile_clause("", r"\s+reserved\s+in\s+total")
_PAREN_CACHED = compile_clause("", r"\s+cached\b")
_ALLOWED = compile_clause("", r"\s+allowed\b")
_THIS_PROCESS = compile_clause(r"this\s+process\s+has\s+", r"\s+memory\s+in\s+use")
_OTHER_PROCESS = re.compile(rf"\bProcess\s+(?P<pid>\d+)\s+has\s+{SIZE}\s+memory\s+in\s+use")
_ALLOCATED = compile_clause(
    r"Of\s+the\s+allocated\s+memory\s+", r"\s+is\s+allocated\s+by\s+PyTorch"
)
_PRIVATE_POOLS = compile_clause(r"with\s+", r"\s+allocated\s+in\s+private\s+pools")
_RESERVED_UNALLOCATED = compile_clause("", r"\s+is\s+reserved\s+by\s+PyTorch\s+but\s+unallocated")
_ALLOC_CONF = re.compile(r"\b(PYTORCH_(?:[A-Z]{2,5}_)?ALLOC_CONF)\b")
_ADVICE = tuple(
    (re.compile(pattern), name)
    for pattern, name in (
        (r"expandable_segments", "expandable_segments"),
        (r"max_split_size_mb", "max_split_size_mb"),
        (r"use\s+`?empty_cache", "empty_cache"),
    )
)
_KIND_BY_DEVICE: dict[str, Kind] = {"cuda": "pytorch_allocator", "hip": "hip", "xpu": "xpu"}
# An out-of-tree device's copy of the allocator reads its own variable (torch_npu:
# PYTORCH_NPU_ALLOC_CONF), not PyTorch's CUDA one.
_OUT_OF_TREE_ALLOC_CONF = {
    word.lower(): f"PYTORCH_{word}_ALLOC_CONF"
    for word in _DEVICE_WORDS.split("|")
    if word.lower() not in _KIND_BY_DEVICE
}


def find(window: str) -> list[Found]:
    """Every PyTorch-allocator OOM message in ``window``, in order."""
    return [*_find_caching(window), *_find_async(window), *_find_thc(window)]


def find_first_line(window: str) -> list[Found]:
    """The allocator's first line with nothing after it, or PyTorch's qualified name in
    running text (a fallback: see _FIRST_LINE)."""
    found = []
    for span in spans(window, _FIRST_LINE, limit=400):
        header = _FIRST_LINE.match(window, span.start)
        assert header is not None
        # The shortened form is a person's (or a program's own log line), never the
        # exception's: read it only where the fallback for other wordings would read its
        # line as a failure (not a warning, a skipped batch, a retry, ...).
        if header["oom"] and not generic.says_failed_at(window, span.start):
            continue
        # The long form, too, is no failure on a line that says the program went on, at an
        # info or debug level ("INFO: Reducing batch size to 16 after CUDA out of memory;
        # retrying"): the fallback for other wordings' rule.
        if header["dev"] and generic.went_on_at(window, span.start):
            continue
        if header["qualified"] and (
            _name_not_met(window, span.start, header.end())
            # A message after the name on its line ("torch.OutOfMemoryError - HIP out of
            # memory") is read for itself: its device word, not the name, says where.
            or _FIRST_LINE.search(window, header.end(), line_end(window, header.end()))
        ):
            continue
        device_type = (header["dev"] or "cuda").lower()
        facts = _caching_facts(span, device_type, cut=True)
        name = header["name"] or header["qualified"]
        if name and facts.exception is None:
            facts.exception = name  # a Jupyter traceback's header, a name in running text
        found.append(Found(span.start, facts))
    return found


def _name_not_met(window: str, start: int, end: int) -> bool:
    """Whether the qualified name at ``window[start:end]`` is code or a description of the
    type rather than a failure met (see _FIRST_LINE)."""
    before = window[max(line_lookback(window, start), start - NAME_LOOKBACK_CHARS) : start]
    if _NAME_IN_CODE_BEFORE.search(before) or _NAME_IN_CODE_AFTER.match(window, end):
        return True
    if _NAME_DEFINED_AFTER.match(window, end):
        return True
    return bool(_NAME_DESCRIBED_BEFORE.search(before)) and not _NAME_MET_BEFORE.search(before)


def _find_caching(window: str) -> list[Found]:
    found = []
    for span in spans(window, _HEADER):
        header = _HEADER.match(window, span.start)
        assert header is not None  # spans() starts every span at a header match
        # A message headed by the exception alone is PyTorch's CUDA one; one headed by
        # nothing names its device in the parenthesis ("GPU 0" on CUDA, "NPU 2").
        if header["named"] is not None:
            device_type = "cuda"
        elif header["bare"] is not None:
            word = header["paren"]
            device_type = word.lower() if re.fullmatch(_DEVICE_WORDS, word) else "cuda"
        else:
            device_type = (header["dev"] or "XPU").lower()
        facts = _caching_facts(span, device_type)
        if header["ipex"] is not None:
            # The cap on one block, not the card's memory: the request is over it, whatever
            # is free (the message names the cap; 4 GB is the only one IPEX prints).
            facts.per_allocation_limit_bytes = parse_size(header["cap"] or "4GB")
        found.append(Found(span.start, facts))
    return found


def _caching_facts(span: Span, device_type: str, *, cut: bool = False) -> OomFacts:
    sentences = not span.has(_PAREN_FORM)
    cached = span.size(_PAREN_CACHED)
    requested = None if span.has(_ABSURD) else span.size(_REQUESTED)
    if cut:
        category = "pytorch_caching_allocator_oom_first_line"
    elif span.has(_ABSURD) or (requested is not None and requested >= ABSURD_REQUEST_BYTES):
        category = "pytorch_caching_allocator_oom_absurd_size"
    elif device_type == "xpu" and not sentences:
        category = "ipex_xpu_oom_v1"
    elif sentences:
        category = "pytorch_caching_allocator_oom_v2"
    elif cached is not None:
        category = "pytorch_caching_allocator_oom_v1_cached"
    else:
        category = "pytorch_caching_allocator_oom_v1"
    facts = OomFacts(
        kind=_KIND_BY_DEVICE.get(device_type, "pytorch_allocator"),
        category=category,
        exception=exception_before(span.text, span.start),
        device_type=device_type,
        requested_bytes=requested,
        allowed_bytes=span.size(_ALLOWED),
        alloc_conf_var=span.group(_ALLOC_CONF) or _OUT_OF_TREE_ALLOC_CONF.get(device_type),
        advice=next((name for pattern, name in _ADVICE if span.has(pattern)), None),
        message=span.snippet,
    )
    if sentences:
        facts.device_index = span.integer(_SENTENCE_GPU)
        facts.total_bytes = span.size(_SENTENCE_TOTAL)
        facts.free_bytes = span.size(_SENTENCE_FREE)
        facts.process_in_use_bytes = span.size(_THIS_PROCESS)
        facts.allocated_bytes = span.size(_ALLOCATED)
        facts.private_pools_bytes = span.size(_PRIVATE_POOLS)
        facts.reserved_unallocated_bytes = span.size(_RESERVED_UNALLOCATED)
        facts.other_processes = [
            ProcessUse(pid=int(m["pid"]), used_bytes=size_of(m))
            for m in _OTHER_PROCESS.finditer(span.text, span.start, span.end)
        ]
    else:
        facts.device_index = span.integer(_PAREN_GPU)
        facts.total_bytes = span.size(_PAREN_TOTAL)
        facts.allocated_bytes = span.size(_PAREN_ALLOCATED)
        facts.free_bytes = span.size(_PAREN_FREE)
        facts.reserved_bytes = span.size(_PAREN_RESERVED)
        facts.reserved_unallocated_bytes = cached
    return facts


_ASYNC_HEADER = re.compile(r"Allocation\s+on\s+device\b[ \t]*(?P<index>\d+)?")
# ComfyUI's own report follows a bare "Allocation on device" with "This error means you
# ran out of memory on your GPU."
_ASYNC_CONFIRM = re.compile(
    r"would\s+exceed\s+allowed\s+memory|ran\s+out\s+of\s+memory\s+on\s+your\s+GPU"
)
# ComfyUI's header for the exception a node raised, right before its text: a bare
# "Allocation on device" there (nothing after it on its line) is the allocator's
# out-of-memory.
_COMFY_RAISED = re.compile(r"Exception\s+during\s+processing\s*!!![ \t]*$")
_BARE_ASYNC = re.compile(r"Allocation\s+on\s+device[ \t]*\d*[ \t]*(?:\n|$)")
COMFY_LOOKBACK_CHARS = 80
_ASYNC_ALLOCATED = compile_clause(r"Currently\s+allocated\s*:\s*")
_ASYNC_REQUESTED = compile_clause(r"Requested\s*:\s*")
_ASYNC_LIMIT = compile_clause(r"Device\s+limit\s*:\s*")
_ASYNC_FREE = compile_clause(r"Free\s+\(according\s+to\s+CUDA\)\s*:\s*")
_ASYNC_PYTORCH_LIMIT = compile_clause(
    r"PyTorch\s+limit\s+\(set\s+by\s+user-supplied\s+memory\s+fraction\)\s*:\s*"
)


def _find_async(window: str) -> list[Found]:
    found = []
    for span in spans(window, _ASYNC_HEADER, limit=1000):
        exception = exception_before(window, span.start)
        # A bare "Allocation on device" (ComfyUI truncates its reports there) counts
        # only when the exception name, or ComfyUI's header for it, says so.
        raised_in_comfy = _BARE_ASYNC.match(window, span.start) and _COMFY_RAISED.search(
            window, max(0, span.start - COMFY_LOOKBACK_CHARS), span.start
        )
        if (
            not span.has(_ASYNC_CONFIRM)
            and "OutOfMemory" not in (exception or "")
            and raised_in_comfy is None
        ):
            continue
        header = _ASYNC_HEADER.match(window, span.start)
        assert header is not None
        facts = OomFacts(
            kind="pytorch_allocator",
            category="pytorch_cudamallocasync_oom",
            exception=exception,
            device_type="cuda",
            device_index=int(header["index"]) if header["index"] else None,
            allocated_bytes=span.size(_ASYNC_ALLOCATED),
            requested_bytes=span.size(_ASYNC_REQUESTED),
            total_bytes=span.size(_ASYNC_LIMIT),
            free_bytes=span.size(_ASYNC_FREE),
            allowed_bytes=span.size(_ASYNC_PYTORCH_LIMIT),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


_THC_ERROR = re.compile(r"cuda\s+runtime\s+err(?:or)?\s*\(\s*2\s*\)\s*:?\s*out\s+of\s+memory")
_THC_CHECK = re.compile(
    r"THCudaCheck\s+FAIL\s+file=\S*?(?P<file>\w+\.cu)\s+line=(?P<line>\d+)\s+error=2\b"
)
_THC_LOCATION = re.compile(r"\bat\s+\S*?(?P<file>\w+\.cu):(?P<line>\d+)")


def _find_thc(window: str) -> list[Found]:
    # The THCudaCheck line and the RuntimeError after it are one failure: report the
    # RuntimeError (it names the exception) and fall back to the check line alone.
    header = _THC_ERROR if _THC_ERROR.search(window) else _THC_CHECK
    found = []
    for span in spans(window, header, limit=600):
        location = _THC_LOCATION.search(span.text, span.start, span.end) or _THC_CHECK.search(
            span.text, span.start, span.end
        )
        facts = OomFacts(
            kind="pytorch_allocator",
            category="pytorch_thc_cuda_runtime_error",
            exception=exception_before(window, span.start),
            device_type="cuda",
            cuda_error="cudaErrorMemoryAllocation",
            cuda_error_code=2,
            source_location=f"{location['file']}:{location['line']}" if location else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
