"""Text in, :class:`~gpuwatch.doctor.facts.OomFacts` out: the OOM message parser.

:func:`parse_oom` accepts anything a person pastes: one message, a traceback, a 10 MB
log, CRLF, wrapped lines, non-UTF-8 bytes already decoded with ``errors="replace"``.
It finds the first OOM message in the text and returns what it says; later, different
OOM messages come back in ``additional_messages``. Repeats of the same message (one per
rank, or logged twice) are folded into one.

Cost is bounded: anchors are found with substring search, at most
:data:`gpuwatch.doctor.text.MAX_WINDOWS` windows are examined, and every pattern is
free of nested quantifiers.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families import FALLBACKS, FAMILIES, Found, generic
from gpuwatch.doctor.families.clauses import forecast
from gpuwatch.doctor.text import strip_escapes, weak_lines, windows
from gpuwatch.errors import NotRecognized

MAX_ADDITIONAL_MESSAGES = 16
NOT_RECOGNISED = "not an OOM message I recognise: this does not look like an out-of-memory error"

# Traceback frames that show the model being loaded or moved onto the GPU.
_LOADING = re.compile(
    r"from_pretrained|_load_pretrained_model|caching_allocator_warmup|load_state_dict"
    r"|load_checkpoint|in _apply\b|load_tensors|error loading model"
)
LOADING_LOOKBACK_CHARS = 3000
# ... or the failure's own sentence saying what the memory was for: "Insufficient GPU
# memory to load model", "out of memory while loading the weights", "during model loading".
_LOADING_PURPOSE = re.compile(
    r"\b(?:to|while|when|during)\s+(?:(?:load(?:ing)?|mov(?:e|ing))\s+(?:the\s+|a\s+|this\s+|"
    r"your\s+)?(?:model|weights|checkpoint)|(?:the\s+)?model\s+load(?:ing)?)\b",
    re.IGNORECASE,
)
LOADING_PURPOSE_CHARS = 200

# Fields that identify a message; the rest (message text, exception name) may differ
# between two printings of the same failure.
_IDENTITY_EXCLUDED = {"message", "additional_messages", "exception"}


def parse_oom(text: str) -> OomFacts:
    """The first OOM message in ``text``, with later distinct ones attached.

    Raises :class:`~gpuwatch.errors.NotRecognized` when ``text`` holds no OOM message
    this parser knows.
    """
    messages = find_all(text)
    if not messages:
        raise NotRecognized(NOT_RECOGNISED)
    first, *rest = messages
    first.additional_messages = rest[:MAX_ADDITIONAL_MESSAGES]
    return first


def find_all(text: str) -> list[OomFacts]:
    """Every distinct OOM message in ``text``, in the order they appear."""
    text = strip_escapes(text)
    messages: list[OomFacts] = []
    # A log that repeats itself (one message per rank, a line printed 10,000 times) cuts
    # into windows with the same text: each text is read once. What a reading found, and
    # how much, as first read (adding a message to ``messages`` changes it).
    readings_found: dict[str, tuple[list[Found], int]] = {}
    added: set[str] = set()
    for readings in windows(text):
        for reading in readings:
            if reading not in readings_found:
                _, found = _find_in(reading)
                readings_found[reading] = (found, _richness((reading, found)))
        # The first reading that yields the most (max keeps the first of equals).
        window = max(readings, key=lambda reading: readings_found[reading][1])
        if window in added:
            # Its messages were added already; added again, each would fold into the
            # message it folded into the first time, which holds all it says.
            continue
        added.add(window)
        for start, facts in sorted(readings_found[window][0], key=lambda f: f.start):
            if facts.phase is None and _loading(window, start):
                facts.phase = "model load"
            _add(messages, facts)
    if not messages:
        # A wording without any known anchor word: read line by line (families/generic.py).
        for previous, line, following, around in weak_lines(text, generic.says_failure):
            read = generic.read_line(line, previous, following, around)
            if read is not None and read.phase is None and _LOADING_PURPOSE.search(line):
                read.phase = "model load"
            if read is not None:
                _add(messages, read)
    return messages


def _loading(window: str, start: int) -> bool:
    """Whether the message at ``start`` failed while a model was loaded: a loading frame
    before it, or its own line saying so after it."""
    if _LOADING.search(window, max(0, start - LOADING_LOOKBACK_CHARS), start):
        return True
    end = window.find("\n", start, start + LOADING_PURPOSE_CHARS)
    return bool(
        _LOADING_PURPOSE.search(window, start, end if end != -1 else start + LOADING_PURPOSE_CHARS)
    )


def _find_in(window: str) -> tuple[str, list[Found]]:
    found: list[Found] = []
    for family in FAMILIES:
        found.extend(f for f in family(window) if not forecast(window, f.start))
    if not found:
        # In order, the first that finds anything: a message they would both read (a
        # PyTorch first line is also a line about GPU memory) is one message.
        for fallback in FALLBACKS:
            found = [f for f in fallback(window) if not forecast(window, f.start)]
            if found:
                break
    return window, found


def _richness(reading: tuple[str, list[Found]]) -> int:
    """How much a reading of a window yielded: filled fields over all its messages."""
    return sum(
        1
        for _, facts in reading[1]
        for value in facts.model_dump(exclude={"message", "additional_messages"}).values()
        if value not in (None, [])
    ) + sum(len(facts.other_processes) for _, facts in reading[1])


def _add(messages: list[OomFacts], facts: OomFacts) -> None:
    """Append ``facts``, or fold it into an earlier printing of the same message."""
    new = facts.model_dump(exclude=_IDENTITY_EXCLUDED)
    for earlier in messages:
        old = earlier.model_dump(exclude=_IDENTITY_EXCLUDED)
        if all(old[k] == v or old[k] in (None, []) or v in (None, []) for k, v in new.items()):
            # Same failure printed again (perhaps with more detail): fill what the
            # earlier printing lacked.
            for key, value in new.items():
                if old[key] in (None, []) and value not in (None, []):
                    setattr(earlier, key, getattr(facts, key))
            if earlier.exception is None:
                earlier.exception = facts.exception
            return
    # Only the first message and MAX_ADDITIONAL_MESSAGES after it are returned, and a later
    # printing folds into the first earlier message it fits: messages past those would
    # change nothing returned, and each would cost every later one a comparison.
    if len(messages) <= MAX_ADDITIONAL_MESSAGES:
        messages.append(facts)
