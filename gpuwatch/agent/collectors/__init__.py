"""Prometheus collectors, one per file, each building fresh metric families per scrape.

Every collector declares its metrics as :class:`~gpuwatch.metricspec.MetricSpec`
constants in ``METRICS``; ``docs/metrics.md`` is generated from those declarations, and a
test checks that every family a collector yields is declared, so the two cannot drift.
"""
