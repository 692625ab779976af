"""Keyset pagination over ``(time, id)``, newest first, with an opaque cursor.

Keyset rather than OFFSET: a page costs the same at any depth, and rows inserted
while a client pages do not shift the pages it has not read yet.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, or_

from gpuwatch.errors import GpuwatchError

MAX_LIMIT = 1000
# Row ids are BIGINT: a cursor naming a larger one was not handed out here.
_MAX_ID = 2**63 - 1


class InvalidCursor(GpuwatchError):
    """A ``cursor`` query parameter that this server did not hand out."""


@dataclass(frozen=True)
class Cursor:
    """Position after the last row of a page: its time and id."""

    t: float
    id: int

    def encode(self) -> str:
        return base64.urlsafe_b64encode(f"{self.t!r}:{self.id}".encode()).decode()

    @classmethod
    def decode(cls, value: str) -> Cursor:
        """The cursor ``value`` encodes; :class:`InvalidCursor` (a 422) for anything this
        server cannot have handed out, numbers its columns cannot hold included."""
        try:
            t, _, ident = base64.urlsafe_b64decode(value.encode()).decode().partition(":")
            cursor = cls(t=float(t), id=int(ident))
        except (ValueError, UnicodeError) as err:
            raise InvalidCursor("invalid cursor") from err
        if not math.isfinite(cursor.t) or not 0 <= cursor.id <= _MAX_ID:
            raise InvalidCursor("invalid cursor")
        return cursor


def after(cursor: Cursor | None, t_column: Any, id_column: Any) -> ColumnElement[bool] | None:
    """WHERE clause for rows strictly after ``cursor`` in ``(t DESC, id DESC)`` order."""
    if cursor is None:
        return None
    return or_(t_column < cursor.t, and_(t_column == cursor.t, id_column < cursor.id))
