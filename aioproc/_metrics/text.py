"""Prometheus's text exposition format, version 0.0.4, without prometheus_client.

The output is what ``prometheus_client.generate_latest`` writes for the
same values (labels sorted by name, floats written as Go writes them), so
a scrape sees the same bytes whichever exporter serves it.

**Slices.**
A page of thousands of series takes a fraction of a second to write, far
past the 5 ms a service embedding aioproc can give one callback: a
worker's exit, a request, a timer would wait for the whole page.  So every
exporter that runs on a loop (the server, the ASGI app, the aiohttp
handler) renders with ``render_chunks``: it writes pieces of the text
format (a family's header, or one series) for ``SLICE`` seconds, encodes
them as one chunk, and gives the loop a pause before the next slice.

Not the helper thread of ``_base.offloop``: rendering is pure Python, so on
a thread it would hold the GIL the loop needs (the loop would wait up to
the interpreter's switch interval after every system call), and it would
queue behind, and delay, the starts and stops that thread is for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import anyio

from .families import Counter, Gauge, Histogram, Metric, Registry

__all__ = ["CONTENT_TYPE", "PAUSE", "SLICE", "format_float", "pieces", "render", "render_chunks"]

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
    if "\\" not in text and "\n" not in text and '"' not in text:
        return text  # nearly every value: nothing to escape
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Labels:
    """Writes a family's label sets, sorted by name as ``prometheus_client`` sorts them.

    The order is worked out once per family, not once per line: a histogram
    writes a line per bucket of every series.
    """

    def __init__(self, names: Sequence[str], le: bool = False) -> None:
        order = sorted(range(len(names)), key=names.__getitem__)
        self._order = order
        self._names = [names[i] for i in order]
        # where "le" goes among the sorted names of a histogram's bucket lines
        self._le_at = sum(1 for n in self._names if n < "le") if le else 0

    def pairs(self, values: Sequence[str]) -> list[str]:
        return [
            f'{name}="{_escape_value(values[i])}"'
            for name, i in zip(self._names, self._order, strict=True)
        ]

    def plain(self, values: Sequence[str]) -> str:
        return "{" + ",".join(self.pairs(values)) + "}" if self._names else ""

    def around_le(self, values: Sequence[str]) -> tuple[str, str]:
        """What comes before a bucket's ``le="..."`` and after it: ``('{a="x",', ',z="y"}')``."""
        pairs = self.pairs(values)
        before = "".join(p + "," for p in pairs[: self._le_at])
        after = "".join("," + p for p in pairs[self._le_at :])
        return "{" + before, after + "}"


def _family(metric: Metric) -> Iterator[str]:
    """The family's text: its header, then one string per series.

    The series are those of the moment the family is reached (one copy of
    its dict); each value is read as its series is written.
    """
    name = metric.name
    kind = metric.type if metric.type in ("counter", "gauge", "histogram") else "untyped"
    yield f"# HELP {name} {_escape_help(metric.documentation)}\n# TYPE {name} {kind}\n"
    if isinstance(metric, (Counter, Gauge)):
        labels = _Labels(metric.labelnames)
        for key, cell in metric._cells.copy().items():
            yield f"{name}{labels.plain(key)} {format_float(cell[0])}\n"
    elif isinstance(metric, Histogram):
        labels = _Labels(metric.labelnames, le=True)
        bounds = [f'le="{format_float(b)}"' for b in metric.buckets]
        bucket, count, total = f"{name}_bucket", f"{name}_count", f"{name}_sum"
        for key, row in metric._rows.copy().items():
            row = row.copy()  # one C-level copy: the row as it was, whole
            before, after = labels.around_le(key)
            plain = labels.plain(key)
            lines, n = [], 0.0
            for bound, k in zip(bounds, row, strict=False):
                n += k
                lines.append(f"{bucket}{before}{bound}{after} {format_float(n)}\n")
            lines.append(f"{count}{plain} {format_float(n)}\n")
            lines.append(f"{total}{plain} {format_float(row[-1])}\n")
            yield "".join(lines)


def pieces(metrics: Iterable[Metric]) -> Iterator[str]:
    """The text format of ``metrics`` in pieces: a family's header, or one series.

    ``"".join(pieces(metrics)) == render(metrics)``; a caller that must not
    hold its loop for the whole page writes it a slice of pieces at a time.
    """
    for metric in metrics:
        yield from _family(metric)


def render(metrics: Iterable[Metric]) -> str:
    """The text format of ``metrics``, one family after another, ending in a newline.

    Every family has its ``# HELP`` and ``# TYPE`` lines, also before it has
    a sample; a histogram's series write their cumulative ``_bucket`` lines
    (``le`` up to ``+Inf``), then ``_count`` and ``_sum``.
    """
    return "".join(pieces(metrics))


SLICE = 0.002
"""Seconds of rendering between two pauses."""

PAUSE = 0.001
"""Seconds the loop gets to itself after each slice.

Not one turn of the loop (``sleep(0)``): what a slice delays is often a
chain of callbacks, each scheduling the next (a worker's exit takes a
dozen steps from its pidfd to its event), and with one turn between
slices such a chain would advance a step per slice.  A pause lets it run
to its end; an idle loop pays it as a third more time to render a page."""

_CHECK_EVERY = 8  # pieces between two looks at the clock (a histogram series is ~20 us)


async def render_chunks(source: Callable[[], Registry | None]) -> list[bytes]:
    """The text format of ``source()``'s metrics as UTF-8 chunks; empty while it is None.

    Each family's series are the ones of the moment the render reaches it;
    the loop runs other callbacks between slices.

    Cancellation: nothing to clean up; the partial page is dropped.
    """
    registry = source()
    if registry is None:
        return []
    chunks: list[bytes] = []
    part: list[str] = []
    clock = time.perf_counter
    deadline = clock() + SLICE
    for n, piece in enumerate(pieces(registry.collect()), 1):
        part.append(piece)
        if not n % _CHECK_EVERY and clock() >= deadline:
            chunks.append("".join(part).encode())
            part = []
            await anyio.sleep(PAUSE)  # the loop's share, not a wait for anything
            deadline = clock() + SLICE
    if part:
        chunks.append("".join(part).encode())
    return chunks
