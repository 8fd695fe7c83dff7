"""Worker output: pipe -> raw bytes to the log file, whole lines to the sinks.

One ``TeeProtocol`` reads one piped stream of one worker.  Every chunk goes
to the log file unchanged; a ``LineSplitter`` turns the bytes into complete
lines and progress updates, which are handed to the sinks (``aioproc.sinks``:
console, file, callback, async iterator).  Since everything runs on the loop
thread and each sink writes a line in one call, a line of one rank can never
be cut by a line of another.

Framing rules:

* a partial line is held until its newline or EOF, then emitted once, whole;
* ``\\r`` inside a line marks a progress update (tqdm and friends): the
  segment after the last ``\\r`` is the bar's current state, reported as a
  *status*; when the line ends, only its final state is emitted as a line;
* a line longer than ``MAX_LINE`` bytes is emitted in pieces of
  ``MAX_LINE`` bytes, each a line of its own, so memory stays bounded;
* bytes are decoded as UTF-8 with replacement characters for the sinks; the
  log file gets the bytes unchanged.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, BinaryIO

from ._drain import ReadProgress

if TYPE_CHECKING:
    from .sinks import Sink

MAX_LINE = 64 * 1024
"""Longest line held back, in bytes; longer lines reach the sinks in pieces."""


def _decode(data: bytes | bytearray) -> str:
    return data.decode("utf-8", "replace")


class LineSplitter:
    """Splits a byte stream into lines and progress updates, whatever the chunking."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = bytearray()

    def feed(self, data: bytes) -> tuple[list[str], str | None]:
        """Consume ``data``; return the lines it completes and the latest status.

        The status is the current state of a progress bar (text after the
        last ``\\r`` of the unfinished line), or ``None`` if ``data`` did not
        update one.
        """
        held = self._held
        held += data
        lines: list[str] = []
        cut = held.rfind(b"\n")
        if cut >= 0:
            for raw in held[:cut].split(b"\n"):
                lines.extend(_final_state(raw))
            del held[: cut + 1]
        status: str | None = None
        if b"\r" in held:
            # a terminal shows only the last segment; keep just that one
            segments = held.split(b"\r")
            shown = [seg for seg in segments if seg]
            if shown:
                status = _decode(shown[-1])
                held[:] = b"\r" + shown[-1] + (b"" if segments[-1] else b"\r")
            else:
                held[:] = b"\r"
        if len(held) > MAX_LINE:
            if held[:1] == b"\r":
                del held[:1]  # a progress marker, not text
            while len(held) > MAX_LINE:
                cut = _char_boundary(held, MAX_LINE)
                lines.append(_decode(held[:cut]))
                del held[:cut]
            status = None
        return lines, status

    def flush(self) -> list[str]:
        """At EOF: the held partial line (or final progress state), if any."""
        if not self._held:
            return []
        raw, self._held = bytes(self._held), bytearray()
        return _final_state(raw)


def _final_state(raw: bytes | bytearray) -> list[str]:
    """The text a terminal would leave for one line: its last ``\\r`` segment."""
    if b"\r" in raw:
        segments = [s for s in raw.split(b"\r") if s]
        raw = segments[-1] if segments else b""
    pieces = []
    while len(raw) > MAX_LINE:
        cut = _char_boundary(raw, MAX_LINE)
        pieces.append(_decode(raw[:cut]))
        raw = raw[cut:]
    pieces.append(_decode(raw))
    return pieces


def _char_boundary(data: bytes | bytearray, limit: int) -> int:
    """The largest cut <= ``limit`` that does not split a UTF-8 character."""
    cut = limit
    # back up over at most 3 continuation bytes (0b10xxxxxx)
    while cut > limit - 3 and cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut if cut > limit - 3 else limit


class LineFramer:
    """Turns a byte stream into prefixed console text (``prefix + line + "\\n"``).

    A convenience over ``LineSplitter`` for readers that only need text,
    such as ``TailLog``; progress updates are reduced to their final state.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._splitter = LineSplitter()

    def feed(self, data: bytes) -> str:
        lines, _ = self._splitter.feed(data)
        return self._render(lines)

    def flush(self) -> str:
        return self._render(self._splitter.flush())

    def _render(self, lines: list[str]) -> str:
        p = self._prefix
        return "".join(f"{p}{line}\n" for line in lines)


class TeeProtocol(asyncio.Protocol):
    """Reads one worker stream from a pipe into its log file and the sinks."""

    def __init__(
        self,
        log_file: BinaryIO | None,
        rank: int,
        stream: str,
        prefix: str,
        sinks: list[Sink],
    ) -> None:
        self.log_file = log_file
        self._rank = rank
        self._stream = stream
        self._prefix = prefix
        self._sinks = sinks
        self._splitter = LineSplitter() if sinks else None
        self.progress = ReadProgress()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fd = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pipe = transport.get_extra_info("pipe")
        self._fd = pipe.fileno() if pipe is not None else -1

    def settled(self) -> asyncio.Future[None]:
        """Resolves once the bytes waiting in the pipe now have been consumed."""
        if self.progress.at_eof:
            return self.closed
        return self.progress.reached(self._fd)

    def data_received(self, data: bytes) -> None:
        if self.log_file is not None:
            self.log_file.write(data)
        if self._splitter is not None:
            lines, status = self._splitter.feed(data)
            self._emit(lines)
            if status is not None:
                for sink in self._sinks:
                    sink.status(self._rank, self._stream, self._prefix, status)
        self.progress.advance(len(data))

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        for sink in self._sinks:
            sink.lines(self._rank, self._stream, self._prefix, lines)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._splitter is not None:
            self._emit(self._splitter.flush())
            for sink in self._sinks:
                sink.status(self._rank, self._stream, self._prefix, None)
        if self.log_file is not None:
            self.log_file.close()
        self.progress.finish()
        if not self.closed.done():
            self.closed.set_result(None)
