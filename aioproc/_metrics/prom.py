"""The bridge to ``prometheus_client``: a collector a host service registers.

The collector keeps no values of its own: every ``collect()`` (a scrape of
the host's registry) reads the recorder's metrics as they are then, so
the host's ``/metrics`` and aioproc's own server show the same numbers.
Imported only by ``aioproc.metrics.register()``: prometheus_client is an
optional extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric as PromMetric
from prometheus_client.registry import Collector, CollectorRegistry

from .families import Counter, Gauge, Histogram, Registry
from .recorder import Recorder
from .text import format_float

__all__ = ["RecorderCollector", "register"]


class RecorderCollector(Collector):
    """A ``prometheus_client`` collector of an aioproc ``Registry``.

    Args:
        source: returns the registry to read at each collect (None: nothing
            to report, as while metrics are off).
    """

    def __init__(self, source: Callable[[], Registry | None]) -> None:
        self._source = source

    def describe(self) -> Iterator[PromMetric]:
        """The families without their samples: the names a registry checks for duplicates.

        While metrics are off, the names a ``Recorder`` exports: the ones
        this collector reports once they are on.
        """
        registry = self._source()
        if registry is None:
            yield from _families(Recorder().registry, samples=False)
        else:
            yield from _families(registry, samples=False)

    def collect(self) -> Iterator[PromMetric]:
        """One metric family per aioproc metric, with its current samples."""
        registry = self._source()
        if registry is not None:
            yield from _families(registry, samples=True)

    def __repr__(self) -> str:
        return "<RecorderCollector of aioproc's metrics>"


def _families(registry: Registry, samples: bool) -> Iterator[PromMetric]:
    for metric in registry.collect():
        labels = list(metric.labelnames)
        if isinstance(metric, Counter):
            counter = CounterMetricFamily(metric.name, metric.documentation, labels=labels)
            for key, value in metric.samples() if samples else ():
                counter.add_metric(list(key), value)
            yield counter
        elif isinstance(metric, Gauge):
            gauge = GaugeMetricFamily(metric.name, metric.documentation, labels=labels)
            for key, value in metric.samples() if samples else ():
                gauge.add_metric(list(key), value)
            yield gauge
        elif isinstance(metric, Histogram):
            histogram = HistogramMetricFamily(metric.name, metric.documentation, labels=labels)
            bounds = [format_float(b) for b in metric.buckets]
            for key, cumulative, total, _ in metric.samples() if samples else ():
                histogram.add_metric(list(key), list(zip(bounds, cumulative, strict=True)), total)
            yield histogram


def register(
    source: Callable[[], Registry | None], registry: CollectorRegistry | None
) -> RecorderCollector:
    """Register a collector of ``source`` into ``registry`` (None: prometheus_client's default)."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    collector = RecorderCollector(source)
    registry.register(collector)
    return collector
