"""Follow log files as they appear and grow; copy their lines, prefixed, to one place.

``TailLog`` is the asyncio counterpart of torchelastic's ``TailLog``: it follows
one file per local rank and writes every line to a destination with the
rank's prefix (``[{name}{rank}]:`` unless ``log_line_prefixes`` says
otherwise).  The destination is a text stream such as ``sys.stdout``, a path
(opened for append), or an async callable ``sink(rank, line)``.

Readiness comes from **inotify** on Linux (through ``ctypes``: libc's
``inotify_init1``/``inotify_add_watch``, one inotify fd per ``TailLog``
registered with ``loop.add_reader``).  A file that does not exist yet is
waited for by watching its nearest existing ancestor directory; an open file
is watched through ``/proc/self/fd/N``, so the watch follows the very inode
being read.  Where inotify is not available (another platform, a loop without
``add_reader``, the per-user inotify limits reached, or a dangling symlink)
the tailer falls back to **a backoff delay**: it re-checks after 1 ms,
doubling up to ``interval_sec`` (100 ms by default) while nothing changes,
and back to 1 ms once data flows.
inotify does not see writes made through ``mmap`` or from another host on a
network file system; ``aclose()`` still drains such files to their end.

Open one with ``open_tail_log(...)``: awaited (``tail = await
open_tail_log(...)``, closed with ``await tail.aclose()``) or with ``async
with``.  torch's face stays: ``TailLog(...)``, ``start()`` and ``stop()``.
"""

# Design notes.
#
# One coroutine per file instead of torch's polling thread per file: it clears
# its wake event, reads to the end of the file, then waits on the event, which
# inotify (or the backoff timer, or aclose()) sets.  Clearing before reading
# means a write that lands after the read is always noticed.
#
# Reads never block the loop: ``os.pread`` at our own offset runs on the
# helper thread (``_base.offloop``, held while a follower runs), which
# finishes a read even when its caller is cancelled, so a cancelled read
# loses nothing and the fd is closed only once the thread is done with it.
# The followers are the children of the tail's ``Owner``.  Framing and prefixing
# are ``_output.LineFramer``'s, so a line is never split under two prefixes
# whatever the read boundaries, and every write to the destination is a batch
# of whole lines made on the loop thread: lines of different ranks never mix.
#
# aclose() flips the state and wakes everyone.  Each coroutine then takes the
# file's size (after aclose() was called, so it covers every write made before),
# reads up to exactly that size, and flushes the held partial line as one
# whole line.  A file that had not appeared gets one last open attempt.

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import math
import os
import stat
import struct
import sys
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TextIO, TypeVar

import anyio.abc

from ._base.offloop import helper, run_blocking
from ._base.owner import Owner
from ._base.resource import OpenResource
from ._output.tee import LineFramer

__all__ = ["LineSink", "TailLog", "open_tail_log"]

logger = logging.getLogger("aioproc")

LineSink = Callable[[int, str], Awaitable[None]]
"""``async def sink(rank: int, line: str) -> None``: receives unprefixed lines."""

_T = TypeVar("_T")

_CHUNK = 64 * 1024
_BACKOFF_MIN = 0.001
_BACKOFF_MAX = 0.1

# inotify(7)
_IN_MODIFY = 0x00000002
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_MASK_ADD = 0x20000000
_DIR_MASK = _IN_CREATE | _IN_MOVED_TO | _IN_DELETE_SELF | _IN_MOVE_SELF | _IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


class _Watch:
    """One coroutine's interest in one inotify watch (``name``: a child of a dir)."""

    __slots__ = ("name", "wake", "wd")

    def __init__(self, wd: int, name: str | None, wake: asyncio.Event) -> None:
        self.wd = wd
        self.name = name
        self.wake = wake


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


class _Inotify:
    """One inotify fd on the loop; each event sets the wake events watching it."""

    def __init__(self, libc: ctypes.CDLL, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._libc = libc
        self._fd = fd
        self._loop = loop
        self._watches: dict[int, list[_Watch]] = {}
        loop.add_reader(fd, self._on_readable)

    def watch(self, path: str, mask: int, name: str | None, wake: asyncio.Event) -> _Watch:
        """Set ``wake`` on events for ``path`` (for a directory: on its child ``name``).

        Raises:
            OSError: from inotify_add_watch (ENOENT, ENOTDIR, ENOSPC, EACCES...).
        """
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask | _IN_MASK_ADD)
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        w = _Watch(wd, name, wake)
        self._watches.setdefault(wd, []).append(w)
        return w

    def unwatch(self, w: _Watch) -> None:
        group = self._watches.get(w.wd, [])
        if w not in group:
            return  # the kernel dropped the watch already, or we are closed
        group.remove(w)
        if not group:
            del self._watches[w.wd]
            self._libc.inotify_rm_watch(self._fd, w.wd)

    def close(self) -> None:
        self._watches.clear()
        self._loop.remove_reader(self._fd)
        os.close(self._fd)

    def _on_readable(self) -> None:
        try:
            buf = os.read(self._fd, 64 * 1024)
        except (BlockingIOError, InterruptedError):
            return
        pos = 0
        while pos + _EVENT.size <= len(buf):
            wd, mask, _cookie, size = _EVENT.unpack_from(buf, pos)
            pos += _EVENT.size
            raw = buf[pos : pos + size].rstrip(b"\0")
            pos += size
            if mask & _IN_Q_OVERFLOW:  # events were lost: everyone looks again
                for watchers in self._watches.values():
                    for w in watchers:
                        w.wake.set()
                continue
            group = self._watches.get(wd)
            if not group:
                continue
            name = os.fsdecode(raw) if raw else None
            for w in group:
                if w.name is None or name is None or w.name == name:
                    w.wake.set()
            if mask & _IN_IGNORED:  # the watch is gone (inode deleted, unmounted)
                del self._watches[wd]


def _open_inotify(loop: asyncio.AbstractEventLoop) -> _Inotify | None:
    """An inotify instance on ``loop``, or None where the backoff delay must do."""
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    if libc is None:
        return None
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)  # IN_NONBLOCK | IN_CLOEXEC
    if fd < 0:
        err = ctypes.get_errno()
        logger.debug("inotify unavailable (%s); TailLog uses a backoff delay", os.strerror(err))
        return None
    try:
        return _Inotify(libc, fd, loop)
    except (NotImplementedError, OSError, ValueError):  # a loop without add_reader
        os.close(fd)
        return None


def _open_regular(path: str) -> int:
    """Open ``path`` for reading; it must be a regular file (a FIFO must not block us)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_whole(stream: TextIO, text: str) -> None:
    """One write of whole lines, flushed, so readers of ``stream`` never see half a line."""
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):
        pass  # stream gone (closed pipe, closed file): the log files still hold everything


async def _open_off_loop(opener: Callable[[], _T]) -> _T:
    """``opener()`` on the helper thread; what it opened is closed if the caller is cancelled.

    Cancellation: the open finishes first (the helper thread runs every job
    to its end), then what it returned is closed and the cancellation raised.
    """
    opened: list[_T] = []

    def job() -> _T:
        result = opener()
        opened.append(result)
        return result

    try:
        return await run_blocking(job)
    except asyncio.CancelledError:
        for result in opened:
            if isinstance(result, int):
                os.close(result)
            else:
                result.close()  # type: ignore[attr-defined]
        raise


class _Tail:
    """The state of one followed file."""

    __slots__ = ("framer", "offset", "path", "prefix", "rank", "wake")

    def __init__(self, rank: int, path: str, prefix: str) -> None:
        self.rank = rank
        self.path = path
        self.prefix = prefix
        self.framer = LineFramer(prefix)
        self.offset = 0
        self.wake = asyncio.Event()


class TailLog:
    """Follows log files and copies their lines, prefixed, to one destination.

    Opened with ``open_tail_log(...)`` (awaited or with ``async with``), or,
    as in torch, built and then started with ``start()``.  The files need not
    exist when it starts: each is waited for without polling, then followed
    until ``aclose()`` (torch's ``stop()``), which drains every file to its
    end first.  A line is written whole and once, with its rank's
    prefix, however the writer chunked it; a partial last line is held until
    its newline or until ``aclose()``; a line longer than
    ``aioproc._output.tee.MAX_LINE`` bytes arrives in prefixed pieces; invalid
    UTF-8 becomes U+FFFD.  A path that is a directory (or cannot be opened)
    is logged as an error on the ``aioproc`` logger and skipped.  As in torch,
    a file is followed by the inode first opened: one replaced or truncated
    in place is not read again from its start.

    Usage::

        async with open_tail_log("trainer", {0: "/tmp/0.log", 1: "/tmp/1.log"}, sys.stdout):
            await run_trainers()
        # [trainer0]:first line of 0.log ...

        tail = await TailLog("trainer", log_files, sys.stdout).start()  # torch's face
        ...
        await tail.stop()

    The positional order is torch's (``name, log_files, dst,
    log_line_prefixes, interval_sec, log_line_filter``); ``TailLog`` is
    also its own context manager (``async with TailLog(...)``), as before.

    Args:
        name: Used in the default prefix ``[{name}{rank}]:``.
        log_files: Local rank -> path of the file to follow.
        dst: A text stream (written with whole-line writes and flushed), a
            path (``str`` or ``os.PathLike``) opened for append as UTF-8, or an
            async callable ``sink(rank, line)`` given each line without prefix.
        log_line_prefixes: Rank -> prefix overriding the default for that rank.
        interval_sec: Accepted for torch's signature, where it is the polling
            period. Unused while inotify is available (nothing polls); where
            it is not, it caps the backoff delay between re-checks.
        log_line_filter: As in torch: called with each line, without prefix
            and with its trailing newline; only lines it returns True for are
            written.  ``None`` keeps every line.

    Raises:
        TypeError: ``dst`` is none of the accepted kinds, or ``interval_sec``
            is not a number.
        ValueError: ``interval_sec`` is not positive and finite.
    """

    def __init__(
        self,
        name: str,
        log_files: dict[int, str],
        dst: TextIO | str | os.PathLike[str] | LineSink,
        log_line_prefixes: dict[int, str] | None = None,
        interval_sec: float = _BACKOFF_MAX,
        log_line_filter: Callable[[str], bool] | None = None,
    ) -> None:
        if isinstance(interval_sec, bool) or not isinstance(interval_sec, (int, float)):
            raise TypeError(f"interval_sec must be a number of seconds, not {interval_sec!r}")
        if not 0 < interval_sec < math.inf:
            raise ValueError(f"interval_sec must be positive and finite, got {interval_sec!r}")
        # the cap never falls below the first delay
        self._backoff_max = max(float(interval_sec), _BACKOFF_MIN)
        self._name = name
        self._log_files = dict(log_files)
        self._dst_path: str | None = None
        self._stream: TextIO | None = None
        self._sink: LineSink | None = None
        if isinstance(dst, (str, os.PathLike)):
            self._dst_path = os.fspath(dst)
        elif hasattr(dst, "write"):
            self._stream = dst  # type: ignore[assignment]
        elif callable(dst):
            self._sink = dst
        else:
            raise TypeError(f"dst must be a text stream, a path or an async callable, not {dst!r}")
        prefixes = log_line_prefixes or {}
        self._prefixes = {rank: prefixes.get(rank, f"[{name}{rank}]:") for rank in self._log_files}
        self._filter = log_line_filter
        self._state = "new"  # -> (starting ->) running -> stopping -> stopped
        self._tails: list[_Tail] = []
        self._owned: TextIO | None = None
        self._notify: _Inotify | None = None
        self._done = asyncio.Event()
        self._owner: Owner[None] = Owner(f"TailLog {self._name}")

    def __repr__(self) -> str:
        how = ""
        if self._state in ("running", "stopping"):
            how = ", inotify" if self._notify is not None else ", backoff"
        return f"<TailLog {self._name} files={len(self._log_files)} {self._state}{how}>"

    async def __aenter__(self) -> TailLog:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def stopped(self) -> bool:
        """True once ``aclose()`` (or ``stop()``) has finished."""
        return self._state == "stopped"

    async def start(self) -> TailLog:
        """Start following every file; return ``self``.

        Returns:
            This ``TailLog``, so ``tailer = await TailLog(...).start()`` works.

        Raises:
            RuntimeError: ``start()`` or ``aclose()`` was called before.
            OSError: the ``dst`` path cannot be opened.

        Cancellation: safe; if cancelled while opening the ``dst`` path,
        nothing is started and the ``TailLog`` is left stopped.
        """
        if self._state != "new":
            raise RuntimeError(f"cannot start {self!r}: a TailLog starts only once")
        loop = asyncio.get_running_loop()
        if self._dst_path is not None:
            self._state = "starting"
            opener = functools.partial(open, self._dst_path, "a", encoding="utf-8")
            try:
                self._owned = await _open_off_loop(opener)
            except BaseException:
                self._state = "stopped"
                self._done.set()
                raise
            if self._state != "starting":  # aclose() was called meanwhile
                self._owned.close()
                raise RuntimeError(f"{self!r} was stopped while starting")
            self._stream = self._owned
        if self._sink is not None:
            self._prefixes = dict.fromkeys(self._prefixes, "")
        self._state = "running"
        if self._log_files:
            self._notify = _open_inotify(loop)
        self._tails = [
            _Tail(rank, os.fspath(path), self._prefixes[rank])
            for rank, path in self._log_files.items()
        ]
        self._owner.start(self._follow_all, after=self._release_all)
        return self

    async def _follow_all(self, group: anyio.abc.TaskGroup) -> None:
        for t in self._tails:
            group.start_soon(self._follow, t, name=f"TailLog {self._name}{t.rank}")

    async def _release_all(self) -> None:
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        if self._owned is not None:
            self._owned.close()
        self._state = "stopped"
        self._done.set()

    async def stop(self) -> None:
        """torch's name for ``aclose()``: drain every file to its end and release all."""
        await self.aclose()

    async def aclose(self) -> None:
        """Drain every file to its end, emit held partial lines, and release everything.

        Everything written to the files before ``aclose()`` was called
        reaches ``dst``, a final line without newline included (once,
        whole).  Idempotent: a call while another task closes it waits for
        that close; a call once closed, or on a ``TailLog`` never started,
        returns at once.

        Cancellation: the drain is abandoned: the followers are cancelled
        and awaited, every fd (files, inotify, a ``dst`` path) is closed, the
        ``TailLog`` is stopped, and ``CancelledError`` propagates; lines not
        yet written are lost.
        """
        if self._state == "stopped":
            return
        if self._state == "stopping":
            await self._done.wait()
            return
        if self._state in ("new", "starting"):
            self._state = "stopped"
            self._done.set()
            return
        self._state = "stopping"
        for t in self._tails:
            t.wake.set()  # each follower drains its file to the end and returns
        try:
            await self._owner.wait()
        except asyncio.CancelledError:
            self._owner.cancel()
            await asyncio.shield(self._done.wait())
            raise

    # --- one follower per file ------------------------------------------------

    async def _follow(self, t: _Tail) -> None:
        with helper():  # one helper thread for the reads while the tail runs
            await self._follow_file(t)

    async def _follow_file(self, t: _Tail) -> None:
        fd: int | None = None
        try:
            fd = await self._wait_for_file(t)
            if fd is not None:
                await self._follow_fd(t, fd)
        except OSError as exc:  # a directory, no permission, an I/O error
            reason = exc.strerror or str(exc)
            logger.error(
                "TailLog %s: cannot tail %s (rank %d): %s", self._name, t.path, t.rank, reason
            )
        except Exception:  # the sink or the filter raised
            logger.exception("TailLog %s: tail of %s (rank %d) failed", self._name, t.path, t.rank)
        finally:
            if fd is not None:
                os.close(fd)  # the helper thread has returned: no read holds it

    async def _wait_for_file(self, t: _Tail) -> int | None:
        """The open fd of ``t.path`` once it exists; None if stopped before it did."""
        delay = _BACKOFF_MIN
        while True:
            t.wake.clear()
            # read the state before trying: an aclose() during a failed open needs one more try
            last_try = self._state != "running"
            w = self._watch_parent(t)
            try:
                try:
                    return await _open_off_loop(functools.partial(_open_regular, t.path))
                except FileNotFoundError:
                    pass
                if last_try:
                    return None
                # a dangling symlink's target directory is not watched
                if w is None or os.path.islink(t.path):  # noqa: ASYNC240 - one lstat
                    await self._backoff(t, delay)
                    delay = min(delay * 2, self._backoff_max)
                else:
                    await t.wake.wait()
            finally:
                if w is not None and self._notify is not None:
                    self._notify.unwatch(w)

    def _watch_parent(self, t: _Tail) -> _Watch | None:
        """Watch the nearest existing ancestor of ``t.path`` for its next component."""
        if self._notify is None:
            return None
        child = os.path.abspath(t.path)
        while True:
            parent = os.path.dirname(child)
            try:
                return self._notify.watch(parent, _DIR_MASK, os.path.basename(child), t.wake)
            except (FileNotFoundError, NotADirectoryError):
                if parent == child:
                    return None
                child = parent
            except OSError:  # ENOSPC (watch limit), EACCES: back off instead
                return None

    def _watch_file(self, t: _Tail, fd: int) -> _Watch | None:
        if self._notify is None:
            return None
        for target in (f"/proc/self/fd/{fd}", t.path):  # the inode we read, if /proc allows
            try:
                return self._notify.watch(target, _IN_MODIFY, None, t.wake)
            except OSError:
                continue
        return None

    async def _follow_fd(self, t: _Tail, fd: int) -> None:
        w = self._watch_file(t, fd)
        try:
            delay = _BACKOFF_MIN
            while True:
                t.wake.clear()
                if self._state != "running":
                    await self._drain(t, fd, final=True)
                    break
                got = await self._drain(t, fd, final=False)
                if w is not None:
                    await t.wake.wait()
                else:
                    delay = _BACKOFF_MIN if got else min(delay * 2, self._backoff_max)
                    await self._backoff(t, delay)
            await self._emit(t, t.framer.flush())
        finally:
            if w is not None and self._notify is not None:
                self._notify.unwatch(w)

    async def _drain(self, t: _Tail, fd: int, *, final: bool) -> bool:
        """Read what the file holds now; ``final``: exactly up to its current size."""
        end = (await run_blocking(os.fstat, fd)).st_size if final else None
        got = False
        while True:
            want = _CHUNK if end is None else min(_CHUNK, end - t.offset)
            if want <= 0:
                break
            data = await run_blocking(os.pread, fd, want, t.offset)
            if not data:
                break
            t.offset += len(data)
            got = True
            await self._emit(t, t.framer.feed(data))
            # a short read is the end of a regular file; aclose() wants the final drain
            if end is None and (len(data) < want or self._state != "running"):
                break
        return got

    async def _backoff(self, t: _Tail, delay: float) -> None:
        handle = asyncio.get_running_loop().call_later(delay, t.wake.set)
        try:
            await t.wake.wait()
        finally:
            handle.cancel()

    async def _emit(self, t: _Tail, text: str) -> None:
        """Send the framer's whole lines (``text``) to the destination."""
        if not text:
            return
        keep = self._filter
        if self._stream is not None and keep is None:
            _write_whole(self._stream, text)
            return
        lines = text.split("\n")
        lines.pop()  # text ends with a newline
        cut = len(t.prefix)
        if self._sink is not None:
            for line in lines:
                line = f"{line}\n"
                if keep is None or keep(line):
                    await self._sink(t.rank, line)
        elif self._stream is not None and keep is not None:
            kept = [f"{line}\n" for line in lines if keep(f"{line[cut:]}\n")]
            if kept:
                _write_whole(self._stream, "".join(kept))


def open_tail_log(
    name: str,
    log_files: dict[int, str],
    dst: TextIO | str | os.PathLike[str] | LineSink,
    *,
    log_line_prefixes: dict[int, str] | None = None,
    interval_sec: float = _BACKOFF_MAX,
    log_line_filter: Callable[[str], bool] | None = None,
) -> OpenResource[TailLog]:
    """Follow ``log_files`` and copy their lines, prefixed, to ``dst``: a started ``TailLog``.

    Awaited, it returns the running ``TailLog`` (close it with ``await
    tail.aclose()``); with ``async with``, the block's end closes it, which
    drains every file to its end first.  The arguments are ``TailLog``'s
    (its options keyword-only here); they are checked when this is called,
    before anything starts.

    Usage::

        async with open_tail_log("trainer", {0: "0.log", 1: "1.log"}, sys.stdout):
            await run_trainers()

    Returns:
        An ``OpenResource``: ``await`` it, or use it with ``async with``.

    Raises:
        TypeError, ValueError: as ``TailLog`` (at the call).
        OSError: the ``dst`` path cannot be opened (when awaited).

    Cancellation: cancelled while it opens a ``dst`` path, nothing is left
    open; leaving the ``async with`` block by a cancellation still closes
    the ``TailLog`` (see ``TailLog.aclose``).
    """
    tail = TailLog(
        name,
        log_files,
        dst,
        log_line_prefixes,
        interval_sec,
        log_line_filter,
    )

    async def close(tail: TailLog, exc: BaseException | None) -> None:
        await tail.aclose()

    return OpenResource(tail.start, close, "open_tail_log(...)")
