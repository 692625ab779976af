"""Metric declarations: one spec per family, shared by the agent's collectors, the
server's metrics and the generated reference (a neutral module, so neither imports the
other)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: its name, type, help text and label names.

    ``name`` is the exposition name without the ``_total`` suffix for counters (the
    client library appends it) and without ``_info`` for info metrics.
    """

    name: str
    kind: Literal["gauge", "counter", "info"]
    help: str
    labels: tuple[str, ...] = ()
    # Shown in the reference: when the metric is absent (e.g. "opt-in", "v2 driver API").
    availability: str = "always"

    @property
    def exposed_name(self) -> str:
        return {"gauge": self.name, "counter": self.name + "_total", "info": self.name + "_info"}[
            self.kind
        ]

    def gauge(self) -> GaugeMetricFamily:
        """A fresh gauge family (for callers that build families by hand)."""
        if self.kind != "gauge":
            raise TypeError(f"{self.name} is a {self.kind}")
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def counter(self) -> CounterMetricFamily:
        """A fresh counter family (for callers that build families by hand)."""
        if self.kind != "counter":
            raise TypeError(f"{self.name} is a {self.kind}")
        return CounterMetricFamily(self.name, self.help, labels=self.labels)

    def family(self) -> GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily:
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.help, labels=self.labels)
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=self.labels)
        return InfoMetricFamily(self.name, self.help, labels=self.labels)


class Families:
    """Fresh families for one scrape, keyed by spec; yields only non-empty ones."""

    def __init__(self, specs: Iterable[MetricSpec]) -> None:
        self._families = {spec.name: (spec, spec.family()) for spec in specs}

    def add(self, spec: MetricSpec, labels: Sequence[str], value: float | None) -> None:
        """Add one sample; ``None`` (not available) adds nothing rather than a 0."""
        if value is None:
            return
        if len(labels) != len(spec.labels):
            # The client library zips names with values: a short list would drop labels
            # silently, and the reference would no longer describe the exposition.
            raise ValueError(f"{spec.name}: {len(labels)} label values for {spec.labels}")
        family = self._families[spec.name][1]
        family.add_metric(list(labels), value)  # type: ignore[arg-type]

    def add_info(self, spec: MetricSpec, labels: Sequence[str], info: dict[str, str]) -> None:
        """An info sample: ``labels`` are values of the spec's first labels, ``info``
        names the rest, in the spec's order (the reference lists them all)."""
        if spec.labels != (*spec.labels[: len(labels)], *info):
            raise ValueError(
                f"{spec.name}: labels {tuple(info)} after {len(labels)} of {spec.labels}"
            )
        family = self._families[spec.name][1]
        family.add_metric(list(labels), info)  # type: ignore[arg-type]

    def collected(self) -> list[Metric]:
        return [fam for _, fam in self._families.values() if fam.samples]
