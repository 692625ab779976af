"""Helpers shared by tests (importable as ``support``: tests/ is on pytest's pythonpath)."""
