"""Console writes that never block the event loop.

Tee'd lines go to the parent's stdout/stderr, which may be a pipe nobody
reads, a terminal scrolled back and frozen, or a slow socket.  A blocking
``write()`` there would freeze the supervisor: no exit detection, timers or
signals.  So writes to consoles that can block go through a ``ConsoleWriter``:

* It writes through a *private* non-blocking file description, never the
  host's: the host's own fd keeps its flags, so its ``print()`` behaves as
  before.  Pipes, FIFOs and terminals are reopened through
  ``/proc/self/fd/N`` with ``O_NONBLOCK`` (a new open file description of
  the same pipe or terminal); sockets (stdout of a systemd service) are sent
  to with ``MSG_DONTWAIT`` on a duplicate, which makes each call
  non-blocking without touching any flag.
* What the console does not accept at once waits in a buffer drained by
  ``loop.add_writer`` (for sockets: retries with a capped backoff, since
  uvloop would make a watched duplicate, hence the host's fd, non-blocking).
  Past ``HIGH_WATER`` bytes its ``Flow`` is held, so the output readers
  pause and workers block on their own pipes; below ``LOW_WATER`` they
  resume.
* The private fd is opened by a write and closed in the first loop
  iteration that neither writes nor has bytes pending, so an idle console
  holds no fd, and a console that keeps up with a stream of writes is not
  reopened for each (an open of ``/proc/self/fd/N`` costs ~17 us).
* Regular files, block devices and ``/dev/null`` never block for long: they
  are written directly, as are streams without an fd (``io.StringIO``,
  pytest's capture) since nothing in the OS can stall them.  Where no private
  description can be had (no ``/proc``, a socket while
  ``socket.setdefaulttimeout`` is set, which would make a duplicate socket
  change the host's flags) the stream is written directly too, as before:
  blocking is then possible, but changing the host's fd never is.

Ordering: before queueing bytes for a stream, the host's text buffer is
flushed (so the host's earlier ``print()`` output comes first), but only
when nothing of ours is pending: then the console had just accepted
everything, and a flush is unlikely to block.  Everything is encoded with
the stream's encoding and ``backslashreplace``, so an unencodable character
never costs a line.

``Screen`` is the status-line area at the bottom of a terminal (progress
bars), shared by every ``ConsoleSink`` drawing on that terminal.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import errno
import functools
import io
import itertools
import os
import shutil
import socket
import stat
from typing import TextIO

from .flow import HARD_LIMIT, HIGH_WATER, LOW_WATER, Flow

STALL_TIMEOUT = 0.5
"""At close: seconds a console may accept nothing before its buffer is given up."""

_IOV_CHUNKS = 64
"""Pending chunks handed to one ``writev`` (a pipe takes 64 KiB at a time)."""

_RETRY_MIN = 0.001
_RETRY_MAX = 0.05
"""Backoff bounds (seconds) for retrying a stuck socket console (see ``_start_watching``)."""

_DEVNULL_RDEV: int | None
try:
    _DEVNULL_RDEV = os.stat(os.devnull).st_rdev
except OSError:  # pragma: no cover - no /dev/null
    _DEVNULL_RDEV = None


class _Backend:
    """A private non-blocking way to write to one console."""

    def __init__(self, fd: int, sock: socket.socket | None) -> None:
        self.fd = fd
        self._sock = sock
        # a description of our own (reopened): safe to hand to the loop's poller
        self.private = sock is None

    def send(self, data: bytes | bytearray) -> int:
        """Write what the console takes now; BlockingIOError if nothing."""
        if self._sock is not None:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        return os.write(self.fd, data)

    def send_chunks(self, chunks: list[bytes]) -> int:
        """``send`` of the chunks one after the other, in one system call."""
        if self._sock is not None:
            return self._sock.sendmsg(chunks, (), socket.MSG_DONTWAIT)
        return os.writev(self.fd, chunks)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        else:
            os.close(self.fd)


class _Gone(Exception):
    """The console has no reader any more (closed pipe): drop what is written."""


def _open_backend(fd: int, st: os.stat_result) -> _Backend | None:
    """A private description of ``fd``'s console; None if none can be had."""
    if stat.S_ISSOCK(st.st_mode):
        if socket.getdefaulttimeout() is not None:
            return None  # a new socket object would set O_NONBLOCK on the shared description
        dup = os.dup(fd)
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return None
        return _Backend(sock.fileno(), sock)
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        private = os.open(f"/proc/self/fd/{fd}", flags)
    except OSError as e:
        if e.errno == errno.ENXIO and stat.S_ISFIFO(st.st_mode):
            raise _Gone from e  # a pipe without a reader: a write would fail with EPIPE
        return None
    return _Backend(private, None)


_writers: dict[tuple[int, ...], ConsoleWriter] = {}
"""The writer of each console (st_dev, st_ino, st_rdev), on the loop that last used it."""


class ConsoleWriter:
    """The bounded, non-blocking write buffer of one console (shared per console).

    Not built directly: ``console_write`` finds or creates the writer of a
    stream's console on the running loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, st: os.stat_result) -> None:
        self.loop = loop
        self._src_fd = fd
        self._st = st
        self._backend: _Backend | None = None
        # what the console has not taken yet: the chunks as queued, never
        # joined (appending to one growing buffer copied up to HIGH_WATER
        # bytes at a time when it was reallocated: ms on the loop)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._pending = 0
        self._watching = False
        self._retry: asyncio.TimerHandle | None = None  # sockets: the next try
        self._backoff = _RETRY_MIN
        # the private fd is kept while writes come (see _keep_open)
        self._idle_check: asyncio.Handle | None = None
        self._written_since_check = False
        self._waiters: list[asyncio.Future[None]] = []
        self.flow = Flow()
        self.dropped_lines = 0

    def __repr__(self) -> str:
        return f"<ConsoleWriter fd={self._src_fd} pending={self._pending}>"

    @property
    def pending(self) -> int:
        """Bytes accepted but not yet written."""
        return self._pending

    def write(self, data: bytes) -> bool:
        """Queue ``data``; False if this console cannot be written without blocking.

        Never blocks.  Past ``HARD_LIMIT`` pending bytes the data is dropped
        and its lines counted in ``dropped_lines``.
        """
        if self._pending:
            self._enqueue(data)
            return True
        if self._backend is None:
            try:
                self._backend = _open_backend(self._src_fd, self._st)
            except _Gone:
                return True  # nobody reads this console: the log file has it
            if self._backend is None:
                return False
        try:
            n = self._backend.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            self._close_backend()
            return True  # console gone (EPIPE, EIO): the log file still has it
        if n < len(data):
            self._enqueue(data[n:])
            self._start_watching()
        else:
            self._keep_open()
        return True

    def _keep_open(self) -> None:
        """Keep the private fd for the writes to come; closed once an iteration brings none."""
        self._written_since_check = True
        if self._idle_check is None:
            self._idle_check = self.loop.call_soon(self._check_idle)

    def release(self) -> None:
        """Close the private fd now if nothing is pending (the next write reopens it).

        For a sink that closes: the console's reader may be waiting for EOF
        once the host closes its own end.
        """
        if not self._pending:
            self._close_backend()

    def _check_idle(self) -> None:
        self._idle_check = None
        if self._backend is None or self._pending:
            return  # closed already, or _on_writable owns the fd until drained
        if self._written_since_check:
            self._written_since_check = False
            self._idle_check = self.loop.call_soon(self._check_idle)
        else:
            self._close_backend()

    def _enqueue(self, data: bytes) -> None:
        if self._pending + len(data) > HARD_LIMIT:
            self.dropped_lines += data.count(b"\n")
            return
        self._chunks.append(data)
        self._pending += len(data)
        if self._pending >= HIGH_WATER:
            self.flow.hold(self)

    def _start_watching(self) -> None:
        be = self._backend
        if self._watching or be is None:
            return
        self._watching = True
        if be.private:
            self.loop.add_writer(be.fd, self._on_writable)
        else:
            # A socket's duplicate shares the host's open file description, and
            # uvloop (libuv's uv_poll_init) makes every fd it watches
            # non-blocking, which would reach the host's own stdout.  So a
            # socket console is retried with a capped backoff instead.
            self._retry = self.loop.call_later(_RETRY_MIN, self._on_writable)

    def _on_writable(self) -> None:
        assert self._backend is not None
        self._retry = None
        try:
            n = self._backend.send_chunks(list(itertools.islice(self._chunks, _IOV_CHUNKS)))
        except BlockingIOError:
            n = 0
        except OSError:
            n = self._pending  # console gone: nothing can be delivered any more
        if n:
            self._written(n)
            self._backoff = _RETRY_MIN
            self._wake()
            if self._pending < LOW_WATER:
                self.flow.release(self)
        if not self._pending:
            self._stop_watching()
            self._keep_open()
        elif not self._backend.private:
            if not n:
                self._backoff = min(self._backoff * 2, _RETRY_MAX)
            self._retry = self.loop.call_later(self._backoff, self._on_writable)

    def _written(self, n: int) -> None:
        """Forget the first ``n`` pending bytes: the console took them."""
        self._pending -= n
        chunks = self._chunks
        while n:
            head = chunks[0]
            if n < len(head):
                chunks[0] = head[n:]  # a chunk is a slice of lines: a small copy
                return
            n -= len(head)
            chunks.popleft()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _stop_watching(self) -> None:
        be = self._backend
        if self._watching and be is not None and be.private and not self.loop.is_closed():
            self.loop.remove_writer(be.fd)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._watching = False

    def _close_backend(self) -> None:
        """Release the private fd (idle, gone or abandoned)."""
        self._stop_watching()
        if self._idle_check is not None:
            self._idle_check.cancel()
            self._idle_check = None
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    async def drain(self, stall: float = STALL_TIMEOUT) -> bool:
        """Wait until everything is written; False once the console accepted
        nothing for ``stall`` seconds (it is stuck: see ``abandon``)."""
        while self._pending:
            fut = self.loop.create_future()
            self._waiters.append(fut)
            # each wake-up is progress; a timeout means the console is stuck
            done, _ = await asyncio.wait({fut}, timeout=stall)
            if not done:
                fut.cancel()
                return False
        return True

    def abandon(self) -> int:
        """Drop everything pending and release the fd; the number of lines dropped."""
        dropped = self.dropped_lines + sum(chunk.count(b"\n") for chunk in self._chunks)
        self.dropped_lines = 0
        self._chunks.clear()
        self._pending = 0
        self._close_backend()
        self._wake()
        self.flow.release(self)
        return dropped


def _writer_for(fd: int, st: os.stat_result) -> ConsoleWriter:
    """The writer of this console on the running loop (one per console, so
    two groups or stdout and stderr on one terminal never cut each other's lines)."""
    key = (st.st_dev, st.st_ino, st.st_rdev)
    loop = asyncio.get_running_loop()
    writer = _writers.get(key)
    if writer is not None and writer.loop is not loop:
        writer.abandon()  # left with pending bytes by a loop that is gone
        writer = None
    if writer is None:
        writer = _writers[key] = ConsoleWriter(loop, fd, st)
    return writer


def release_consoles() -> None:
    """Close the private fds that idle consoles keep for the next writes (this loop's).

    Called when sinks close and when a group's close is done: a host that
    then closes its own end of a pipe and waits for the reader's EOF
    without running the loop again must not find a descriptor of ours
    still open.  A later write reopens one.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for writer in list(_writers.values()):
        if writer.loop is loop:
            writer.release()


def _may_block(st: os.stat_result) -> bool:
    mode = st.st_mode
    if stat.S_ISCHR(mode):
        return st.st_rdev != _DEVNULL_RDEV
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def console_write(stream: TextIO, text: str) -> ConsoleWriter | None:
    """Write ``text`` to ``stream`` without blocking the loop (see the module doc).

    Returns the writer holding what the console did not take at once, or
    None when ``stream`` was written directly.
    """
    return _write(stream, text, None)


def console_write_ascii(stream: TextIO, data: bytes) -> ConsoleWriter | None:
    """``console_write`` of ASCII text given as its bytes.

    The bytes go out as they are wherever the stream's encoding is
    ASCII-compatible (UTF-8, Latin-1, ...), so text a tee got as bytes is
    not decoded and encoded again on its way out.
    """
    return _write(stream, None, data)


def _write(stream: TextIO, text: str | None, data: bytes | None) -> ConsoleWriter | None:
    """``text``, or the ASCII ``data``, to ``stream`` (see ``console_write``)."""
    try:
        fd = stream.fileno()
        st = os.fstat(fd)
    except (AttributeError, OSError, ValueError):
        _direct(stream, text, data)
        return None
    if not _may_block(st):
        _direct(stream, text, data)
        return None
    try:
        writer = _writer_for(fd, st)
    except RuntimeError:  # no running loop: nothing to keep responsive
        _direct(stream, text, data)
        return None
    if not writer.pending:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()  # the host's earlier writes come first
    enc = getattr(stream, "encoding", None) or "utf-8"
    if data is None or not _ascii_compatible(enc):
        if text is None:
            assert data is not None
            text = data.decode("ascii")
        try:
            data = text.encode(enc, "backslashreplace")
        except LookupError:
            data = text.encode("utf-8", "backslashreplace")
    if not writer.write(data):
        _direct(stream, text, data)
        return None
    return writer


def _direct(stream: TextIO, text: str | None, data: bytes | None) -> None:
    """Write straight to ``stream``: ``text`` (``safe_write``), or ``data`` (``write_ascii``)."""
    if text is not None:
        safe_write(stream, text)
    else:
        assert data is not None
        write_ascii(stream, data)


def write_ascii(stream: TextIO, data: bytes) -> None:
    """``safe_write`` of ASCII text given as its bytes: through the stream's
    binary buffer where its encoding writes ASCII unchanged."""
    # only a plain text wrapper: whatever another stream's write() does (a
    # wrapper that colours or stamps lines) is not skipped
    plain = isinstance(stream, io.TextIOWrapper) and type(stream).write is io.TextIOWrapper.write
    if not plain or not _ascii_compatible(stream.encoding):
        safe_write(stream, data.decode("ascii"))
        return
    try:
        stream.flush()  # the host's earlier writes come first
        stream.buffer.write(data)
        stream.buffer.flush()
    except (OSError, ValueError):
        pass  # console gone (closed pipe or file): the log file still has it


@functools.lru_cache(maxsize=32)
def _ascii_compatible(encoding: str) -> bool:
    """Whether ``encoding`` writes every ASCII character as its own byte."""
    try:
        return _ASCII.decode("ascii").encode(encoding) == _ASCII
    except (LookupError, UnicodeError):
        return False


_ASCII = bytes(range(128))


def safe_write(stream: TextIO, text: str) -> None:
    """Write and flush ``text``; characters the stream cannot encode are
    escaped, and a closed stream is ignored (the log file has the output)."""
    text = _encodable(stream, text)
    try:
        stream.write(text)
        stream.flush()
    except UnicodeError:
        with contextlib.suppress(OSError, ValueError):
            stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))
            stream.flush()
    except (OSError, ValueError):
        pass  # console gone (closed pipe or file): the log file still has it


def _encodable(stream: TextIO, text: str) -> str:
    """``text`` with what ``stream``'s encoding cannot represent escaped."""
    enc = getattr(stream, "encoding", None)
    if not isinstance(enc, str) or getattr(stream, "errors", "strict") != "strict":
        return text
    try:
        if codecs.lookup(enc).name == "utf-8":
            return text  # decoded with replacement: always encodable
        return text.encode(enc, "backslashreplace").decode(enc, "replace")
    except (LookupError, UnicodeError):
        return text


class Screen:
    """The bottom-of-terminal status area of one text stream (shared)."""

    # keyed by the terminal itself: stdout and stderr on one tty share a screen
    _screens: dict[tuple[int, ...], Screen] = {}  # noqa: RUF012

    @classmethod
    def of(cls, stream: TextIO) -> Screen:
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
