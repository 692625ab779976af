"""Small building blocks the family parsers share: one clause, one size, one name.

A message is matched clause by clause inside its span rather than with one long
pattern, because real messages drop clauses (ROCm has no process list, XPU no
"free"), add them (``allowed;``, private pools) and get truncated anywhere.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import NamedTuple

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.units import SIZE_PATTERN, size_to_bytes

# A size, optionally followed by the exact byte count TensorFlow and XLA add:
# "90.48M (94873600 bytes)", "2.99GiB (3206250496B)".
SIZE = rf"{SIZE_PATTERN}(?:\s?\((?P<exact>\d+)\s?(?:bytes|B)\))?"


# A failure only forecast in the sentence that names it, whatever the family: a modal
# verb before it ("Allocating memory ... may produce VK_ERROR_OUT_OF_HOST_MEMORY",
# "Blender may display an error that reads 'System is out of GPU memory'"), an API's
# behaviour told in the future ("the driver will return OOM errors when ..."), or a
# change described in prose ("This commit adds the case for UR_RESULT_ERROR_OUT_OF_
# DEVICE_MEMORY ..."). A program logs what failed, not what an error may do. Left out
# on purpose: a negated modal ("could not allocate" is a failure); "will throw" or
# "would crash with", how a person tells of a failure they keep meeting; and verbs of
# causes ("what can lead to this error: ..."), how a person asks about one they met.
_FORECAST = re.compile(
    r"\b(?:may|might|can|could|should)\s+(?!not\b)(?:\w+\s+){0,2}?"
    r"(?:produce|display|show|throw|raise|return|report|fail\s+with)\b"
    r"|\b(?:will|would)\s+(?!not\b)(?:\w+\s+){0,2}?(?:return|produce|report)\b"
    # What an API is specified to return: "... doesn't allow to return ZE_RESULT_ERROR_
    # OUT_OF_DEVICE_MEMORY" (a specification's issue), "is permitted to return".
    r"|\b(?:allow(?:s|ed)?|permit(?:s|ted)?)\s+(?:\w+\s+){0,2}?to\s+return\b"
    # What a setting "can sometimes cause" (documentation), not "what can lead to this".
    r"|\b(?:may|might|can|could)\s+(?!not\b)(?:\w+\s+){0,2}?cause\b"
    # Advice told to the reader: "otherwise you will see a CUDA Out Of Memory (OOM) Error".
    r"|\byou\s+(?:will|would|may|might|can|could)\s+(?:\w+\s+){0,2}?"
    r"(?:see|get|hit|encounter|run\s+into|face)\b"
    r"|^\W*(?:this|the)\s+(?:commit|pr|pull\s+request|patch|change)\b"
    # A change's title that names what it fixes: "[SYCL]fix the B70 mem allocate error
    # when >19.3GB, can't allocate N Bytes of memory on device", "fix(test): ... pool OOM".
    r"|^\s*(?:\[[^\]\n]{1,30}\]\s*)?\W*(?:fix(?:es)?|work\s*around(?:\s+for)?)\b(?![-'])"
    # ... and a page's heading that names what it explains: "Understanding and Solving
    # PyTorch's CUDA Out-of-Memory Errors", "Troubleshooting CUDA out of memory".
    r"|^\W*(?:understanding|solving|fixing|debugging|troubleshooting|avoiding|preventing"
    r"|dealing\s+with|a\s+guide\s+to)\b",
    re.IGNORECASE,
)
# A failure only supposed ("If out-of-memory error occurs during cudagraph capture, ...",
# vLLM's start-up advice; "To avoid CUDA out of memory errors, ..."; "... to reduce the
# chance of CUDA out of memory errors"): one of these between the sentence's start (a
# line's start at the latest) and the failure.
_SUPPOSED = re.compile(
    r"\b(?:if|in\s+case|unless|whether|avoid|prevent|reduce\s+the\s+(?:chance|risk|"
    r"likelihood)\s+of"
    # ... or named as what a change or a page is about: "Mitigate CUDA OutOfMemory error",
    # "More hints on what to do with CUDA Out of memory errors" (a question keeps it).
    r"|mitigate|handling|hints?\s+(?:on|for)|tips?\s+(?:on|for)"
    r"|what\s+to\s+do\s+(?:with|about)|how\s+to\s+(?:fix|solve|avoid|resolve|handle))\b",
    re.IGNORECASE,
)
# A supposition answered, after its comma, by the failure met: "if use non blocking true,
# always display error RuntimeError: CUDA error: out of memory", "if the batch is 64, I
# get ...": every time, or the teller's own. Not "if it happens, you get ..." (advice).
_MET_AFTER_SUPPOSITION = re.compile(
    r",\s*(?:(?:then|and)\s+)?(?:(?:it|this)\s+)?(?:always|every\s+time|each\s+time"
    r"|I\s+(?:always\s+|still\s+)?(?:get|got|see|saw|hit|encounter(?:ed)?|run\s+into|ran\s+into))\b",
    re.IGNORECASE,
)
# The teller's own supposition, what they did ("If I try to use a batch size like 16 it
# starts training and after 10 iterations it throws a Cuda oom error"), answered by what
# the program did to them, with or without a comma: a report of a failure met each time.
_OWN_SUPPOSITION = re.compile(r"(?:if|when(?:ever)?)\s+I\b", re.IGNORECASE)
_MET_BY_TELLER = re.compile(
    r"\b(?:it|this|that)\s+(?:still\s+|always\s+|then\s+|just\s+)?"
    r"(?:throws|threw|gives|gave|shows|showed|raises|raised|reports|reported|crashes|crashed)\b",
    re.IGNORECASE,
)
# An indirect question is no supposition: "I was wondering if anybody was able to find
# where the problem is ... and it still gives me a cuda out of memory error".
_ASKS_IF = re.compile(
    r"\b(?:wonder(?:s|ed|ing)?|ask(?:s|ed|ing)?|know|sure|see|check(?:ed|ing)?)\s+$",
    re.IGNORECASE,
)
# An error's text compared with another's, the way a reply explains what a message means:
# 'to me reading "MPS backend out of memory..." is the same as reading "CUDA out of
# memory ..."'. The first quoted text is followed, once its quote closes, by the
# comparison; the second is preceded by it.
_COMPARED_AFTER = re.compile(
    r"[^\"'`\n]{0,200}[\"'`]\s*(?:is|are|means)\s+(?:just\s+|basically\s+)?"
    r"(?:the\s+same\s+(?:thing\s+)?as|equivalent\s+to|similar\s+to|like)\b",
    re.IGNORECASE,
)
_COMPARED_BEFORE = re.compile(
    r"\b(?:the\s+same\s+(?:thing\s+)?as|equivalent\s+to|similar\s+to)\s+"
    r"(?:reading\s+|seeing\s+|getting\s+)?[\"'`]$",
    re.IGNORECASE,
)
# A question put to the reader, an article's opening ("Have you ever been running a deep
# learning model in PyTorch, only to freeze when you encounter the dreaded "CUDA out of
# memory" error?"), and an error made the subject of a statement about it in general
# ('The frustrating "CUDA out of memory" error has become a rite of passage for deep
# learning engineers worldwide'): talk about the error, not a failure met.
_ASKS_READER = re.compile(
    r"^\W*(?:(?:have|had)\s+you\s+ever|ever\s+(?:been|seen|hit|had|got|gotten|encountered|wondered)"
    r"|do\s+you\s+(?:ever|keep|often)|are\s+you\s+(?:tired|struggling|still\s+getting))\b",
    re.IGNORECASE,
)
_GENERAL_STATEMENT_AFTER = re.compile(
    r"[^.!?\n]{0,60}?\b(?:errors?|exceptions?|messages?)[\"'`]?\s+"
    r"(?:(?:has|have)\s+become|is\s+(?:one\s+of\s+the|among\s+the|a\s+rite\s+of\s+passage"
    r"|the\s+most\s+common|a\s+common)|are\s+(?:among\s+the|the\s+most\s+common|common))\b",
    re.IGNORECASE,
)
# A failure denied right before its words: "Doesn't look to me like an obvious TPU OOM",
# "this is not a CUDA out of memory error", "It wasn't an OOM".
_DENIED_BEFORE = re.compile(
    r"(?:\b(?:does|do|did)\s*n[o']t|\bnot)\s+(?:[\w-]{1,12}\s+){0,3}?(?:look|seem|sound)s?\s+"
    r"(?:[\w-]{1,12}\s+){0,3}?like\s+(?:an?\s+|the\s+)?(?:[\w-]{1,20}\s+){0,3}$"
    r"|\b(?:is|was|are|were)(?:n't|\s+not)\s+(?:an?\s+|the\s+)?(?:[\w-]{1,20}\s+){0,3}$",
    re.IGNORECASE,
)
# A failure defined rather than met, right after its words in its sentence: "CUDA out of
# memory occurs when your GPU doesn't have enough memory ..." (a how-to page); not "...
# occurs when I run it", a person telling of one they met.
_DEFINED_AFTER = re.compile(
    r"[^.!?\n]{0,60}?\b(?:occurs?|happens?|arises?|is\s+(?:raised|thrown))\s+(?:when|if|because)"
    r"\s+(?:your|the|a|an|there|it|you)\b",
    re.IGNORECASE,
)
DEFINED_LOOKAHEAD_CHARS = 160
# A failure told of in general, not met: "When a CUDA OOM error occurs, PyTorch suggests
# ...": "when" (or "whenever") and an indefinite article right before the failure's
# words, and "occurs" (happens, is raised) after them in its clause. Not "When a second
# request arrives, RuntimeError: CUDA out of memory", where nothing says it in general.
_GENERIC_WHEN = re.compile(
    r"\bwhen(?:ever)?\s+(?:a|an|any)\s+(?:[\w-]{1,20}\s+){0,2}$", re.IGNORECASE
)
# Errors quoted as alternatives, a page's list of symptoms rather than a log: "Meet
# issue: `Native API failed. ... (PI_ERROR_OUT_OF_HOST_MEMORY)` or `failed to allocate
# SYCL0 buffer`" (llama.cpp's SYCL guide). The failure inside a quote that an "or" and
# another quote follow.
_QUOTE_OPEN = re.compile(r"`[^`\n]*$")
_OR_QUOTE_AFTER = re.compile(r"[^`\n]{0,300}`\s*(?:,\s*)?or\s+`")
_OR_QUOTE_BEFORE = re.compile(r"`\s*(?:,\s*)?or\s+`[^`\n]*$")  # ... or the last of them
_OCCURS_AFTER = re.compile(
    r"[^.!?\n,]{0,60}?\b(?:occurs?|happens?|arises?|is\s+(?:raised|thrown))\b", re.IGNORECASE
)
# A failure counted as none right before its words ("0 CUDA out of memory errors", "no out
# of memory", "without OOM").
_NONE_BEFORE = re.compile(
    r"(?:^|[^\w.])(?:no|zero|0|without|never)\s+(?:[\w-]{1,12}\s+){0,2}$", re.IGNORECASE
)
NONE_LOOKBACK_CHARS = 40
DENIED_LOOKBACK_CHARS = 80
# The failure's text only built in code (inside a string still open where the failure
# starts): an exception passed to a call ("is_cuda_out_of_memory(RuntimeError('CUDA
# error: out of memory'))"), where a log prints it ("RuntimeError: CUDA error: out of
# memory", or its repr after a colon). A ``raise`` is not such code: in a traceback it
# is the line that raised, and sometimes all of the failure a paste kept...
_IN_CODE = re.compile(
    r"\(\s*[\w.]*(?:Error|Exception)\(\s*[rbf]?['\"][^'\"\n]*$"
    # ... or named as a string that code looks for: "checks for the string `CUDA out of
    # memory.`", "matches the substring 'out of memory'".
    r"|\b(?:string|substring|regex|pattern)\s*[`'\"][^`'\"\n]*$",
    re.IGNORECASE,
)
# A question about the failure ("why would cudaMalloc return out of memory here?") is
# about one that happened: a sentence that starts with a question word and ends, after
# the failure, with a question mark ("When training ..., you will see ..." is advice).
_QUESTION = re.compile(r"^\W*(?:what|why|how|which|when|where|who)\b", re.IGNORECASE)
_SENTENCE_OR_QUESTION_END = re.compile(r"\n|[.!](?:\s|$)|\?")
# Where a sentence starts (for :func:`forecast`): after a line break or a sentence's end.
_SENTENCE_END = re.compile(r"\n|[.!?;]\s")
# How far back the sentence of a failure is looked for.
FORECAST_LOOKBACK_CHARS = 300


class Found(NamedTuple):
    """One message a family recognised: where it starts in the window, and its facts."""

    start: int
    facts: OomFacts


def forecast(text: str, start: int) -> bool:
    """Whether the sentence of ``text`` that leads to ``start`` (a failure a family or
    the fallback found) only forecasts it (``_FORECAST``) or supposes it
    (``_SUPPOSED``, unless the clause after the supposition meets it:
    ``_MET_AFTER_SUPPOSITION``), counts none of it (``_NONE_BEFORE``), defines it
    (``_DEFINED_AFTER``), or code only builds it (``_IN_CODE``)."""
    begin = max(0, start - FORECAST_LOOKBACK_CHARS)
    ends = _SENTENCE_END.finditer(text, begin, start)
    sentence = max((end.end() for end in ends), default=begin)
    told = text[sentence:start]
    if _IN_CODE.search(told) or _NONE_BEFORE.search(told[-NONE_LOOKBACK_CHARS:]):
        return True
    if _DENIED_BEFORE.search(told[-DENIED_LOOKBACK_CHARS:]):
        return True
    if _COMPARED_BEFORE.search(told) or _COMPARED_AFTER.match(text, start, start + 300):
        return True
    if _GENERAL_STATEMENT_AFTER.match(text, start, start + DEFINED_LOOKAHEAD_CHARS):
        return True
    if _ASKS_READER.search(told) and _asks(text, start):
        return True
    if _DEFINED_AFTER.match(text, start, start + DEFINED_LOOKAHEAD_CHARS):
        return True
    line = text[line_lookback(text, start) : start]
    if _QUOTE_OPEN.search(line) and (
        _OR_QUOTE_AFTER.match(text, start) or _OR_QUOTE_BEFORE.search(line)
    ):
        return True
    if _GENERIC_WHEN.search(told) and _OCCURS_AFTER.match(
        text, start, start + DEFINED_LOOKAHEAD_CHARS
    ):
        return True
    supposed = _SUPPOSED.search(told)
    while supposed is not None and _ASKS_IF.search(told, 0, supposed.start()):
        supposed = _SUPPOSED.search(told, supposed.end())
    if _FORECAST.search(told) is None and supposed is None:
        return False
    if (
        _FORECAST.search(told) is None
        and supposed is not None
        and (
            _MET_AFTER_SUPPOSITION.search(told, supposed.end())
            or (
                _OWN_SUPPOSITION.match(told, supposed.start())
                and _MET_BY_TELLER.search(told, supposed.end())
            )
        )
    ):
        return False
    return _QUESTION.search(told) is None or not _asks(text, start)


def _asks(text: str, start: int) -> bool:
    """Whether the sentence that holds ``start`` ends with a question mark."""
    end = _SENTENCE_OR_QUESTION_END.search(text, start, start + FORECAST_LOOKBACK_CHARS)
    return end is not None and end[0] == "?"


def size_of(match: re.Match[str]) -> int:
    """Bytes of the ``SIZE`` group in ``match``; the exact count wins when printed."""
    exact = match.groupdict().get("exact")
    if exact:
        return int(exact)
    return size_to_bytes(match["num"], match["unit"])


def table_row(label: str) -> re.Pattern[str]:
    """A row ``Label (GiB): N`` of a table that prints its unit once, after the label
    (TensorRT-LLM's ``Total GPU memory (GiB): 140.06``); ``label`` is regex source and may
    be followed by more words (``Free GPU memory before component creation attempt``)."""
    return re.compile(
        label + r"[^\n:()]{0,80}?\(\s*(?P<unit>[KMGTPE]i?B)\s*\)\s*:\s*(?P<num>\d[\d,]*(?:\.\d+)?)"
    )


def compile_clause(before: str, after: str = "") -> re.Pattern[str]:
    """A pattern ``before SIZE after``; ``before``/``after`` are regex source."""
    return re.compile(before + SIZE + after)


@dataclass(frozen=True)
class Span:
    """The part of a window that one message occupies: ``text[start:end]``."""

    text: str
    start: int
    end: int

    def size(self, clause: re.Pattern[str]) -> int | None:
        """Bytes of the first ``clause`` match in the span, or ``None``."""
        match = clause.search(self.text, self.start, self.end)
        return size_of(match) if match else None

    def group(self, pattern: re.Pattern[str], name: str | int = 1) -> str | None:
        """One group of the first ``pattern`` match in the span, or ``None``."""
        match = pattern.search(self.text, self.start, self.end)
        return match[name] if match else None

    def integer(self, pattern: re.Pattern[str], name: str | int = 1) -> int | None:
        value = self.group(pattern, name)
        return int(value.replace(",", "")) if value is not None else None

    def has(self, pattern: re.Pattern[str]) -> bool:
        return pattern.search(self.text, self.start, self.end) is not None

    @property
    def snippet(self) -> str:
        return self.text[self.start : self.end].strip()[:4000]

    @property
    def line_start(self) -> int:
        """Where the line the span starts on begins (what a message's prefix sits on)."""
        return line_start(self.text, self.start)

    @property
    def line_lookback(self) -> int:
        """Where a pattern that reads the span's line before it starts (:func:`line_lookback`)."""
        return line_lookback(self.text, self.start)


def line_start(text: str, pos: int) -> int:
    """Index of the first character of the line that holds ``pos``."""
    return text.rfind("\n", 0, pos) + 1


# How far back a pattern reads the line before a match (the exception's name, a logger's
# origin, a source file, a level). Messages start at most a few hundred characters into
# their line (500 in every corpus); unbounded, every match on a line of 64 KiB (a log
# with no newlines, or hard-wrapped lines joined into one) would have a pattern read the
# whole line before it: the number of matches times the line's length.
MAX_LINE_LOOKBACK_CHARS = 2048


def line_lookback(text: str, pos: int) -> int:
    """Where a pattern that reads the line before ``pos`` starts: the line's start, or
    :data:`MAX_LINE_LOOKBACK_CHARS` before ``pos`` on a longer line."""
    low = max(0, pos - MAX_LINE_LOOKBACK_CHARS)
    return text.rfind("\n", low, pos) + 1 or low


def line_end(text: str, pos: int) -> int:
    """Index just past the last character of the line that holds ``pos``."""
    end = text.find("\n", pos)
    return len(text) if end == -1 else end


# How many lines on each side of a failure may name the device it is about: a report
# names it in a header, a title or an issue template's "GPU:" field a few lines away.
CONTEXT_LINES = 3
# ... each side cut at this many characters, so a long line costs no more.
MAX_CONTEXT_CHARS = 6000


def lines_around(text: str, begin: int, end: int) -> str:
    """The :data:`CONTEXT_LINES` lines before the line ``text[begin:end]`` and after it
    (without it), each side cut at :data:`MAX_CONTEXT_CHARS`."""
    low = begin
    for _ in range(CONTEXT_LINES):
        low = text.rfind("\n", 0, max(0, low - 1)) + 1 if low else 0
    high = end
    for _ in range(CONTEXT_LINES):
        if high < len(text):
            high = line_end(text, high + 1)
    return (
        text[max(low, begin - MAX_CONTEXT_CHARS) : begin]
        + text[end : min(high, end + MAX_CONTEXT_CHARS)]
    )


# The last text lowered by :func:`mentions`, and its lowered copy: every family is
# handed the same window object, so it is lowered once, not once per family.
_lowered: tuple[str, str] = ("", "")


def mentions(text: str, words: tuple[str, ...]) -> bool:
    """Whether ``text``, lowered, holds one of ``words`` (lower case).

    A cheap necessary condition to check before a pattern with no literal text at its
    start: Python's re tries such a pattern at every position of a 64 KiB window, where
    a substring search skips along at C speed. ``words`` must hold a word of every
    branch of the pattern, or it would miss what the pattern matches.
    """
    global _lowered
    cached = _lowered  # one read: another thread may replace it meanwhile
    if cached[0] is not text:
        cached = _lowered = (text, text.lower())
    return any(word in cached[1] for word in words)


# How many matches of one header a window is read for. A real window holds a few (one per
# rank, or a message logged twice: 4 at most in every corpus); a window of nothing but
# one header repeated ("CUDA OOM " 7,000 times in 64 KiB) would otherwise cost a message's
# reading per repeat, and every repeat folds into the first.
MAX_SPANS = 64


def spans(
    text: str, header: re.Pattern[str], *, limit: int = 3000, needs: tuple[str, ...] = ()
) -> list[Span]:
    """One span per ``header`` match: from it to the next header (or ``limit`` chars),
    for the first :data:`MAX_SPANS` matches. With ``needs``, none unless ``text``
    :func:`mentions` one of those words."""
    if needs and not mentions(text, needs):
        return []
    # One match more than is read: it ends the last span read.
    starts = [m.start() for m in itertools.islice(header.finditer(text), MAX_SPANS + 1)]
    out = []
    for i, start in enumerate(starts[:MAX_SPANS]):
        end = starts[i + 1] if i + 1 < len(starts) else len(text)
        out.append(Span(text, start, min(end, start + limit)))
    return out


# "torch.OutOfMemoryError: ", "RuntimeError: ", "Error: torch.cuda.OutOfMemoryError: "
# right before the message on its line: the last dotted name ending in Error/Exception.
# The name starts the line or follows a separator, or text in another script that
# touches it with no space ("一直出现torch.OutOfMemoryError: ...").
_EXCEPTION_ON_LINE = re.compile(
    r"(?:^|[\s`'\"(|-]|(?<=[^\x00-\x7f]))(?P<name>[A-Za-z_][\w.]{0,80}(?:Error|Exception))"
    r"(?:\s\(see above for traceback\))?\s?:(?:\s+(?:CUDA|cuDNN)\s+error:)?\s*$",
    re.MULTILINE,
)
# VS Code's debugger: "Exception has occurred: RuntimeError" on the line before.
_EXCEPTION_LINE_BEFORE = re.compile(r"Exception has occurred:\s*(?P<name>[\w.]+)\s*$")
# ComfyUI's markdown report: "- Exception Type: torch.OutOfMemoryError".
_EXCEPTION_TYPE_FIELD = re.compile(r"Exception Type:\s*(?P<name>[\w.]+)")


def exception_before(text: str, start: int) -> str | None:
    """The exception class printed just before the message that starts at ``start``."""
    begins = line_start(text, start)
    match = _EXCEPTION_ON_LINE.search(text, line_lookback(text, start), start)
    if match:
        return match["name"]
    # The line before, read back from its end as far as the message's own line is.
    prev_end = max(0, begins - 1)
    prev_start = line_lookback(text, prev_end)
    if not text[begins:start].strip():
        # Wrapped right after the name: "torch.cuda.OutOfMemoryError:\nCUDA out of ..."
        match = _EXCEPTION_ON_LINE.search(text, prev_start, prev_end)
        if match:
            return match["name"]
    for pattern in (_EXCEPTION_LINE_BEFORE, _EXCEPTION_TYPE_FIELD):
        match = pattern.search(text, prev_start, prev_end)
        if match:
            return match["name"]
    return None


def name_near(text: str, start: int, pattern: re.Pattern[str], *, back: int = 600) -> str | None:
    """First group of the last ``pattern`` match in the ``back`` chars before ``start``."""
    found = None
    for match in pattern.finditer(text, max(0, start - back), start + 1):
        found = match
    return found[1] if found else None
