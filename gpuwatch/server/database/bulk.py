"""Executemany at driver speed for ingest's hot statements.

SQLAlchemy Core spends ~10 µs per row in ``executemany`` building and processing
parameters, which for ingest's per-request UPDATE of every touched lifetime was half
the cost of storing a snapshot. A :class:`BulkStatement` compiles its Core statement
once per dialect and hands plain tuples (or dicts, for named paramstyles) straight to
the DBAPI's ``executemany``. Only for statements whose values need no type processing:
ints, floats, strings, booleans, bytes and None (no JSON, no dates).

On Postgres a statement may instead be given as an :class:`~gpuwatch.server.database.
dialects.ArraySql`: the whole batch in one statement, one array per column. psycopg's
``executemany`` sends the statement once per row (in a pipeline, but with its Python
around every row), and on a single-snapshot push that was about half of the server's
own CPU (bench/README.md, load). A single row still goes as the plain statement: psycopg
spends twice the CPU on one-element arrays that it spends on the row's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, CursorResult, Executable
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import Compiled

from gpuwatch.server.database.dialects import ArraySql


class BulkStatement:
    """A statement built lazily, compiled once per dialect, run with driver executemany.

    Rows are tuples of values for the bind parameters ``names``, in that order.
    """

    def __init__(
        self,
        build: Callable[[], Executable],
        names: Sequence[str],
        *,
        postgres: Callable[[], ArraySql] | None = None,
    ) -> None:
        self._build = build
        self.names = tuple(names)
        # On Postgres, the statement that takes the batch as arrays (built once).
        self._postgres = postgres
        self._arrays: ArraySql | None = None
        # dialect name -> (SQL text, row permutation for a positional paramstyle, or
        # None for a named one, which takes dicts)
        self._compiled: dict[str, tuple[str, tuple[int, ...] | None]] = {}

    def execute(self, connection: Connection, rows: Sequence[Sequence[Any]]) -> None:
        """Run the statement for every row, in one executemany, on ``connection`` (the
        session's, taken once per request: ``Session.connection()`` is not free)."""
        if not rows:
            return
        if len(rows) > 1 and self._postgres is not None and connection.dialect.name == "postgresql":
            self._execute_arrays(connection, rows)
            return
        sql, order = self._compile(connection.dialect)
        params: Sequence[Any]
        if order is None:
            params = [dict(zip(self.names, row, strict=True)) for row in rows]
        elif order == tuple(range(len(self.names))):
            params = rows
        else:
            params = [tuple(row[i] for i in order) for row in rows]
        connection.exec_driver_sql(sql, params)  # type: ignore[arg-type]

    def _execute_arrays(self, connection: Connection, rows: Sequence[Sequence[Any]]) -> None:
        if self._arrays is None:
            assert self._postgres is not None
            self._arrays = self._postgres()
        execute_arrays(connection, self._arrays, rows)

    def _compile(self, dialect: Dialect) -> tuple[str, tuple[int, ...] | None]:
        found = self._compiled.get(dialect.name)
        if found is None:
            compiled: Compiled = self._build().compile(dialect=dialect)  # type: ignore[attr-defined]
            positional = compiled.positiontup  # type: ignore[attr-defined]
            if positional is not None and sorted(positional) != sorted(self.names):
                raise ValueError(f"statement binds {positional}, rows give {self.names}")
            order = None if positional is None else tuple(self.names.index(n) for n in positional)
            found = (compiled.string, order)
            self._compiled[dialect.name] = found
        return found


def execute_arrays(
    connection: Connection, arrays: ArraySql, rows: Sequence[Sequence[Any]]
) -> CursorResult[Any]:
    """Run ``arrays`` (Postgres) once for all of ``rows`` (tuples in the order of its
    names, at least one), one array per column; its result (rows of a ``RETURNING``).
    As with :class:`BulkStatement`, values go to the driver as they are: a JSON column
    takes the JSON text SQLAlchemy's JSON type would have written."""
    columns = zip(*rows, strict=True)  # one tuple per column
    params = {
        f"p{i}": [v if v is None or type(v) is float else float(v) for v in column]
        if is_float
        else list(column)
        for i, (column, is_float) in enumerate(zip(columns, arrays.floats, strict=True))
    }
    return connection.exec_driver_sql(arrays.sql, params)
