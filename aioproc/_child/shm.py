"""Large values in shared memory: sealed memfds passed beside the control channel.

A value of ``channel.SHM_MIN`` bytes or more is written once into a memfd
(``Segment.create``): the pickle stream, then each out-of-band buffer.  The
memfd is sealed (no write, shrink or grow) so the receiver's views can
neither change under it nor fault with SIGBUS, and passed with SCM_RIGHTS on
a second socketpair, the *fd socket*, just before its frame is written on
the channel.  Fds travel in frame order, so the receiver takes the next one
when a SHM frame completes: it is there already, nothing waits or polls.
The receiver maps the memfd and closes the fd at once (``map_next``); the
unpickled arrays view the mapping, which lives as long as they do.

Nothing has a name (no ``/dev/shm`` entry): the kernel frees the memory when
the last fd and mapping are gone, so a crash on either side, a cancelled
call or a rejected frame cannot leak it.  An fd sent but never received is
dropped by the kernel with the socket that queued it.

Why a second socket: the supervisor reads the channel through an asyncio
transport, which reads with ``recv`` and so drops ancillary data; the fd
socket is read with ``recvmsg``, and only when a SHM frame has arrived.

Imported by workers only when a large value is sent or received: standard
library only, no asyncio.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import sys
from collections.abc import Iterable
from typing import Any

AVAILABLE = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
"""memfds with seals (Linux); elsewhere large values travel in the frame."""

_SEALS = (
    (fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    if AVAILABLE
    else 0
)
_REQUIRED = _SEALS & ~(fcntl.F_SEAL_SEAL if AVAILABLE else 0)
_FD_SIZE = 4  # SCM_RIGHTS carries C ints
_MAP_PRIVATE = mmap.MAP_PRIVATE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
# Before Python 3.13 an mmap object keeps a dup of its fd open while it
# lives, so each received large value still alive holds one fd; 3.13 can drop it.
_NO_TRACKFD: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
_WRITE_CHUNK = 1 << 30


class Segment:
    """One memfd holding a value, owned by its sender until sent (then closed).

    ``close`` is idempotent, and a segment dropped unclosed closes its fd
    when collected, so no path can keep the memory alive.
    """

    __slots__ = ("_pending", "fd", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self._pending: tuple[list[Any], list[tuple[int, Any]]] | None = None

    @classmethod
    def create(cls, size: int, stream: list[Any], buffers: Iterable[tuple[int, Any]]) -> Segment:
        """A sealed memfd of ``size`` bytes: ``stream`` at 0, each buffer at its offset."""
        segment = cls.reserve(size, stream, buffers)
        segment.fill()
        return segment

    @classmethod
    def reserve(cls, size: int, stream: list[Any], buffers: Iterable[tuple[int, Any]]) -> Segment:
        """A memfd of ``size`` bytes that ``fill`` writes ``stream`` and ``buffers`` into later.

        The copy is what takes time (a fraction of a second per GiB), so a
        sender on an event loop reserves on the loop and fills on a thread;
        until then the segment keeps the value's parts alive.
        """
        fd = os.memfd_create("aioproc-value", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        segment = cls(fd, size)
        segment._pending = (stream, list(buffers))
        return segment

    @property
    def filled(self) -> bool:
        """Whether the value is in the memfd (and sealed)."""
        return self._pending is None

    def fill(self) -> None:
        """Copy the value in and seal the memfd; nothing to do once filled.

        Thread-safe against nothing: one thread fills, and the segment is
        neither sent nor closed until it has returned.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        stream, buffers = pending
        pos = 0
        for part in stream:
            pos = _write_at(self.fd, _flat(part), pos)
        for offset, raw in buffers:
            _write_at(self.fd, raw, offset)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    def close(self) -> None:
        self._pending = None
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class Deferred(list[Segment]):
    """A list of segments whose owner fills them itself (off its event loop).

    ``pickle_parts`` reserves the memfds of a value put in such a list and
    leaves the copy to the owner; in a plain list they come filled.
    """

    __slots__ = ()


def _flat(buf: Any) -> memoryview:
    raw = getattr(buf, "raw", None)
    return raw() if raw is not None else memoryview(buf).cast("B")


def _write_at(fd: int, view: memoryview, pos: int) -> int:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done : done + _WRITE_CHUNK], pos + done)
    return pos + done


def fd_socketpair() -> tuple[socket.socket, socket.socket] | None:
    """(parent end, worker end) of a new fd socket, or None where memfds are missing."""
    if not AVAILABLE:
        return None
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: Any, segments: Iterable[Segment]) -> None:
    """Fill each segment if it is not, pass its fd on ``sock``, in order, then close it.

    Every segment is closed, also when sending fails (the receiver then
    never sees the frame's memory: the caller must end the channel).
    """
    error: OSError | None = None
    for segment in segments:
        try:
            if error is None:
                segment.fill()  # a no-op where the sender filled it already
                fds = segment.fd.to_bytes(_FD_SIZE, sys.byteorder, signed=True)
                sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError as e:
            error = e
        finally:
            segment.close()
    if error is not None:
        raise error


def map_next(sock: Any, size: int) -> mmap.mmap:
    """Take the next fd from ``sock`` and map ``size`` bytes of it; the fd is closed.

    Raises:
        ValueError: no fd was waiting, or the memfd is not sealed or is
            smaller than ``size``.
        OSError: the socket or the mapping failed.
    """
    try:
        _, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(_FD_SIZE))
    except BlockingIOError:
        raise ValueError("its file descriptor did not arrive") from None
    fds = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            fds += [
                int.from_bytes(data[i : i + _FD_SIZE], sys.byteorder, signed=True)
                for i in range(0, usable, _FD_SIZE)
            ]
    if not fds:
        raise ValueError("its file descriptor did not arrive")
    fd, extra = fds[0], fds[1:]
    try:
        for other in extra:
            os.close(other)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _REQUIRED != _REQUIRED:
            raise ValueError(f"its memfd is not sealed against writes (seals {seals:#x})")
        actual = os.fstat(fd).st_size
        if actual < size or size <= 0:
            raise ValueError(f"its memfd holds {actual} bytes, not {size}")
        # private: the receiver may write to its arrays (copy on write, page by
        # page), the sender cannot.  Not MAP_POPULATE: on a writable private
        # mapping it would copy every page up front.
        return mmap.mmap(fd, size, _MAP_PRIVATE, _PROT_RW, **_NO_TRACKFD)
    finally:
        os.close(fd)


class SharedBody(bytearray):
    """A SHM frame's body with the mapping of its memfd (read by ``channel.decode_value``)."""

    mapping: mmap.mmap | None = None


def attach(body: bytearray, sock: socket.socket) -> SharedBody:
    """Map the memfd of a SHM body that just arrived (supervisor side, non-blocking)."""
    size = _declared_size(memoryview(body)[1:])
    shared = SharedBody(body)
    shared.mapping = map_next(sock, size)
    return shared


def _declared_size(view: memoryview) -> int:
    """The memfd size a SHM value's layout (``view``: after the codec byte) declares."""
    import marshal

    n = int.from_bytes(view[:4], "big")
    try:
        size, _, _ = marshal.loads(view[4 : 4 + n])
    except (EOFError, ValueError, TypeError):
        raise ValueError("its layout is unreadable") from None
    if not isinstance(size, int):
        raise ValueError("its layout is unreadable")
    return size


_worker_socket: Any = None


def worker_socket(fd: int) -> Any:
    """The worker's end of its fd socket (blocking), made once from its number."""
    global _worker_socket
    if _worker_socket is None:
        _worker_socket = socket.socket(fileno=fd)
    return _worker_socket


def worker_map(view: memoryview, fd: int) -> mmap.mmap:
    """In a worker: the mapping for a SHM value (``view``: after the codec byte).

    Blocks until its fd is read from the worker's fd socket ``fd`` (sent
    before the frame, so it is there).
    """
    return map_next(worker_socket(fd), _declared_size(view))
