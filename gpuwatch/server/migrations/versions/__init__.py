"""Revisions, named by date (``YYYY_MM_DD_<rev>_<slug>.py``)."""
