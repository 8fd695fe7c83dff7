"""Where tee'd worker lines go: the console, a file, a logger, a callback, an async iterator.

A sink receives whole lines (never a fragment) and progress-bar updates from
the output readers, on the event loop thread, in order: as lists of lines
(``Sink.lines``), or, for a sink that overrides ``Sink.text``, plain runs of
lines as one string each.  Pass sinks to
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
(``aioproc._output.console``).  When the console, the queue of an async
``CallbackSink`` or an ``OutputStream`` falls behind, the output readers
pause and the workers block on their own pipes (backpressure), so the
supervisor's memory stays bounded; the log files still get every byte.
A sink that keeps workers paused for ``stall_warning`` seconds (default
``STALL_WARNING``, 10 s; ``None``: never) is named in one warning on the
``aioproc`` logger, with the workers it holds back and what it has pending.
The built-in sinks take part through the same public contract a sink of
your own uses: a ``Flow`` in the sink's ``flow`` attribute, held while its
buffer is full, plus ``Sink.describe_pending`` and ``Sink.drop_pending``
(see ``Sink``).

A sink that raises is isolated: the error is logged once on the ``aioproc``
logger, naming the sink, and neither the workers, the log files, the other
sinks nor the verdict notice.  At close, sinks get ``SINK_CLOSE_DEADLINE``
seconds in total to drain (``close_sinks``); what is left then is dropped
and counted in one warning.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TextIO

from ._base.checks import check_duration
from ._output.console import (
    ConsoleWriter,
    Screen,
    console_write,
    console_write_ascii,
    release_consoles,
    safe_write,
    write_ascii,
)
from ._output.flow import STALL_WARNING, Flow, format_size
from ._output.sink import OutputLine, Sink
from ._output.sinkops import SINK_CLOSE_DEADLINE as SINK_CLOSE_DEADLINE
from ._output.sinkops import LineQueue, discard, report_sink_error
from ._output.sinkops import close_sinks as close_sinks

__all__ = [
    "CallbackSink",
    "ConsoleSink",
    "FileSink",
    "Flow",
    "LoggingSink",
    "OutputLine",
    "OutputStream",
    "Sink",
]


# defined with the output machinery (which must not import this module), and
# shown, pickled and documented as this module's
Flow.__module__ = __name__
OutputLine.__module__ = __name__
Sink.__module__ = __name__


# ------------------------------------------------------------------ console


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
        stall_warning: seconds the console may keep workers paused (it
            accepts nothing: a pipe nobody reads, a frozen terminal) before
            a warning says so; ``None``: never.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        write: Callable[[str], Any] | None = None,
        status_interval: float = 1.0,
        redraw_interval: float = 0.05,
        stall_warning: float | None = STALL_WARNING,
    ) -> None:
        self._stream = stream
        self._write = write
        self._status_interval = check_duration("status_interval", status_interval)
        self._redraw_interval = check_duration("redraw_interval", redraw_interval)
        self._last_printed: dict[tuple[int, str, str], tuple[float, str]] = {}
        self._keys: set[tuple[int, str, str]] = set()
        self.flow = Flow(
            self,
            stall_warning=stall_warning,
            hint="the supervisor's stdout/stderr is a pipe nobody reads, or a paused terminal",
        )
        self._writers: list[ConsoleWriter] = []

    def __repr__(self) -> str:
        target = "write=" + repr(self._write) if self._write is not None else self._stream
        return f"ConsoleSink({target or ''})"

    def describe_pending(self) -> str:
        pending = sum(w.pending for w in self._writers)
        return f"holds {format_size(pending)} the console has not accepted"

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
        # this sink's flow is held while any console writer it uses is full
        assert self.flow is not None
        if blocked:
            self.flow.hold(flow)
        else:
            self.flow.release(flow)

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
        sep = "\n" + prefix
        self._put(key, stream, prefix + sep.join(lines) + "\n")

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        key = (rank, stream, prefix)
        if self._write is not None or key in self._last_printed:
            super().text(rank, stream, prefix, text)  # line by line
            return
        target = self._target(stream)
        data = _prefixed_ascii(prefix, text)
        if data is not None and not _isatty(target):
            self._used(console_write_ascii(target, data))
            return
        self._put(key, stream, prefix + text.replace("\n", "\n" + prefix) + "\n")

    def _put(self, key: tuple[int, str, str], stream: str, text: str) -> None:
        """Prefixed, newline-ended lines to the console of ``stream``."""
        target = self._target(stream)
        if _isatty(target):
            screen = Screen.of(target)
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
            Screen.of(target).set_status(key, text, self._redraw_interval)
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
                    Screen.of(target).set_status(key, None, 0)
        self._keys.clear()
        for writer in self._writers:
            if writer.loop is asyncio.get_running_loop():
                await writer.drain()
        release_consoles()  # the private fds kept for the next writes

    def drop_pending(self) -> int:
        dropped = 0
        for writer in self._writers:
            dropped += writer.abandon()  # releases its flow: readers resume
            writer.flow.unwatch(self._on_writer_flow)
            self._on_writer_flow(writer.flow, False)
        self._writers.clear()
        return dropped


def _prefixed_ascii(prefix: str, text: str) -> bytes | None:
    """``text``'s lines, prefixed and newline-ended, as bytes; None unless all ASCII.

    ASCII text is prefixed as bytes (a third of the time of ``str.replace``)
    and needs no encoding on its way out.
    """
    if not (text.isascii() and prefix.isascii()):
        return None
    pre = prefix.encode("ascii")
    # one copy of the result: ``a + b + c`` would copy it twice
    return b"".join((pre, text.encode("ascii").replace(b"\n", b"\n" + pre), b"\n"))


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
        self._put("".join(f"{prefix}{line}\n" for line in lines))

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        data = _prefixed_ascii(prefix, text)
        if data is not None:
            write_ascii(self._open(), data)
        else:
            self._put(prefix + text.replace("\n", "\n" + prefix) + "\n")

    def _put(self, text: str) -> None:
        safe_write(self._open(), text)

    def _open(self) -> TextIO:
        if self._file is None:
            assert self._path is not None
            # opened on first use, on the loop: a local file open is quick
            self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115
        return self._file

    async def aclose(self) -> None:
        if self._path is not None and self._file is not None:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------ logging


class LoggingSink(Sink):
    """Sends every line to a stdlib ``logging`` logger, for services.

    Each line is one record, ``"<prefix><line>"``, with ``rank``, ``stream``
    and ``prefix`` as ``extra`` attributes for formatters and filters.
    Logging is synchronous: the handlers configured on ``logger`` run on the
    event loop, so they should not block (use a ``QueueHandler`` for slow
    destinations).

    Args:
        logger: a ``logging.Logger`` or a logger name (default
            ``"aioproc.workers"``).
        level: the level of stdout lines (default INFO).
        stderr_level: the level of stderr lines (default: ``level``).
    """

    def __init__(
        self,
        logger: logging.Logger | str = "aioproc.workers",
        level: int = logging.INFO,
        stderr_level: int | None = None,
    ) -> None:
        if isinstance(logger, str):
            logger = logging.getLogger(logger)
        if not isinstance(logger, logging.Logger):
            raise TypeError(f"logger must be a logging.Logger or a name, got {logger!r}")
        for what, value in (("level", level), ("stderr_level", stderr_level)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{what} must be a logging level (an int), got {value!r}")
        self._logger = logger
        self._levels = {"stdout": level, "stderr": level if stderr_level is None else stderr_level}

    def __repr__(self) -> str:
        return f"LoggingSink({self._logger.name!r})"

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        level = self._levels.get(stream, self._levels["stdout"])
        if not self._logger.isEnabledFor(level):
            return
        extra = {"rank": rank, "stream": stream, "prefix": prefix}
        for line in lines:
            self._logger.log(level, "%s%s", prefix, line, extra=extra)


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

    Args:
        fn: called with each ``OutputLine``.
        stall_warning: seconds a slow async callback may keep workers
            paused before a warning says so; ``None``: never.
    """

    def __init__(
        self,
        fn: Callable[[OutputLine], Awaitable[Any] | Any],
        *,
        stall_warning: float | None = STALL_WARNING,
    ) -> None:
        self._fn = fn
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with async __call__
        )
        self.flow = Flow(
            self,
            stall_warning=stall_warning,
            hint="the callback is slower than the workers' output",
        )
        self._queue: LineQueue[_Job] = LineQueue(self.flow)
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
                discard(job[1])

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

    def describe_pending(self) -> str:
        return _describe_queue(self._queue, "its callback has not taken yet")

    def drop_pending(self) -> int:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        left = self._queue.clear()
        for _, pending in left:
            discard(pending)
        dropped = len(left) + self._queue.dropped
        self._queue.dropped = 0
        return dropped


class OutputStream(Sink):
    """An async iterator of ``OutputLine`` records; ends when the group is closed.

    ``async for rec in stream: ...`` in a task of its own, while the group
    runs.  The buffer is bounded: while the consumer lags more than about a
    megabyte behind, the workers feeding it are paused (they block on their
    pipes).  Records buffered when the group closes can still be read.
    A stream nobody reads while the group runs (read only after
    ``await pc.wait()``, say) holds the workers forever once it is full:
    after ``stall_warning`` seconds a warning names the stream, the paused
    workers and what it holds.

    Args:
        stall_warning: seconds the stream may keep workers paused before
            the warning; ``None``: never.
    """

    def __init__(self, *, stall_warning: float | None = STALL_WARNING) -> None:
        self.flow = Flow(
            self,
            stall_warning=stall_warning,
            hint="iterate the stream in a task of its own while the group runs, not after wait()",
        )
        self._queue: LineQueue[OutputLine] = LineQueue(self.flow)
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

    def describe_pending(self) -> str:
        return _describe_queue(self._queue, "unread")

    def drop_pending(self) -> int:
        # what is buffered stays readable after close; only overflow was lost
        dropped, self._queue.dropped = self._queue.dropped, 0
        return dropped

    def __aiter__(self) -> AsyncIterator[OutputLine]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[OutputLine]:
        while (rec := await self._queue.get()) is not None:
            yield rec
        self._queue.end()  # every other iteration ends too


def _describe_queue(queue: LineQueue[Any], state: str) -> str:
    return f"holds {format_size(queue.size)} ({len(queue)} lines) {state}"
