"""Prometheus's text exposition format, version 0.0.4, without prometheus_client.

The output is what ``prometheus_client.generate_latest`` writes for the
same values (labels sorted by name, floats written as Go writes them), so
a scrape sees the same bytes whichever exporter serves it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .families import Counter, Gauge, Histogram, Metric

__all__ = ["CONTENT_TYPE", "format_float", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of the text format, version 0.0.4."""


def format_float(value: float) -> str:
    """``value`` as the text format writes it: ``1.0``, ``0.25``, ``+Inf``, ``NaN``."""
    value = float(value)
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    # Go switches to an exponent sooner than Python: at 1e+07 rather than 1e+16
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in pairs) + "}"


def _family(metric: Metric) -> list[str]:
    name = metric.name
    kind = metric.type if metric.type in ("counter", "gauge", "histogram") else "untyped"
    lines = [f"# HELP {name} {_escape_help(metric.documentation)}", f"# TYPE {name} {kind}"]
    names = metric.labelnames
    if isinstance(metric, (Counter, Gauge)):
        for key, value in metric.samples():
            lines.append(f"{name}{_labels(names, key)} {format_float(value)}")
    elif isinstance(metric, Histogram):
        bounds = [format_float(b) for b in metric.buckets]
        with_le = (*names, "le")
        for key, cumulative, total, count in metric.samples():
            for bound, n in zip(bounds, cumulative, strict=True):
                lines.append(f"{name}_bucket{_labels(with_le, (*key, bound))} {format_float(n)}")
            labels = _labels(names, key)
            lines.append(f"{name}_count{labels} {format_float(count)}")
            lines.append(f"{name}_sum{labels} {format_float(total)}")
    return lines


def render(metrics: Iterable[Metric]) -> str:
    """The text format of ``metrics``, one family after another, ending in a newline.

    Every family has its ``# HELP`` and ``# TYPE`` lines, also before it has
    a sample; a histogram's series write their cumulative ``_bucket`` lines
    (``le`` up to ``+Inf``), then ``_count`` and ``_sum``.
    """
    lines: list[str] = []
    for metric in metrics:
        lines += _family(metric)
    return "".join(line + "\n" for line in lines)
