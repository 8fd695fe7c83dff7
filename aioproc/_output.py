"""Worker output: pipe -> raw bytes to the log file, whole prefixed lines to the console.

One ``TeeProtocol`` reads one tee'd stream of one worker.  Every chunk goes to
the log file unchanged; the console gets only complete lines, each with the
rank's prefix, written in one call to a ``ConsoleSink`` shared by all ranks.
Since everything runs on the loop thread, a line from one rank can never be
cut by a line from another.  A partial line is held until its newline or
EOF; a line longer than ``MAX_LINE`` is emitted in prefixed pieces so memory
stays bounded.
"""

from __future__ import annotations

import asyncio
from typing import BinaryIO, TextIO

from ._drain import ReadProgress

MAX_LINE = 64 * 1024
"""Longest partial line held back; longer lines reach the console in pieces."""


class ConsoleSink:
    """Writes whole lines to one text stream (the parent's stdout or stderr)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write_lines(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass  # console gone (closed pipe, closed file): the log file still has it


class LineFramer:
    """Splits a byte stream into prefixed lines, whatever the chunk boundaries."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._held = bytearray()

    def feed(self, data: bytes) -> str:
        """Return the complete prefixed lines ``data`` finishes ("" if none)."""
        held = self._held
        cut = data.rfind(b"\n")
        if cut < 0:
            held += data
            if len(held) <= MAX_LINE:
                return ""
            piece, self._held = bytes(held), bytearray()
            return self._render([piece])
        head = bytes(held) + data[: cut + 1] if held else data[: cut + 1]
        self._held = bytearray(data[cut + 1 :])
        return self._render(head.split(b"\n")[:-1])

    def flush(self) -> str:
        """Return the held partial line, if any (at EOF)."""
        if not self._held:
            return ""
        piece, self._held = bytes(self._held), bytearray()
        return self._render([piece])

    def _render(self, lines: list[bytes]) -> str:
        p = self._prefix
        out: list[str] = []
        for line in lines:
            while len(line) > MAX_LINE:
                out.append(f"{p}{line[:MAX_LINE].decode('utf-8', 'replace')}\n")
                line = line[MAX_LINE:]
            out.append(f"{p}{line.decode('utf-8', 'replace')}\n")
        return "".join(out)


class TeeProtocol(asyncio.Protocol):
    """Reads one worker stream from a pipe into a log file and the console."""

    def __init__(
        self,
        log_file: BinaryIO | None,
        console: ConsoleSink | None,
        prefix: str,
    ) -> None:
        self._file = log_file
        self._console = console
        self._framer = LineFramer(prefix) if console is not None else None
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
        if self._file is not None:
            self._file.write(data)
        if self._framer is not None and self._console is not None:
            text = self._framer.feed(data)
            if text:
                self._console.write_lines(text)
        self.progress.advance(len(data))

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._framer is not None and self._console is not None:
            text = self._framer.flush()
            if text:
                self._console.write_lines(text)
        if self._file is not None:
            self._file.close()
        self.progress.finish()
        if not self.closed.done():
            self.closed.set_result(None)
