"""Keyset pagination over ``(time, id)``, newest first, with an opaque cursor.

Keyset rather than OFFSET: a page costs the same at any depth, and rows inserted
while a client pages do not shift the pages it has not read yet.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from sqlalchemy import ColumnElement, and_, or_
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal

from gpuwatch.errors import GpuwatchError

MAX_LIMIT = 1000
# Row ids are BIGINT: a cursor naming a larger one was not handed out here.
_MAX_ID = 2**63 - 1


class InvalidCursor(GpuwatchError):
    """A ``cursor`` query parameter that this server did not hand out."""


# What a cursor encodes: the list it pages, the last row's time (``repr`` of a finite
# float) and its id. Strict on purpose: Python's float() and int() also take spaces,
# underscores and "infinity", none of which this server hands out.
_CURSOR = re.compile(r"(events|processes):(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?):(\d{1,19})")


@dataclass(frozen=True)
class Cursor:
    """Position after the last row of a page of the list ``of``: its time and id. The
    list is part of the cursor so that one list's cursor given to another (whose rows
    are ordered by another time) is refused instead of answering a page from nowhere."""

    of: str
    t: float
    id: int

    def encode(self) -> str:
        return base64.urlsafe_b64encode(f"{self.of}:{self.t!r}:{self.id}".encode()).decode()

    @classmethod
    def decode(cls, value: str, *, of: str | None = None) -> Cursor:
        """The cursor ``value`` encodes; :class:`InvalidCursor` (a 422) for anything this
        server cannot have handed out (for the list ``of``, when given): numbers its
        columns cannot hold included."""
        try:
            text = base64.urlsafe_b64decode(value.encode()).decode()
        except (ValueError, UnicodeError) as err:
            raise InvalidCursor("invalid cursor") from err
        found = _CURSOR.fullmatch(text)
        if found is None or (of is not None and found[1] != of):
            raise InvalidCursor("invalid cursor")
        cursor = cls(of=found[1], t=float(found[2]), id=int(found[3]))
        if not math.isfinite(cursor.t) or not 0 <= cursor.id <= _MAX_ID:
            raise InvalidCursor("invalid cursor")
        return cursor


def after(
    cursor: Cursor | None, of: str, t_column: Any, id_column: Any
) -> ColumnElement[bool] | None:
    """WHERE clause for rows strictly after ``cursor`` in ``(t DESC, id DESC)`` order;
    :class:`InvalidCursor` when ``cursor`` pages another list than ``of``."""
    if cursor is None:
        return None
    if cursor.of != of:
        raise InvalidCursor("invalid cursor")
    return or_(t_column < cursor.t, and_(t_column == cursor.t, id_column < cursor.id))


def refuse_reversed_range(
    since: float | None, until: float | None, *, until_name: str = "until"
) -> None:
    """A 422 in the shape of every other (at ``until``) when ``until`` is before
    ``since``: such a range holds no time, and answering it anyway listed events that
    "overlap" nothing and ranked users by zero seconds. The CLI refuses it too (exit 3).
    """
    if since is not None and until is not None and until < since:
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("query", until_name),
                    "msg": f"{until_name} ({until:.0f}) is before since ({since:.0f}):"
                    " the range holds no time",
                }
            ]
        )


def bytewise(column: Any) -> ColumnElement[Any]:
    """``column`` compared byte by byte (UTF-8: by code point), as SQLite's default
    BINARY collation does: on Postgres ``COLLATE "C"``. The database's own collation
    there follows its locale (``en_US`` sorts ``Host-A`` between ``h5`` and
    ``host-a``), and a list's order must not depend on how the database was created.
    """
    return _Bytewise(column)


class _Bytewise(ColumnElement[Any]):
    inherit_cache = True
    _traverse_internals = [("column", InternalTraversal.dp_clauseelement)]  # noqa: RUF012

    def __init__(self, column: ColumnElement[Any]) -> None:
        self.column = column
        self.type = column.type


@compiles(_Bytewise)
def _bytewise_as_is(element: _Bytewise, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.column, **kw)


@compiles(_Bytewise, "postgresql")
def _bytewise_postgres(element: _Bytewise, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.column.collate("C"), **kw)
