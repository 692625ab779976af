"""Which silence regular expressions the server will run, and running them safely.

Silences match with Python's ``re``, a backtracking engine that holds the GIL: one
pattern such as ``(\\w|\\w|\\w)*X`` takes minutes on one label value and, meanwhile,
stops every thread of the server (API, ingest, alerting). Alertmanager uses RE2, which
runs in linear time; here the syntax is restricted instead, to patterns whose
backtracking stays small, by walking the parsed pattern:

* a repeat (``*``, ``+``, ``?``, ``{m,n}``) whose body holds another repeat or an
  alternation is refused (``(a+)+``, ``(a|ab)*``: exponential);
* at most :data:`MAX_REPEATS` repeats in all (``\\w*\\w*\\w*\\w*X`` already takes
  seconds on 256 characters: each more repeat multiplies the work by the length);
* only plain syntax: no backreferences, lookarounds, conditionals, atomic groups or
  possessive repeats (RE2 has none of them either);
* at most :data:`MAX_PATTERN_CHARS` characters.

Matching stays anchored (the whole value), as Alertmanager's.
"""

from __future__ import annotations

import functools
import logging
import re
import re._constants as sre  # the opcodes of re's own parser (sre_constants)
import re._parser as sre_parse  # re's own parser (sre_parse)
from typing import Any

log = logging.getLogger(__name__)

MAX_PATTERN_CHARS = 256
MAX_REPEATS = 3

_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)
# Everything else (GROUPREF, ASSERT, ASSERT_NOT, GROUPREF_EXISTS, ATOMIC_GROUP,
# POSSESSIVE_REPEAT) is refused.
_PLAIN = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN, sre.AT, sre.SUBPATTERN, sre.BRANCH)


class UnsafePattern(ValueError):
    """A pattern silences will not run; the message says why, without quoting it."""


def check_pattern(pattern: str) -> None:
    """Raise :class:`UnsafePattern` (or ``re.error`` for bad syntax) unless ``pattern``
    is one the server runs (see the module docstring)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise UnsafePattern(f"a regular expression may have at most {MAX_PATTERN_CHARS} characters")
    repeats = _walk(sre_parse.parse(pattern), inside_repeat=False)
    if repeats > MAX_REPEATS:
        raise UnsafePattern(
            f"at most {MAX_REPEATS} repeats (*, +, ?, {{m,n}}) in a regular expression:"
            " more can take the server minutes to match"
        )


def _walk(items: Any, *, inside_repeat: bool) -> int:
    """The repeats in ``items`` (a parsed pattern or part of one); raises for refused syntax."""
    count = 0
    for op, av in items:
        if op in _REPEATS and av[1] <= 1 and not inside_repeat:
            # ``x?`` runs its body at most once: (foo|bar)? and (x+)? stay cheap. Not
            # inside a repeat: (a?){30}a{30} is exponential.
            count += 1 + _walk(av[2], inside_repeat=False)
        elif op in _REPEATS:
            if inside_repeat:
                raise UnsafePattern(
                    "a repeat inside a repeat (as in (a+)+) can take the server minutes to match"
                )
            count += 1 + _walk(av[2], inside_repeat=True)
        elif op == sre.BRANCH:
            if inside_repeat:
                raise UnsafePattern(
                    "an alternation inside a repeat (as in (a|ab)*) can take the server"
                    " minutes to match"
                )
            count += sum(_walk(branch, inside_repeat=False) for branch in av[1])
        elif op == sre.SUBPATTERN:
            count += _walk(av[3], inside_repeat=inside_repeat)
        elif op not in _PLAIN:
            raise UnsafePattern(
                "backreferences, lookarounds, conditionals, atomic groups and possessive"
                " repeats are not supported"
            )
    return count


@functools.lru_cache(maxsize=1024)
def compiled(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` compiled, or None when it is one the server must not run: a silence
    stored before patterns were checked is then not evaluated (it mutes nothing), and
    a warning says so once per pattern."""
    try:
        check_pattern(pattern)
        return re.compile(pattern)
    except (re.error, UnsafePattern, RecursionError) as err:
        log.warning(
            "a silence's regular expression is not evaluated (it mutes nothing): %s;"
            " expire that silence and create it again with a simpler pattern",
            err,
        )
        return None
