"""Parent half of a function worker's control channel (see ``_wire``).

The parent's end of the socketpair is driven by a ``BufferedProtocol`` that
reads frame bodies straight into their final buffer, so a 100 MB return value
is received without intermediate copies, and writes are handed to the
transport, which buffers them while the child drains its end: neither side
can deadlock on a full socket.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from . import _wire
from ._drain import ReadProgress

FrameHandler = Callable[[int, bytearray], None]


class _ChannelProtocol(asyncio.BufferedProtocol):
    def __init__(self, on_frame: FrameHandler, progress: ReadProgress) -> None:
        self._on_frame = on_frame
        self._progress = progress
        self._header = bytearray(_wire.HEADER_SIZE)
        self._body: bytearray | None = None
        self._kind = 0
        self._pos = 0
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is None:
            return memoryview(self._header)[self._pos :]
        return memoryview(self._body)[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._body is None:
            if self._pos == len(self._header):
                self._kind, length = _wire.parse_header(self._header)
                self._body = bytearray(length)
                self._pos = 0
                if length == 0:
                    self._complete()
        elif self._pos == len(self._body):
            self._complete()
        # count only after a completed frame was delivered, so a waiter that
        # wakes on the count also sees the frame
        self._progress.advance(nbytes)

    def _complete(self) -> None:
        body, self._body, self._pos = self._body, None, 0
        assert body is not None
        self._on_frame(self._kind, body)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._progress.finish()
        if not self.closed.done():
            self.closed.set_result(None)


class Channel:
    """The supervisor's end of one worker's control channel."""

    def __init__(
        self, transport: asyncio.Transport, protocol: _ChannelProtocol, sock: socket.socket
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._fd = sock.fileno()
        self.progress = protocol._progress

    @classmethod
    async def open(cls, sock: socket.socket, on_frame: FrameHandler) -> Channel:
        """Wrap the parent's end of a connected socketpair."""
        loop = asyncio.get_running_loop()
        progress = ReadProgress()
        sock.setblocking(False)
        transport, protocol = await loop.connect_accepted_socket(
            lambda: _ChannelProtocol(on_frame, progress), sock
        )
        return cls(transport, protocol, sock)

    def send(self, kind: int, *parts: bytes) -> None:
        """Queue one frame whose body is ``parts`` concatenated (not copied).

        The transport writes it as the child reads it.
        """
        if self._transport.is_closing():
            return  # the worker is gone; its exit is reported elsewhere
        self._transport.write(_wire.header(kind, sum(len(p) for p in parts)))
        for part in parts:
            if part:
                self._transport.write(part)

    def send_raw(self, data: bytes) -> None:
        """Queue bytes outside the frame format (the worker's boot code)."""
        if not self._transport.is_closing():
            self._transport.write(data)

    def settled(self) -> asyncio.Future[None]:
        """Resolves once every byte the worker has written so far has been read.

        Called when the worker has exited: after it resolves, a terminal frame
        (RESULT/ERROR) the worker sent has been delivered, or it never sent one.
        """
        if self._transport.is_closing():
            return self._protocol.closed
        return self.progress.reached(self._fd)

    def abort(self) -> None:
        """Close at once, dropping unsent bytes (``aclose`` also waits for it)."""
        self._transport.abort()

    async def aclose(self) -> None:
        self._transport.abort()
        await self._protocol.closed
