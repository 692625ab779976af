"""Alembic environment and revisions, shipped in the package and run programmatically.

See :mod:`gpuwatch.server.database.migrate`; no ``alembic.ini`` is needed at runtime.
New revision (from a checkout, against a database at head)::

    python -m gpuwatch.server.database.migrate revision "add foo"
"""
