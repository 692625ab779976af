"""The few statements whose SQL differs between SQLite and Postgres."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from sqlalchemy import Double, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.dml import Insert


def insert_ignoring_conflicts(table: Table, dialect: str) -> Insert:
    """``INSERT ... ON CONFLICT DO NOTHING`` for ``table`` on ``dialect``.

    With ``.returning(...)`` it yields only the rows actually inserted, which is how
    ingest tells new snapshots from retried ones in one round trip.
    """
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    raise NotImplementedError(f"gpuwatch supports SQLite and Postgres, not {dialect}")


def upsert(table: Table, dialect: str, *, key: Sequence[str], columns: Sequence[str]) -> Insert:
    """``INSERT ... ON CONFLICT (key) DO UPDATE SET`` ``columns`` from the new row."""
    if dialect == "postgresql":
        pg = postgresql.insert(table)
        return pg.on_conflict_do_update(
            index_elements=list(key), set_={name: pg.excluded[name] for name in columns}
        )
    if dialect == "sqlite":
        lite = sqlite.insert(table)
        return lite.on_conflict_do_update(
            index_elements=list(key), set_={name: lite.excluded[name] for name in columns}
        )
    raise NotImplementedError(f"gpuwatch supports SQLite and Postgres, not {dialect}")


@dataclass(frozen=True)
class ArraySql:
    """One Postgres statement that takes a whole batch of rows as one array per
    column (``unnest``), where a driver ``executemany`` would send the statement once
    per row. ``sql`` binds ``%(p0)s``, ``%(p1)s``, ... (one array per name, in order);
    ``floats`` marks the names whose column is a double: psycopg refuses to send a list
    that mixes ints and floats, so those are sent as floats."""

    sql: str
    floats: tuple[bool, ...]


def unnest_update(table: Table, names: Sequence[str], *, key: str, param: str) -> ArraySql:
    """``UPDATE table SET name = v.name ... FROM unnest(arrays) v WHERE table.key =
    v.param``: ``names`` are columns, except ``param``, which carries ``key``'s value.
    The rows' keys must be distinct (which row of a repeated key wins is not defined)."""
    columns = [key if name == param else name for name in names]
    sets = ", ".join(f"{_quote(n)} = v.{_quote(n)}" for n in names if n != param)
    sql = (
        f"UPDATE {_quote(table.name)} SET {sets} FROM {_unnest(table, names, columns)}"
        f" WHERE {_quote(table.name)}.{_quote(key)} = v.{_quote(param)}"
    )
    return ArraySql(sql, _floats(table, columns))


def unnest_insert(
    table: Table,
    names: Sequence[str],
    *,
    key: Sequence[str] | None = None,
    update: Sequence[str] = (),
    returning: Sequence[str] = (),
) -> ArraySql:
    """``INSERT INTO table (names) SELECT * FROM unnest(arrays)``, then ``ON CONFLICT DO
    NOTHING``, or with ``update``, ``ON CONFLICT (key) DO UPDATE SET`` those columns from
    the new row (whose keys must then be distinct within the batch). With ``returning``,
    those columns of the rows written (a row skipped by ``DO NOTHING`` is not)."""
    listed = ", ".join(_quote(n) for n in names)
    sql = (
        f"INSERT INTO {_quote(table.name)} ({listed}) SELECT * FROM {_unnest(table, names, names)}"
    )
    if update:
        assert key, "an upsert needs its conflict key"
        target = ", ".join(_quote(n) for n in key)
        sets = ", ".join(f"{_quote(n)} = excluded.{_quote(n)}" for n in update)
        sql += f" ON CONFLICT ({target}) DO UPDATE SET {sets}"
    else:
        sql += " ON CONFLICT DO NOTHING"
    if returning:
        sql += " RETURNING " + ", ".join(_quote(n) for n in returning)
    return ArraySql(sql, _floats(table, names))


def _unnest(table: Table, names: Sequence[str], columns: Sequence[str]) -> str:
    arrays = ", ".join(
        f"%(p{i})b::{table.c[column].type.compile(dialect=_postgres())}[]"
        for i, column in enumerate(columns)
    )
    return f"unnest({arrays}) AS v({', '.join(_quote(n) for n in names)})"


def _floats(table: Table, columns: Sequence[str]) -> tuple[bool, ...]:
    return tuple(isinstance(table.c[c].type, Double) for c in columns)


@cache
def _postgres() -> Dialect:
    return postgresql.dialect()  # type: ignore[no-any-return]


def _quote(name: str) -> str:
    return _postgres().identifier_preparer.quote(name)
