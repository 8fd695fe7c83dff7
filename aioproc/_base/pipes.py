"""Reading a pipe through the loop, with its file descriptor closed exactly once.

asyncio's pipe transport closes the file object it is given.  uvloop's
closes the descriptor itself (libuv does) and then calls the file object's
``close()`` as well, expecting it to fail.  Between those two closes another
thread may be given the same number for a new file (the helper thread opens
a pipe for every worker it starts), and the second close then shuts that
file instead: a worker started on a dead pipe, or another part of the
process losing a file it holds.  On uvloop the transport therefore reads a
duplicate descriptor of its own, behind an object whose ``close()`` does
nothing, and the caller's file object is closed at once.

The same care goes for the fds handed to a child at its start: the
supervisor's copies are closed right after, and one found closed already
(by another part of the process) must not lose the running child
(``close_given_ends``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from typing import IO, Any

logger = logging.getLogger("aioproc")


def _closes_fd_itself(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop``'s pipe transports close the descriptor themselves (uvloop's)."""
    return any(c.__module__.partition(".")[0] == "uvloop" for c in type(loop).__mro__)


class _TransportOwned:
    """A descriptor its transport closes: ``close()`` leaves it to the transport."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<pipe fd={self._fd}>"


async def connect_read_pipe(
    loop: asyncio.AbstractEventLoop, protocol: asyncio.BaseProtocol, pipe: IO[Any]
) -> asyncio.BaseTransport:
    """Read ``pipe`` into ``protocol``; the transport closes it when it closes.

    If this raises, ``pipe`` is still the caller's to close (closing it
    again is harmless).
    """
    if not _closes_fd_itself(loop):
        transport, _ = await loop.connect_read_pipe(lambda: protocol, pipe)
        return transport
    own = _TransportOwned(os.dup(pipe.fileno()))
    pipe.close()
    transport, _ = await loop.connect_read_pipe(lambda: protocol, own)
    return transport


def close_given_ends(fds: Iterable[int]) -> None:
    """Close this process's copies of the fds (pipe ends) a just-started child took over.

    One found closed already is logged, not raised: another part of the
    process closed a number it did not own, and raising here would lose a
    worker that is already running before anyone could stop it.
    """
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            logger.error(
                "fd %d, handed to a worker at its start, was closed by another part of "
                "this process before aioproc closed it (%s); the worker runs on",
                fd,
                e,
            )
