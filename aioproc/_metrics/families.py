"""Counters, gauges and histograms with labels, and the registry that holds them.

Each metric keeps one cell (a histogram: one row of bucket counts) per
tuple of label values, in a plain dict.  Recording is unlocked: aioproc
records from its loop's thread, and one dict update is all a hook pays.
Reading may happen on another thread (``prometheus_client``'s HTTP server
thread): ``samples()`` copies the dict and each histogram row with a single
C-level copy, which the GIL keeps whole, so a scrape never sees a dict
changing size under it.  A scrape racing an observation may see a
histogram's ``_sum`` one observation behind its buckets; ``_count`` is
derived from the buckets, so the two always agree.

**Expiry** (``Expiry``): which groups keep series of their own, the
running ones and the last finished.  A scheduler that names every job
differently would otherwise add a score of series per job, for ever: a
page of megabytes after a thousand jobs.  The rule a ``Recorder`` applies
(``keep_finished``):

- a ``(group, role)`` is *running* while it has a started group or worker
  not over yet; its series stay;
- once nothing of it runs it is *finished*, and it keeps its series while
  it is one of the last ``keep_finished`` finished (a later restart, stop
  or run's end makes it running or most recently finished again; output,
  the hot hook, only registers a series it creates);
- the oldest finished beyond that *expires*: its counters and histograms
  are added into the series of its role whose ``group`` label is
  ``EXPIRED`` (so ``sum by (role)`` over a counter stays whole), and its
  gauges are removed (a gauge of something over has nothing to say).

The series of running groups are never folded: they are what is running.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["EXPIRED", "Counter", "Expiry", "Gauge", "Histogram", "Metric", "Registry"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _check_names(
    name: str, labelnames: Sequence[str], reserved: tuple[str, ...]
) -> tuple[str, ...]:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"invalid metric name {name!r}: use letters, digits, '_' and ':'")
    labels = tuple(labelnames)
    for label in labels:
        if not isinstance(label, str) or not _LABEL.match(label) or label.startswith("__"):
            raise ValueError(f"invalid label name {label!r} for metric {name}")
        if label in reserved:
            raise ValueError(f"label name {label!r} is reserved for metric {name}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate label names for metric {name}: {labels}")
    return labels


class Metric:
    """What every metric has: a name, a help text, label names and a type."""

    type: str = "untyped"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = _check_names(name, labelnames, self._reserved())

    @staticmethod
    def _reserved() -> tuple[str, ...]:
        return ()

    def _key(self, labels: Sequence[str]) -> tuple[str, ...]:
        key = tuple(labels)
        if len(key) != len(self.labelnames) or not all(isinstance(v, str) for v in key):
            raise ValueError(
                f"{self.name} takes {len(self.labelnames)} label values "
                f"{self.labelnames} as str, got {labels!r}"
            )
        return key

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}{list(self.labelnames)}>"


class _Scalar(Metric):
    """A counter's or a gauge's storage: one cell per series.

    A cell is a one-item list, so that moving a series hashes its label
    tuple once (a ``get``) rather than twice (a ``get`` and a store).
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._cells: dict[tuple[str, ...], list[float]] = {}

    def _add(self, key: tuple[str, ...], amount: float) -> bool:
        # the recorder's path: its keys are built right, so nothing is checked;
        # True when the series is new (the expiry must then know its group)
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [float(amount)]
            return True
        cell[0] += amount
        return False

    def _set(self, key: tuple[str, ...], value: float) -> None:
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [value]
        else:
            cell[0] = value

    def _pop(self, key: tuple[str, ...]) -> float | None:
        # the recorder's expiry: the series goes, its value is returned
        cell = self._cells.pop(key, None)
        return None if cell is None else cell[0]

    def value(self, labels: Sequence[str] = ()) -> float:
        """The series' value; 0.0 for a series never recorded."""
        cell = self._cells.get(tuple(labels))
        return 0.0 if cell is None else cell[0]

    def samples(self) -> list[tuple[tuple[str, ...], float]]:
        """Every series: (label values, value), in the order they first appeared."""
        return [(key, cell[0]) for key, cell in self._cells.copy().items()]


class Counter(_Scalar):
    """A value that only goes up: events counted, seconds spent.

    By the Prometheus convention its name ends in ``_total``.
    """

    type = "counter"

    def inc(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        """Add ``amount`` to the series of ``labels``.

        Args:
            amount: how much to add; not negative.
            labels: one value per label name, in their order.

        Raises:
            ValueError: ``amount`` is negative, or the label values do not fit.
        """
        if amount < 0:
            raise ValueError(f"counter {self.name} can only go up, got inc({amount!r})")
        self._add(self._key(labels), amount)


class Gauge(_Scalar):
    """A value that goes up and down: workers running, restarts left."""

    type = "gauge"

    def set(self, value: float, labels: Sequence[str] = ()) -> None:
        """Set the series of ``labels`` to ``value``."""
        self._set(self._key(labels), float(value))

    def inc(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        """Add ``amount`` (negative: subtract) to the series of ``labels``."""
        self._add(self._key(labels), amount)

    def dec(self, amount: float = 1.0, labels: Sequence[str] = ()) -> None:
        """Subtract ``amount`` from the series of ``labels``."""
        self._add(self._key(labels), -amount)


class Histogram(Metric):
    """Observations counted into buckets by upper bound, with their sum.

    A value lands in the first bucket whose bound is at least the value
    (Prometheus's ``le``, less than or equal); the ``+Inf`` bucket takes
    the rest.
    """

    type = "histogram"

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Iterable[float] = (),
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] == math.inf:
            bounds.pop()
        if not bounds or any(math.isnan(b) for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError(
                f"histogram {name} needs increasing, distinct bucket bounds, got {buckets!r}"
            )
        self.buckets: tuple[float, ...] = (*bounds, math.inf)
        """The upper bounds, ``+Inf`` last."""
        self._bounds = bounds
        # a row per series: one count per bucket (not cumulative), then the sum
        self._rows: dict[tuple[str, ...], list[float]] = {}

    @staticmethod
    def _reserved() -> tuple[str, ...]:
        return ("le",)

    def observe(self, value: float, labels: Sequence[str] = ()) -> None:
        """Count ``value`` into its bucket of the series of ``labels``."""
        self._observe(self._key(labels), float(value))

    def _observe(self, key: tuple[str, ...], value: float) -> None:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = [0.0] * (len(self.buckets) + 1)
        row[bisect.bisect_left(self._bounds, value)] += 1
        row[-1] += value

    def _pop(self, key: tuple[str, ...]) -> list[float] | None:
        # the recorder's expiry: the series goes, its row is returned
        return self._rows.pop(key, None)

    def _merge(self, key: tuple[str, ...], row: list[float]) -> None:
        # a new list, stored in one step: a reader on another thread copies
        # either the old row or the merged one, never a row half added
        old = self._rows.get(key)
        merged = row.copy() if old is None else [a + b for a, b in zip(old, row, strict=True)]
        self._rows[key] = merged

    def samples(self) -> list[tuple[tuple[str, ...], list[float], float, float]]:
        """Every series: (label values, cumulative bucket counts, sum, count)."""
        found = []
        for key, row in self._rows.copy().items():
            row = row.copy()
            cumulative, total = [], 0.0
            for n in row[:-1]:
                total += n
                cumulative.append(total)
            found.append((key, cumulative, row[-1], total))
        return found


class Registry:
    """An ordered set of metrics, collected together; names are unique within it."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def register(self, metric: Metric) -> None:
        """Add ``metric``.

        Raises:
            ValueError: a metric of that name is already registered.
        """
        if metric.name in self._metrics:
            raise ValueError(f"a metric named {metric.name} is already registered")
        self._metrics[metric.name] = metric

    def unregister(self, metric: Metric) -> None:
        """Remove ``metric``; a metric not registered is ignored."""
        if self._metrics.get(metric.name) is metric:
            del self._metrics[metric.name]

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """Create and register a ``Counter``."""
        metric = Counter(name, documentation, labelnames)
        self.register(metric)
        return metric

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """Create and register a ``Gauge``."""
        metric = Gauge(name, documentation, labelnames)
        self.register(metric)
        return metric

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Iterable[float] = (),
    ) -> Histogram:
        """Create and register a ``Histogram``."""
        metric = Histogram(name, documentation, labelnames, buckets)
        self.register(metric)
        return metric

    def get(self, name: str) -> Metric:
        """The metric named ``name``.

        Raises:
            KeyError: no metric of that name is registered.
        """
        return self._metrics[name]

    def collect(self) -> list[Metric]:
        """The metrics, in the order they were registered."""
        return list(self._metrics.copy().values())

    def __repr__(self) -> str:
        return f"<Registry of {len(self._metrics)} metrics>"


Key = tuple[str, str]
Suffixes = Sequence[tuple[str, ...]]

EXPIRED = "(expired)"
"""The ``group`` label of the series that finished groups are folded into."""


class Expiry:
    """The running and the finished ``(group, role)`` keys of a recorder, and the fold.

    Args:
        keep: how many finished keys keep their own series.
        folded: each counter or histogram labelled ``(group, role, ...)``,
            with every value the labels after ``role`` can take.
        dropped: each gauge labelled so, with its suffixes likewise.
    """

    def __init__(
        self,
        keep: int,
        folded: Sequence[tuple[_Scalar | Histogram, Suffixes]],
        dropped: Sequence[tuple[Gauge, Suffixes]],
    ) -> None:
        self.keep = keep
        self.running: dict[Key, int] = {}
        """Keys with something started and not over: how many such things."""
        self.finished: OrderedDict[Key, None] = OrderedDict()
        """Keys with nothing running that keep their series, oldest first."""
        self._folded = folded
        self._dropped = dropped

    def started(self, key: Key) -> None:
        """A group or a worker of ``key`` started."""
        self.running[key] = self.running.get(key, 0) + 1
        self.finished.pop(key, None)

    def ended(self, key: Key) -> None:
        """A group or a worker of ``key`` is over."""
        left = self.running.get(key, 0) - 1
        if left > 0:
            self.running[key] = left
        else:
            self.running.pop(key, None)
            self.touched(key)

    def touched(self, key: Key) -> None:
        """Something else was recorded for ``key`` while nothing of it runs.

        The caller checks ``key not in running`` first: for a running key,
        which is nearly every event, this costs no call.
        """
        finished = self.finished
        finished[key] = None
        finished.move_to_end(key)
        while len(finished) > self.keep:
            old, _ = finished.popitem(last=False)
            self._expire(old)

    def _expire(self, key: Key) -> None:
        into = (EXPIRED, key[1])
        for family, suffixes in self._folded:
            for suffix in suffixes:
                if isinstance(family, Histogram):
                    row = family._pop((*key, *suffix))
                    if row is not None:
                        family._merge((*into, *suffix), row)
                else:
                    value = family._pop((*key, *suffix))
                    if value is not None:
                        family._add((*into, *suffix), value)
        for gauge, suffixes in self._dropped:
            for suffix in suffixes:
                gauge._pop((*key, *suffix))

    def __repr__(self) -> str:
        return f"<Expiry running={len(self.running)} finished={len(self.finished)}/{self.keep}>"
