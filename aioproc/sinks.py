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
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NamedTuple, TextIO

__all__ = [
    "CallbackSink",
    "ConsoleSink",
    "FileSink",
    "OutputLine",
    "OutputStream",
    "Sink",
]


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

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        """Receive complete lines of one worker stream, in order."""
        raise NotImplementedError

    def status(self, rank: int, stream: str, prefix: str, text: str | None) -> None:
        """The current state of a progress bar; ``None`` when the stream ended."""

    async def aclose(self) -> None:
        """Flush and release resources; called when the group is closed."""


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

    def write_lines(self, text: str) -> None:
        self._write(self._erase() + text + self._render())

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

    def _write(self, text: str) -> None:
        if text:
            _safe_write(self.stream, text)


def _safe_write(stream: TextIO, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass  # console gone (closed pipe or file): the log file still has it


class ConsoleSink(Sink):
    """Prefixed lines on the parent's stdout/stderr (see the module docstring).

    Args:
        stream: write everything here instead of sys.stdout/sys.stderr
            (chosen per worker stream at write time).
        write: a function taking one line (without newline), e.g.
            ``tqdm.write``, used instead of writing to a stream.
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

    def _target(self, stream: str) -> TextIO:
        if self._stream is not None:
            return self._stream
        return sys.stderr if stream == "stderr" else sys.stdout

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
            screen.write_lines(text)
        else:
            _safe_write(target, text)

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
            _safe_write(target, f"{prefix}{text}\n")

    async def aclose(self) -> None:
        for key in self._keys:
            for target in {self._target("stdout"), self._target("stderr")}:
                if _isatty(target):
                    _Screen.of(target).set_status(key, None, 0)
        self._keys.clear()


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

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        if self._file is None:
            assert self._path is not None
            # opened on first use, on the loop: a local file open is quick
            self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115
        _safe_write(self._file, "".join(f"{prefix}{line}\n" for line in lines))

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


# ----------------------------------------------------------------- callbacks


class CallbackSink(Sink):
    """Calls ``fn(OutputLine)`` for every line; ``fn`` may be a coroutine function.

    Async callbacks run one at a time, in order, in a task of their own, so a
    slow callback delays only itself, never the readers.
    """

    def __init__(self, fn: Callable[[OutputLine], Awaitable[Any] | Any]) -> None:
        self._fn = fn
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with async __call__
        )
        self._queue: asyncio.Queue[OutputLine | None] | None = None
        self._task: asyncio.Task[None] | None = None

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        records = [OutputLine(rank, stream, line, prefix) for line in lines]
        if not self._async:
            for rec in records:
                self._fn(rec)
            return
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._drain())
        for rec in records:
            self._queue.put_nowait(rec)

    async def _drain(self) -> None:
        assert self._queue is not None
        while (rec := await self._queue.get()) is not None:
            await self._fn(rec)

    async def aclose(self) -> None:
        if self._queue is not None and self._task is not None:
            self._queue.put_nowait(None)
            await self._task


class OutputStream(Sink):
    """An async iterator of ``OutputLine`` records; ends when the group is closed.

    ``async for rec in stream: ...`` in a task of its own.  The buffer is
    unbounded so the readers never wait for the consumer.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[OutputLine | None] = asyncio.Queue()
        self._closed = False

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        for line in lines:
            self._queue.put_nowait(OutputLine(rank, stream, line, prefix))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[OutputLine]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[OutputLine]:
        while (rec := await self._queue.get()) is not None:
            yield rec
        self._queue.put_nowait(None)  # every other iteration ends too
