"""Know when everything a process wrote before exiting has been read.

A worker's exit and the bytes it wrote reach the event loop as separate
readiness events, in no guaranteed order, and a descendant may keep a pipe
open long after the worker is gone.  So instead of waiting for EOF, the
supervisor asks, at the moment it notices the exit, how many bytes are
already waiting in the kernel (``FIONREAD``): once the reader has consumed
that many more, every byte the worker wrote has been seen.  Nothing is polled
and a lingering descendant cannot delay the verdict.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios
from collections.abc import Callable


def bytes_waiting(fd: int) -> int:
    """Bytes readable from ``fd`` right now without blocking (pipes, sockets); 0 for -1."""
    if fd < 0:
        return 0  # no fd (never connected, or its transport is closing)
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0  # already closed: nothing more can arrive
    return buf[0]


class ReadProgress:
    """Counts bytes consumed from one fd and wakes waiters at a target count."""

    __slots__ = ("_eof", "_received", "_waiters")

    def __init__(self) -> None:
        self._received = 0
        self._eof = False
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    @property
    def received(self) -> int:
        return self._received

    @property
    def at_eof(self) -> bool:
        return self._eof

    def advance(self, n: int) -> None:
        self._received += n
        if self._waiters:
            self._wake(lambda target: self._received >= target)

    def finish(self) -> None:
        """The fd reached EOF or was closed: no waiter can be satisfied later."""
        self._eof = True
        self._wake(lambda target: True)

    def reached(self, fd: int, held: int = 0) -> asyncio.Future[None]:
        """A future resolved once what is waiting on ``fd`` now has been consumed.

        ``held``: bytes read from ``fd`` already but not consumed (counted) yet.
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        target = self._received + held + (bytes_waiting(fd) if not self._eof else 0)
        if self._eof or self._received >= target:
            fut.set_result(None)
        else:
            self._waiters.append((target, fut))
        return fut

    def _wake(self, done: Callable[[int], bool]) -> None:
        keep = []
        for target, fut in self._waiters:
            if done(target):
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep
