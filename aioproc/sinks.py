"""Where tee'd worker lines go: the console, a file, a callback, an async iterator.

A sink receives whole lines (never a fragment) and progress-bar updates from
the output readers, on the event loop thread, in order.  Pass sinks to
``start_processes(..., sinks=[...])``; the default is one ``ConsoleSink``.
A sink belongs to the group it was given to: the group calls ``aclose()``
when it is closed.

Console rendering (``ConsoleSink``):

* On a terminal, each rank with a running progress bar owns one status line
  at the bottom of the screen, redrawn in place (the latest update wins,
  redraws are coalesced to at most one per ``redraw_interval``); ordinary
  lines scroll above the status lines.  The screen is shared by every
  ``ConsoleSink`` writing to the same stream, so several groups never
  garble each other.
* Elsewhere (a pipe, a file, CI logs), a bar is printed as an ordinary
  prefixed line at most once per ``status_interval`` per rank, and its final
  state is printed once when it finishes.
* With ``write=`` (for example ``tqdm.write`` or ``rich.console.Console.print``)
  lines go through that function, so a progress bar the parent draws itself
  is never garbled; status updates are then shown only in their final state.

Writes to a console that can block (a pipe, a terminal, a socket) never block
the event loop: they go through a bounded non-blocking buffer
(``aioproc._console``).  When the console, the queue of an async
``CallbackSink`` or an ``OutputStream`` falls behind, the output readers
pause and the workers block on their own pipes (backpressure), so the
supervisor's memory stays bounded; the log files still get every byte.

A sink that raises is isolated: the error is logged once on the ``aioproc``
logger, naming the sink, and neither the workers, the log files, the other
sinks nor the verdict notice.  At close, sinks get ``SINK_CLOSE_DEADLINE``
seconds in total to drain (``close_sinks``); what is left then is dropped
and counted in one warning.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import shutil
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, TextIO, TypeVar

from ._console import ConsoleWriter, console_write, safe_write
from ._flow import HARD_LIMIT, HIGH_WATER, LOW_WATER, RECORD_OVERHEAD, Flow

__all__ = [
    "CallbackSink",
    "ConsoleSink",
    "FileSink",
    "OutputLine",
    "OutputStream",
    "Sink",
]

logger = logging.getLogger("aioproc")

SINK_CLOSE_DEADLINE = 5.0
"""Seconds ``close_sinks`` waits in total for the sinks of a group to drain."""

_CANCEL_GRACE = 0.5
"""Seconds a sink's cancelled ``aclose()`` gets to unwind before it is left behind."""


class OutputLine(NamedTuple):
    """One line a worker wrote (without its newline)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    line: str
    prefix: str

    def render(self) -> str:
        return f"{self.prefix}{self.line}"


class Sink:
    """Base class: override ``lines`` (and optionally ``status``, ``aclose``)."""

    # the flow readers watch to pause while this sink's buffer is full (None: no buffer)
    _backpressure: Flow | None = None

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        """Receive complete lines of one worker stream, in order."""
        raise NotImplementedError

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        """The current state of a progress bar; ``None`` when the stream ended."""

    async def aclose(self) -> None:
        """Flush and release resources; called when the group is closed."""

    def _drop_pending(self) -> int:
        """Drop what is still buffered; the number of lines lost (ever) not yet reported."""
        return 0


# ------------------------------------------------------------------- errors

_reported: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_reported_ids: dict[int, set[str]] = {}  # sinks that cannot be weakly referenced


def report_sink_error(sink: object, what: str) -> None:
    """Log the exception being handled, once per sink and method.

    Called from an ``except`` block.  Later failures of the same sink and
    method are logged at debug level only: a sink raising on every line
    must not flood the log.
    """
    try:
        seen = _reported.setdefault(sink, set())
    except TypeError:
        seen = _reported_ids.setdefault(id(sink), set())
    if what in seen:
        logger.debug("sink %r failed again in %s", sink, what, exc_info=True)
        return
    seen.add(what)
    logger.error(
        "sink %r raised in %s; ignored (the workers, log files and other sinks are "
        "unaffected; later failures of this sink are not logged)",
        sink,
        what,
        exc_info=True,
    )


# ------------------------------------------------------------------ console


class _Screen:
    """The bottom-of-terminal status area of one text stream (shared)."""

    # keyed by the terminal itself: stdout and stderr on one tty share a screen
    _screens: dict[tuple[int, ...], _Screen] = {}  # noqa: RUF012

    @classmethod
    def of(cls, stream: TextIO) -> _Screen:
        try:
            st = os.fstat(stream.fileno())
            key: tuple[int, ...] = (st.st_dev, st.st_ino, st.st_rdev)
        except (AttributeError, OSError, ValueError):
            key = (id(stream),)
        screen = cls._screens.get(key)
        if screen is None:
            screen = cls._screens[key] = cls(stream)
        screen.stream = stream
        return screen

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.statuses: dict[tuple[int, str, str], str] = {}
        self._drawn = 0  # status lines currently on screen
        self._redraw: asyncio.TimerHandle | None = None
        self._redraw_loop: asyncio.AbstractEventLoop | None = None

    def write_lines(self, text: str) -> ConsoleWriter | None:
        return self._write(self._erase() + text + self._render())

    def set_status(self, key: tuple[int, str, str], text: str | None, interval: float) -> None:
        if text is None:
            if self.statuses.pop(key, None) is not None:
                self._write(self._erase() + self._render())
            return
        self.statuses[key] = text
        loop = asyncio.get_running_loop()
        if self._redraw is not None and self._redraw_loop is not loop:
            self._redraw = None  # scheduled on a loop that is gone
        if self._redraw is None:
            self._redraw = loop.call_later(interval, self._redraw_now)
            self._redraw_loop = loop

    def _redraw_now(self) -> None:
        self._redraw = None
        self._write(self._erase() + self._render())

    def _erase(self) -> str:
        if not self._drawn:
            return ""
        n, self._drawn = self._drawn, 0
        return f"\x1b[{n}F\x1b[J"  # up n lines to column 0, clear to end of screen

    def _render(self) -> str:
        if not self.statuses:
            return ""
        width = max(shutil.get_terminal_size().columns - 1, 10)
        rows = [f"{prefix}{text}"[:width] for (_, _, prefix), text in self.statuses.items()]
        self._drawn = len(rows)
        return "".join(f"{row}\n" for row in rows)

    def _write(self, text: str) -> ConsoleWriter | None:
        if text:
            return console_write(self.stream, text)
        return None


class ConsoleSink(Sink):
    """Prefixed lines on the parent's stdout/stderr (see the module docstring).

    Writes never block the event loop: a console that does not keep up
    (a pipe nobody reads) fills a bounded buffer, then the workers feeding
    it are paused.  Characters the console's encoding cannot represent are
    written as backslash escapes.

    Args:
        stream: write everything here instead of sys.stdout/sys.stderr
            (chosen per worker stream at write time).
        write: a function taking one line (without newline), e.g.
            ``tqdm.write``, used instead of writing to a stream.  It is
            called on the event loop and must not block.
        status_interval: seconds between printed updates of one progress
            bar when not on a terminal.
        redraw_interval: seconds between redraws of the status lines on a
            terminal.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        write: Callable[[str], Any] | None = None,
        status_interval: float = 1.0,
        redraw_interval: float = 0.05,
    ) -> None:
        self._stream = stream
        self._write = write
        self._status_interval = status_interval
        self._redraw_interval = redraw_interval
        self._last_printed: dict[tuple[int, str, str], tuple[float, str]] = {}
        self._keys: set[tuple[int, str, str]] = set()
        self._backpressure = Flow()
        self._writers: list[ConsoleWriter] = []

    def __repr__(self) -> str:
        target = "write=" + repr(self._write) if self._write is not None else self._stream
        return f"ConsoleSink({target or ''})"

    def _target(self, stream: str) -> TextIO:
        if self._stream is not None:
            return self._stream
        return sys.stderr if stream == "stderr" else sys.stdout

    def _used(self, writer: ConsoleWriter | None) -> None:
        """Follow a console writer's fullness (it pauses the readers feeding this sink).

        Only a writer left with bytes pending can fill up; one that took
        everything is followed once it does not.
        """
        if writer is not None and writer.pending and writer not in self._writers:
            self._writers.append(writer)
            writer.flow.watch(self._on_writer_flow)

    def _on_writer_flow(self, flow: Flow, blocked: bool) -> None:
        assert self._backpressure is not None
        if blocked:
            self._backpressure.hold(flow)
        else:
            self._backpressure.release(flow)

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        key = (rank, stream, prefix)
        last = self._last_printed.pop(key, None)
        if last is not None and lines and lines[0] == last[1]:
            lines = lines[1:]  # the bar's final state was just printed as its last update
            if not lines:
                return
        if self._write is not None:
            for line in lines:
                self._write(f"{prefix}{line}")
            return
        target = self._target(stream)
        sep = "\n" + prefix
        text = prefix + sep.join(lines) + "\n"
        if _isatty(target):
            screen = _Screen.of(target)
            screen.statuses.pop(key, None)
            self._used(screen.write_lines(text))
        else:
            self._used(console_write(target, text))

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        key = (rank, stream, prefix)
        target = self._target(stream)
        if self._write is None and _isatty(target):
            if text is not None:
                self._keys.add(key)
            _Screen.of(target).set_status(key, text, self._redraw_interval)
            return
        if text is None:
            return
        now = time.monotonic()
        last = self._last_printed.get(key)
        if last is not None and now - last[0] < self._status_interval:
            return
        self._last_printed[key] = (now, text)
        if self._write is not None:
            self._write(f"{prefix}{text}")
        else:
            self._used(console_write(target, f"{prefix}{text}\n"))

    async def aclose(self) -> None:
        """Clear the status lines, then wait while the console accepts what is
        buffered (a console that accepts nothing for ``_console.STALL_TIMEOUT``
        seconds is given up: see ``close_sinks``)."""
        for key in self._keys:
            for target in {self._target("stdout"), self._target("stderr")}:
                if _isatty(target):
                    _Screen.of(target).set_status(key, None, 0)
        self._keys.clear()
        for writer in self._writers:
            if writer.loop is asyncio.get_running_loop():
                await writer.drain()

    def _drop_pending(self) -> int:
        dropped = 0
        for writer in self._writers:
            dropped += writer.abandon()  # releases its flow: readers resume
            writer.flow.unwatch(self._on_writer_flow)
            self._on_writer_flow(writer.flow, False)
        self._writers.clear()
        return dropped


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --------------------------------------------------------------------- file


class FileSink(Sink):
    """Appends prefixed lines to a text file (path) or an open text stream."""

    def __init__(self, target: str | TextIO) -> None:
        self._path = target if isinstance(target, str) else None
        self._file: TextIO | None = None if isinstance(target, str) else target

    def __repr__(self) -> str:
        return f"FileSink({self._path if self._path is not None else self._file!r})"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        if self._file is None:
            assert self._path is not None
            # opened on first use, on the loop: a local file open is quick
            self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115
        safe_write(self._file, "".join(f"{prefix}{line}\n" for line in lines))

    async def aclose(self) -> None:
        if self._path is not None and self._file is not None:
            self._file.close()
            self._file = None


class _FilteredFileSink(FileSink):
    """torch's duplicate filters: lines containing a needle also go to a file."""

    def __init__(self, path: str, needles: Iterable[str]) -> None:
        super().__init__(path)
        self._needles = tuple(needles)

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        hits = [line for line in lines if any(n in line for n in self._needles)]
        if hits:
            super().lines(rank, stream, prefix, hits)


# ------------------------------------------------------------------- queues

T = TypeVar("T")


class _LineQueue(Generic[T]):
    """A FIFO of records, bounded by their size in bytes, with backpressure.

    Past ``HIGH_WATER`` its flow is held (the readers pause); below
    ``LOW_WATER`` released.  Past ``HARD_LIMIT`` (readers that ignore
    backpressure: a worker's last output after it exited) records are
    dropped and counted in ``dropped``.  ``end()`` adds an end marker that is
    never dropped.
    """

    def __init__(self) -> None:
        self._items: collections.deque[tuple[T | None, int]] = collections.deque()
        self._cost = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.flow = Flow()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T, size: int) -> bool:
        """Append ``item`` of ``size`` text bytes; False (dropped) past the hard limit."""
        cost = size + RECORD_OVERHEAD
        if self._cost + cost > HARD_LIMIT:
            self.dropped += 1
            return False
        self._items.append((item, cost))
        self._cost += cost
        if self._cost >= HIGH_WATER:
            self.flow.hold(self)
        self._wake()
        return True

    def end(self) -> None:
        self._items.append((None, 0))
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def get(self) -> T | None:
        """The next record; None for the end marker."""
        while not self._items:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the wake-up on to another getter
                raise
        item, cost = self._items.popleft()
        self._cost -= cost
        if self._cost < LOW_WATER:
            self.flow.release(self)
        return item

    def clear(self) -> list[T]:
        """Remove and return every record (not end markers)."""
        items = [item for item, _ in self._items if item is not None]
        self._items.clear()
        self._cost = 0
        self.flow.release(self)
        return items


# ----------------------------------------------------------------- callbacks

_Job = tuple[OutputLine, "Awaitable[Any] | None"]


class CallbackSink(Sink):
    """Calls ``fn(OutputLine)`` for every line; ``fn`` may be a coroutine function.

    Async callbacks (coroutine functions, or callables returning an
    awaitable such as ``lambda rec: queue.put(rec)``) run one at a time, in
    order, in a task of their own, so a slow callback delays only itself,
    never the readers.  Its queue is bounded: when it is full the readers
    pause and the workers block on their pipes.  An exception from ``fn``
    is logged once and the next line is delivered as usual.
    """

    def __init__(self, fn: Callable[[OutputLine], Awaitable[Any] | Any]) -> None:
        self._fn = fn
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with async __call__
        )
        self._queue: _LineQueue[_Job] = _LineQueue()
        self._backpressure = self._queue.flow
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"CallbackSink({self._fn!r})"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        records = [OutputLine(rank, stream, line, prefix) for line in lines]
        if not self._async:
            for i, rec in enumerate(records):
                try:
                    result = self._fn(rec)
                except Exception:
                    report_sink_error(self, "its callback")
                    continue
                if inspect.isawaitable(result):
                    # it returns awaitables: from now on it runs in the drain task
                    self._async = True
                    self._enqueue([(rec, result)] + [(r, None) for r in records[i + 1 :]])
                    return
            return
        self._enqueue([(rec, None) for rec in records])

    def _enqueue(self, jobs: list[_Job]) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name=f"aioproc-sink-{self._fn!r}"
            )
        for job in jobs:
            if not self._queue.put(job, len(job[0].line)):
                _discard(job[1])

    async def _drain(self) -> None:
        while (job := await self._queue.get()) is not None:
            rec, pending = job
            try:
                if pending is None:
                    pending = self._fn(rec)
                if inspect.isawaitable(pending):
                    await pending
            except Exception:
                report_sink_error(self, "its callback")

    async def aclose(self) -> None:
        """Wait until every queued line was handed to the callback."""
        if self._task is not None and not self._task.done():
            self._queue.end()
            await self._task

    def _drop_pending(self) -> int:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        left = self._queue.clear()
        for _, pending in left:
            _discard(pending)
        dropped = len(left) + self._queue.dropped
        self._queue.dropped = 0
        return dropped


def _discard(pending: Awaitable[Any] | None) -> None:
    """Close an awaitable that will never be awaited (no 'never awaited' warning)."""
    close = getattr(pending, "close", None)
    if inspect.iscoroutine(pending) and close is not None:
        close()


class OutputStream(Sink):
    """An async iterator of ``OutputLine`` records; ends when the group is closed.

    ``async for rec in stream: ...`` in a task of its own, while the group
    runs.  The buffer is bounded: while the consumer lags more than about a
    megabyte behind, the workers feeding it are paused (they block on their
    pipes).  Records buffered when the group closes can still be read.
    """

    def __init__(self) -> None:
        self._queue: _LineQueue[OutputLine] = _LineQueue()
        self._backpressure = self._queue.flow
        self._closed = False

    def __repr__(self) -> str:
        return f"<OutputStream {len(self._queue)} buffered{' closed' if self._closed else ''}>"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        for line in lines:
            self._queue.put(OutputLine(rank, stream, line, prefix), len(line))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.end()

    def _drop_pending(self) -> int:
        # what is buffered stays readable after close; only overflow was lost
        dropped, self._queue.dropped = self._queue.dropped, 0
        return dropped

    def __aiter__(self) -> AsyncIterator[OutputLine]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[OutputLine]:
        while (rec := await self._queue.get()) is not None:
            yield rec
        self._queue.end()  # every other iteration ends too


# -------------------------------------------------------------------- close


async def close_sinks(sinks: Sequence[Sink], deadline: float | None = None) -> None:
    """Close every sink, giving them ``deadline`` seconds in total to drain.

    ``deadline`` defaults to ``SINK_CLOSE_DEADLINE`` (5 s).
    The sinks are closed concurrently.  Past the deadline, the ``aclose()``
    calls still running are cancelled and what the sinks still buffer is
    dropped; the number of lines lost is logged in one warning.  A sink
    whose ``aclose()`` raises is logged (``report_sink_error``).  Never
    raises for a sink's sake, so the caller's cleanup always completes.

    Cancellation: cancelling this cancels the ``aclose()`` calls, drops
    what is buffered and re-raises; callers run it shielded.
    """
    if not sinks:
        return
    if deadline is None:
        deadline = SINK_CLOSE_DEADLINE
    loop = asyncio.get_running_loop()
    tasks = {
        loop.create_task(_aclose(sink), name=f"aioproc-close-{sink!r}"): sink for sink in sinks
    }
    try:
        _, pending = await asyncio.wait(tasks, timeout=max(deadline, 0.0))
    except BaseException:
        pending = {t for t in tasks if not t.done()}
        _give_up(tasks, pending)
        raise
    late = _give_up(tasks, pending)
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=_CANCEL_GRACE)
        for task in stuck:
            logger.error("sink %r did not stop when cancelled; left behind", tasks[task])
    if late:
        logger.warning(
            "%d line(s) of worker output were dropped: sink(s) %s had not taken them "
            "when the group closed (they get %g s to drain; a console that accepts "
            "nothing is given up sooner); the log files have every line",
            sum(n for _, n in late),
            ", ".join(repr(s) for s, _ in late),
            deadline,
        )


def _give_up(
    tasks: dict[asyncio.Task[None], Sink], pending: set[asyncio.Task[None]]
) -> list[tuple[Sink, int]]:
    """Cancel the pending closes, drop every sink's leftovers; lines lost per sink."""
    for task in pending:
        task.cancel()
    late: list[tuple[Sink, int]] = []
    for sink in tasks.values():
        try:
            n = sink._drop_pending()
        except Exception:
            report_sink_error(sink, "_drop_pending()")
            continue
        if n:
            late.append((sink, n))
    return late


async def _aclose(sink: Sink) -> None:
    try:
        await sink.aclose()
    except Exception:
        report_sink_error(sink, "aclose()")
