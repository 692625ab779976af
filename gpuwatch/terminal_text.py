"""Untrusted text made safe to print on one line of a terminal.

Command lines, process names, users, container and pod names come from other users
(``/proc``, the agent's snapshot). Printed raw, an ESC starts a terminal control
sequence (clear the screen, set the window title, an OSC 8 hyperlink), a CR or LF
forges a line of gpuwatch's own output, and a bidi override reorders what follows.
:func:`printable` shows each such character as an escape (``\\x1b``, ``\\n``,
``\\u202e``) instead: never removed, so whoever reads it sees that something odd was
there. Backslashes are left alone (``\\x1b`` typed literally reads the same; it is
harmless). Rich markup is a separate concern: print the result as a
:class:`rich.text.Text` (or through :func:`rich.markup.escape`), never as markup.

Stored copies (the reaper's audit log, ``--json``) keep the exact text; this is for
what reaches a terminal only.
"""

from __future__ import annotations

import unicodedata

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Unicode categories that print nothing yet change what the terminal shows: format
# characters (bidi embeddings, overrides and isolates, zero-width characters, the
# BOM, tag characters), line and paragraph separators, controls, and lone surrogates
# (from bytes decoded with ``surrogateescape``).
_INVISIBLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def printable(text: str) -> str:
    """``text`` for one line of a terminal: C0 controls (ESC, CR, LF, TAB, BEL,
    backspace, ...), DEL, C1 controls (U+0080 to U+009F), bidi overrides and isolates,
    and the other invisible format characters each shown as a Python-style escape;
    everything else unchanged.

    >>> printable("a\\x1b[31mb\\nc\\u202ed")
    'a\\\\x1b[31mb\\\\nc\\\\u202ed'
    """
    if text.isprintable():  # False for every character escaped below: the usual case
        return text
    return "".join(_escape(ch) if _hidden(ch) else ch for ch in text)


def _hidden(ch: str) -> bool:
    code = ord(ch)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return True
    return code > 0x9F and unicodedata.category(ch) in _INVISIBLE


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
