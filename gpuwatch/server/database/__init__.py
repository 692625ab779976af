"""Database binding: engine factory, declarative base and the migration runner."""

from gpuwatch.server.database.core import (
    Base,
    Database,
    create_database,
    database_for,
    is_unavailable,
    translated_errors,
)

__all__ = [
    "Base",
    "Database",
    "create_database",
    "database_for",
    "is_unavailable",
    "translated_errors",
]
