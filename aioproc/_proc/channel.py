"""Parent half of a function worker's control channel (see ``_child.channel``).

The parent's end of the socketpair is driven by a ``BufferedProtocol``.  It
reads into a 64 KiB buffer and delivers every whole frame found there, so a
small reply costs one read and one wakeup; the rest of a body that does not
fit there is read straight into its final buffer, so a 100 MB return value
is received without intermediate copies.  Writes are handed to the
transport (a small frame as one joined write), which buffers them while the
child drains its end: neither side can deadlock on a full socket.

Frame headers are not trusted: a header is checked (known kind, length at
most ``max_frame_size``) before its body's buffer is allocated.  A bad one
fails the channel: ``Channel.failed`` resolves with a ``BrokenWorkerError``
saying what was wrong, ``on_error`` (if given) is called with it, and the
connection is aborted, so nothing more is read from a worker that broke the
protocol.  A one-shot function worker may not be reading its channel
either, so its launcher's ``on_error`` SIGKILLs its group (see ``_func.launch``);
a persistent worker busy in a call does not read the channel, so its owner
must stop waiting and kill it (see ``worker``).

Large values travel in shared memory (see ``_child.shm``): their memfds come on a
second socket, the fd socket, which the channel owns and closes with the
connection (the kernel then drops any fd still queued on it).  When a RESULT
frame whose body is SHM completes, its memfd is mapped before the frame is
delivered; a missing or unusable memfd fails the channel like a bad header.
The fast path (every other frame) is unchanged.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from collections.abc import Callable, Sequence
from typing import cast

from .._child import channel
from .._child import shm as _shm
from .._errors.failure import BrokenWorkerError
from .._output.drain import ReadProgress

FrameHandler = Callable[[int, bytearray], None]
ErrorHandler = Callable[[BrokenWorkerError], None]

_HEADER = struct.Struct(">BQ")
"""``_child.channel``'s frame header (kind, body length): one C call to parse or build
it, where the child, which imports no ``struct``, slices and converts."""
assert _HEADER.size == channel.HEADER_SIZE
_SHM_BYTE = channel.SHM[0]


class _ChannelProtocol(asyncio.BufferedProtocol):
    def __init__(
        self,
        on_frame: FrameHandler,
        progress: ReadProgress,
        *,
        max_frame_size: int = channel.MAX_FRAME_SIZE,
        kinds: frozenset[int] = channel.CHILD_KINDS,
        on_error: ErrorHandler | None = None,
        fd_socket: socket.socket | None = None,
    ) -> None:
        self._on_frame = on_frame
        self._fd_socket = fd_socket
        self._on_error = on_error
        self._progress = progress
        self._max = max_frame_size
        self._kinds = kinds
        # Small frames are parsed out of one scratch buffer, as many as one
        # read brings; a body that does not fit gets its own buffer, allocated
        # once its header passed the checks, and the rest of it is read
        # straight into it.
        self._scratch = bytearray(channel.READ_SIZE)
        self._have = 0  # bytes in _scratch not parsed yet (a partial header)
        self._body: bytearray | None = None
        self._kind = 0
        self._pos = 0  # bytes of _body filled
        self._transport: asyncio.Transport | None = None
        self.lost_error: Exception | None = None  # what ended the connection (None: EOF)
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        # resolved with (not raised as) the error: nobody has to retrieve it
        self.failed: asyncio.Future[BrokenWorkerError] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its API
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> bytearray | memoryview:
        if self._body is None:
            # the usual case (no partial header held) needs no new view
            return self._scratch if not self._have else memoryview(self._scratch)[self._have :]
        return memoryview(self._body)[self._pos :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.failed.done():
            return  # aborted: bytes read in the same wakeup are ignored
        if self._body is None:
            if not self._have and nbytes >= channel.HEADER_SIZE:
                # The usual reply: exactly one whole small frame, read at once.
                # Delivered here, without the general parser's bookkeeping.
                kind, length = _HEADER.unpack_from(self._scratch)
                if (
                    nbytes - channel.HEADER_SIZE == length
                    and kind in self._kinds
                    and length <= self._max
                ):
                    body = self._scratch[channel.HEADER_SIZE : nbytes]
                    if kind == channel.RESULT and body and body[0] == _SHM_BYTE:
                        self._deliver(kind, body)
                    else:
                        self._on_frame(kind, body)
                    self._progress.advance(nbytes)
                    return
            self._have += nbytes
            self._parse()
        else:
            self._pos += nbytes
            if self._pos == len(self._body):
                body, self._body, self._pos = self._body, None, 0
                self._deliver(self._kind, body)
        # count only after a completed frame was delivered, so a waiter that
        # wakes on the count also sees the frame
        self._progress.advance(nbytes)

    def _parse(self) -> None:
        """Deliver every whole frame in the scratch buffer; keep what is left."""
        scratch, have, start = self._scratch, self._have, 0
        while have - start >= channel.HEADER_SIZE and not self.failed.done():
            kind, length = _HEADER.unpack_from(scratch, start)
            problem = self._check(kind, length)
            if problem:
                self._fail(problem)
                return
            begin = start + channel.HEADER_SIZE
            if have - begin >= length:
                start = begin + length
                self._deliver(kind, scratch[begin:start])
                continue
            body = bytearray(length)
            body[: have - begin] = memoryview(scratch)[begin:have]
            self._kind, self._body, self._pos = kind, body, have - begin
            start = have
        if start and start < have:
            scratch[: have - start] = scratch[start:have]
        self._have = have - start

    def _check(self, kind: int, length: int) -> str:
        """What is wrong with a frame header, before its body is allocated."""
        if kind not in self._kinds:
            if kind in channel.KIND_NAMES:
                return (
                    f"worker sent a {channel.kind_name(kind)} frame, "
                    "a kind only the supervisor sends"
                )
            return f"worker sent a frame of unknown kind {kind}"
        if length > self._max:
            return (
                f"worker sent a {channel.kind_name(kind)} frame of {length} bytes "
                f"({channel.format_size(length)}), over the {channel.format_size(self._max)} limit "
                "of the control channel"
            )
        return ""

    def _fail(self, problem: str) -> None:
        error = BrokenWorkerError(f"{problem}; the supervisor closed the channel")
        self.failed.set_result(error)
        self._body = None
        if self._transport is not None:
            self._transport.abort()
        if self._on_error is not None:
            self._on_error(error)

    def _deliver(self, kind: int, body: bytearray) -> None:
        if kind == channel.RESULT and body and body[0] == _SHM_BYTE:
            try:
                if self._fd_socket is None:
                    raise ValueError("this channel passes no file descriptors")
                body = _shm.attach(body, self._fd_socket)
            except (OSError, ValueError) as e:
                self._fail(f"worker sent a shared-memory RESULT frame, but {e}")
                return
        self._on_frame(kind, body)

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._fd_socket is not None:
            self._fd_socket.close()  # queued fds (and their memory) go with it
        self.lost_error = exc
        self._progress.finish()
        if not self.closed.done():
            self.closed.set_result(None)


def frame(kind: int, body: bytes) -> bytes:
    """A whole frame, for ``Channel.send(before=...)``."""
    return _HEADER.pack(kind, len(body)) + body


class Channel:
    """The supervisor's end of one worker's control channel.

    Attributes:
        failed: resolves with a ``BrokenWorkerError`` when the worker broke
            the frame protocol (unknown kind, frame over the size cap); stays
            pending on a clean EOF.  Wait on it beside a reply so a broken
            worker cannot make a call hang.
        progress: bytes read so far (see ``settled``).
    """

    def __init__(
        self, transport: asyncio.Transport, protocol: _ChannelProtocol, sock: socket.socket
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._sock = sock
        self._fd = sock.fileno()
        self.fd_socket = protocol._fd_socket
        self._dropped = False  # the worker's end closed with bytes of ours unread or unsent
        self.progress = protocol._progress
        self.failed = protocol.failed

    @property
    def error(self) -> BrokenWorkerError | None:
        """The protocol violation that failed the channel, or None."""
        return self.failed.result() if self.failed.done() else None

    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        on_frame: FrameHandler,
        *,
        on_error: ErrorHandler | None = None,
        max_frame_size: int | None = None,
        fd_socket: socket.socket | None = None,
    ) -> Channel:
        """Wrap the parent's end of a connected socketpair.

        Args:
            sock: the parent's end; the channel owns it from now on.
            on_frame: called with ``(kind, body)`` for every whole frame.
            on_error: called once with the ``BrokenWorkerError`` if the worker
                breaks the protocol (also available as ``failed``).
            max_frame_size: largest body accepted, in bytes; checked before
                allocating.  Default: ``_child.channel.MAX_FRAME_SIZE`` (1 GiB), read
                at each call, as ``_boot.init_frame`` does for the worker.
            fd_socket: the parent's end of the worker's fd socket (see
                ``_child.shm``); the channel owns it from now on.  None: large
                values travel in the frames.

        Raises:
            ValueError: ``max_frame_size`` is not a positive int.
        """
        if max_frame_size is None:
            max_frame_size = channel.MAX_FRAME_SIZE
        if (
            isinstance(max_frame_size, bool)
            or not isinstance(max_frame_size, int)
            or max_frame_size <= 0
        ):
            if fd_socket is not None:
                fd_socket.close()
            raise ValueError(
                f"max_frame_size must be a positive number of bytes, got {max_frame_size!r}"
            )
        if fd_socket is not None:
            fd_socket.setblocking(False)
        loop = asyncio.get_running_loop()
        progress = ReadProgress()
        sock.setblocking(False)
        transport, protocol = await loop.connect_accepted_socket(
            lambda: _ChannelProtocol(
                on_frame,
                progress,
                max_frame_size=max_frame_size,
                on_error=on_error,
                fd_socket=fd_socket,
            ),
            sock,
        )
        return cls(transport, protocol, sock)

    def deliver_to(self, on_frame: FrameHandler) -> None:
        """From now on, hand every whole frame to ``on_frame`` instead.

        For an owner that exists only once the channel is open (a persistent
        worker's handle, after its start): a direct call per frame rather
        than one through a forwarding function.
        """
        self._protocol._on_frame = on_frame

    def send(
        self,
        kind: int,
        *parts: bytes,
        segments: Sequence[_shm.Segment] = (),
        before: bytes = b"",
    ) -> None:
        """Queue one frame whose body is ``parts`` concatenated.

        The transport writes it as the child reads it.  Parts of a big frame
        are not copied; a small one is joined into a single write, with
        ``before`` (whole frames made by ``frame``: a DEFINE for this CALL),
        so the worker wakes once for both.
        ``segments`` (the memfds of a SHM body) go first, on the fd socket,
        and are closed here whatever happens; if they cannot be passed, the
        channel is aborted, so the worker sees EOF instead of waiting for
        them.  On a channel already closing nothing is written (see
        ``dropped_by_peer``).
        """
        if self._transport.is_closing():
            for segment in segments:
                segment.close()
            self._dropped = True  # the worker is gone; its exit is reported elsewhere
            return
        if segments:
            try:
                if self.fd_socket is None:
                    raise OSError("this channel passes no file descriptors")
                _shm.send(self.fd_socket, segments)
            except OSError:
                self._transport.abort()
                return
        size = sum(map(len, parts))
        if size <= channel.JOIN_LIMIT:
            # one write, so one send(): the worker wakes once per small frame
            self._transport.write(b"".join((before, _HEADER.pack(kind, size), *parts)))
            return
        if before:
            self._transport.write(before)
        self._transport.write(_HEADER.pack(kind, size))
        for part in parts:
            if part:
                self._transport.write(part)

    async def dropped_by_peer(self) -> bool:
        """Whether the worker's end closed before it read everything sent to it.

        Asked once the worker has exited, to tell a request the worker never
        read (it died idle, or dying) from one it read and then died in.  The
        kernel says so: a Unix stream socket released with unread bytes in
        its queue gives its peer ``ECONNRESET`` instead of EOF, and a write
        after the release fails with ``EPIPE`` (or, once the EOF was read,
        ``send`` wrote nothing).  A worker reads a frame whole before acting
        on it, so a frame still (partly) unread never ran.  False when in
        doubt, e.g. a descendant inherited the socket and keeps it open.
        """
        if self._dropped:
            return True
        if self._transport.is_closing():
            # the error (if any) reaches connection_lost in a moment
            await asyncio.wait({self._protocol.closed}, timeout=1.0)
            error = self._protocol.lost_error
            self._dropped = isinstance(error, (ConnectionResetError, BrokenPipeError))
            return self._dropped
        try:  # not read yet: the pending socket error says it (and is consumed)
            code = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            return False
        self._dropped = code in (errno.ECONNRESET, errno.EPIPE)
        return self._dropped

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

    def close_when_settled(self) -> None:
        """Close once what the worker wrote before exiting has been read (see ``settled``)."""
        settled = self.settled()
        if settled.done():
            self.abort()
        else:
            settled.add_done_callback(lambda _: self.abort())

    def abort(self) -> asyncio.Future[None]:
        """Close at once, dropping unsent bytes; ``aclose`` also waits for it.

        Returns the future that resolves once the transport has let go of
        the socket (a later loop iteration).
        """
        self._transport.abort()
        return self._protocol.closed

    async def aclose(self) -> None:
        await self.abort()
