"""Parent side of watchdog timers: ``WatchdogServer``, opened by ``open_watchdog``.

Design.  One ``AF_UNIX``/``SOCK_DGRAM`` socketpair per agent run.  Workers
inherit the child end (``pass_fds``; its number in ``AIOPROC_WATCHDOG_FD``)
and write one JSON datagram per request (``aioproc.timer``).  The parent end
has ``SO_PASSCRED``: every datagram arrives with the sender's pid as verified
by the kernel, which a process cannot forge without privileges.  A request is
acted on only when the pid it names is that pid, and that pid is a current
worker or in a current worker's process group (a descendant); anything else
is rejected and logged, never acted on.  The channel is private: no path
anybody could open, only fds the agent's workers inherit.

Each timer is one ``loop.call_at`` handle, measured on the loop's monotonic
clock from when the request was received, so a wall-clock jump can never
fire a timer early.  Nothing polls: requests wake a reader callback, deadlines
are timer handles, and a pidfd per worker drops its timers the moment it
exits (as torch's server drops timers of dead pids).

On expiry: ``on_expired`` first (the agent records the failure), then
``SIGUSR2`` to the process holding the timer (``faulthandler`` dumps its
stack), then a bounded wait for that process's "dumped" datagram, then
``SIGKILL`` to the worker's process group.

Requests from a pid not known yet are held until the next ``set_workers``:
the agent learns its workers' pids only after spawning them, and a quick
worker may acquire a timer before that.  The timer still counts from when
its request was received.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import math
import os
import signal
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from .._base.resource import OpenResource
from ..timer import FD_ENV, INODE_ENV, MAX_SCOPE_LEN

__all__ = ["WatchdogServer", "open_watchdog"]

logger = logging.getLogger("aioproc")

MAX_DATAGRAM = 4096
"""Longest request accepted, in bytes (a request is a few hundred at most)."""

DUMP_TIMEOUT = 0.5
"""Longest wait for a stack dump before the SIGKILL, in seconds."""

MAX_TIMERS = 65536
"""Armed timers at most, over all workers: a bound on what workers can make us hold."""

MAX_HELD = 1024
"""Requests from not-yet-known pids held at most until the next ``set_workers``."""

MAX_DELAY = 1e8
"""Longer timers are armed for this long (~3 years): loops cannot schedule infinity."""

_GONE = -1  # _worker_of: no such process
_MAX_WARNINGS = 100  # rejections logged at WARNING; later ones at DEBUG
_READS_PER_WAKEUP = 256  # datagrams handled per reader callback: others get their turn
_OPS = ("acquire", "release", "dumped")
_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid


@dataclass
class _Request:
    op: str
    pid: int
    id: int = 0
    scope: str = ""
    after: float = 0.0
    received: float = 0.0  # loop time


@dataclass
class _Timer:
    handle: asyncio.TimerHandle
    worker: int  # pid of the worker (its process group id)
    rank: int
    pid: int  # the process holding the timer: the worker or a descendant
    scope: str
    after: float


class _Rejected(Exception):
    pass


class WatchdogServer:
    """Enforces the ``aioproc.timer.expires`` timers of one agent's workers.

    Opened with ``open_watchdog(on_expired)`` (awaited or with ``async
    with``), closed with ``aclose()``; torch's timer-server face,
    ``WatchdogServer(on_expired)`` then ``start()`` and ``stop()``, stays.

    Args:
        on_expired: called as ``on_expired(local_rank, pid, scope, after)``
            when a timer expires, before the stack dump and the kill.

    Usage (what ``LocalElasticAgent`` does)::

        async with open_watchdog(on_expired) as server:
            pc = await start_processes(..., envs={r: {**env, **server.env()}},
                                       pass_fds=server.pass_fds())
            server.set_workers(pc.pids())
            ...
    """

    def __init__(self, on_expired: Callable[[int, int, str, float], None]) -> None:
        if not callable(on_expired):
            raise TypeError(f"on_expired must be callable, got {on_expired!r}")
        self._on_expired = on_expired
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None  # parent end: receives
        self._child: socket.socket | None = None  # child end: inherited by workers
        self._workers: dict[int, int] = {}  # worker pid -> local rank
        self._exited: set[int] = set()  # workers that have exited: nothing to enforce
        self._pidfds: dict[int, int] = {}  # worker pid -> pidfd watched for its exit
        self._timers: dict[tuple[int, int], _Timer] = {}  # (pid, timer id) -> timer
        self._held: list[_Request] = []
        self._firing: set[int] = set()  # worker pids being dumped and killed
        self._dump_waiters: dict[int, asyncio.Future[None]] = {}
        self._kills: set[asyncio.Task[None]] = set()
        self._closing = False
        self._closed: asyncio.Event | None = None  # set once aclose() is done
        self._rejected = 0

    def __repr__(self) -> str:
        if self._closing:
            state = "closed"
        elif self._sock is None:
            state = "not started"
        else:
            state = f"fd={self._child.fileno() if self._child else -1} running"
        return f"<WatchdogServer {state} workers={len(self._workers)} timers={len(self._timers)}>"

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the channel and start receiving requests.

        Raises:
            RuntimeError: already started or closed, or the platform has no
                ``SO_PASSCRED`` (Linux only).
        """
        if self._sock is not None or self._closing:
            raise RuntimeError(f"{self!r} cannot be started twice")
        if not hasattr(socket, "SO_PASSCRED"):
            raise RuntimeError("watchdog timers need SO_PASSCRED credentials (Linux)")
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            parent.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            parent.setblocking(False)
            loop.add_reader(parent.fileno(), self._on_readable)
        except BaseException:
            parent.close()
            child.close()
            raise
        self._loop, self._sock, self._child = loop, parent, child

    def env(self) -> dict[str, str]:
        """Environment variables telling ``aioproc.timer`` in a worker where to write."""
        child = self._started_child()
        st = os.fstat(child.fileno())
        return {FD_ENV: str(child.fileno()), INODE_ENV: f"{st.st_dev}:{st.st_ino}"}

    def pass_fds(self) -> tuple[int, ...]:
        """The fds every worker must inherit (``start_processes(pass_fds=...)``)."""
        return (self._started_child().fileno(),)

    def set_workers(self, pids: Mapping[int, int]) -> None:
        """Make ``{local_rank: pid}`` the current workers.

        Replaces the previous workers: their timers are dropped.  Requests
        held from pids unknown until now are handled (or rejected) now.
        """
        if not isinstance(pids, Mapping) or not all(
            _is_int(rank) and _is_int(pid) and pid > 0 for rank, pid in pids.items()
        ):
            raise TypeError(f"set_workers() needs a {{local_rank: pid}} dict, got {pids!r}")
        self._started_child()
        workers = {pid: rank for rank, pid in pids.items()}
        kept = {pid for pid, rank in workers.items() if self._workers.get(pid) == rank}
        for key, timer in list(self._timers.items()):
            if timer.worker not in kept:
                timer.handle.cancel()
                del self._timers[key]
        for pid in list(self._pidfds):
            if pid not in kept:
                self._unwatch(pid)
        self._exited &= kept
        self._firing &= kept
        self._workers = workers
        for pid in list(workers):
            if pid not in self._pidfds and pid not in self._exited:
                self._watch(pid)
        held, self._held = self._held, []
        for request in held:
            self._dispatch(request, final=True)

    async def stop(self) -> None:
        """torch's name (its timer servers' ``stop()``) for ``aclose()``."""
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel every timer, finish kills under way, and close the channel.

        Requests still queued are read first, so every rejection is logged.
        Idempotent and safe from any task: a call while another task closes
        the server waits for that close; a call once closed (or on a server
        never started) returns at once.

        Cancellation: the channel is closed all the same; a kill under way
        still ends with its SIGKILL.  A call waiting for another task's
        close stops waiting; that close goes on.
        """
        if self._closing:
            if self._closed is not None:
                await self._closed.wait()
            return
        self._closing = True
        self._closed = asyncio.Event()
        try:
            await self._close()
        finally:
            self._closed.set()

    async def _close(self) -> None:
        for timer in self._timers.values():
            timer.handle.cancel()
        self._timers.clear()
        try:
            if self._kills:
                # each is bounded by DUMP_TIMEOUT; the dumped datagrams come through the reader
                await asyncio.wait(set(self._kills), timeout=DUMP_TIMEOUT + 1)
        finally:
            if self._sock is not None:
                self._drain()
            held, self._held = self._held, []
            for request in held:
                self._dispatch(request, final=True)  # rejects what came from non-workers
            for pid in list(self._pidfds):
                self._unwatch(pid)
            self._workers = {}
            self._exited = set()
            for task in self._kills:
                task.cancel()  # its finally still sends the SIGKILL
            if self._loop is not None and self._sock is not None:
                self._loop.remove_reader(self._sock.fileno())
            for sock in (self._sock, self._child):
                if sock is not None:
                    sock.close()

    def _started_child(self) -> socket.socket:
        if self._child is None or self._closing:
            raise RuntimeError(f"{self!r} is not running; call await start() first")
        return self._child

    # ---------------------------------------------------------- worker exits

    def _watch(self, pid: int) -> None:
        assert self._loop is not None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._worker_exited(pid)  # gone already: nothing of it to enforce
            return
        except (AttributeError, OSError):
            return  # no pidfds (kernel < 5.3): timers are dropped by set_workers only
        self._pidfds[pid] = pidfd
        self._loop.add_reader(pidfd, self._worker_exited, pid)

    def _unwatch(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None:
            assert self._loop is not None
            self._loop.remove_reader(pidfd)
            os.close(pidfd)

    def _worker_exited(self, pid: int) -> None:
        # it stays in _workers: requests it sent before exiting may still be
        # queued, and are recognised (and ignored) rather than rejected
        self._unwatch(pid)
        self._exited.add(pid)
        for key, timer in list(self._timers.items()):
            if timer.worker == pid:
                timer.handle.cancel()
                del self._timers[key]
        waiter = self._dump_waiters.get(pid)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # a dead process writes no more of its dump

    # ------------------------------------------------------------- requests

    def _on_readable(self) -> None:
        for _ in range(_READS_PER_WAKEUP):
            if not self._receive_one():
                return

    def _drain(self) -> None:
        for _ in range(MAX_TIMERS):
            if not self._receive_one():
                return

    def _receive_one(self) -> bool:
        """Handle one datagram; False when none is waiting."""
        assert self._sock is not None
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(
                MAX_DATAGRAM, socket.CMSG_SPACE(_UCRED.size), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as e:
            logger.warning("watchdog: receiving a request failed: %r", e)
            return False
        sender, fds = _credentials(ancdata)
        try:
            if fds:
                raise _Rejected("it carries file descriptors")
            if flags & socket.MSG_TRUNC:
                raise _Rejected(f"datagram longer than {MAX_DATAGRAM} bytes")
            if flags & socket.MSG_CTRUNC:
                raise _Rejected("unexpected ancillary data")
            if sender is None:
                raise _Rejected("no sender credentials")
            assert self._loop is not None
            request = _parse(data, self._loop.time())
            if request.pid != sender:
                raise _Rejected(f"it names pid {request.pid} but was sent by pid {sender}")
        except _Rejected as e:
            self._reject(sender, str(e))
            return True
        self._dispatch(request, final=False)
        return True

    def _dispatch(self, request: _Request, final: bool) -> None:
        if request.op == "dumped":
            waiter = self._dump_waiters.get(request.pid)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        worker = self._worker_of(request.pid)
        if worker == _GONE:
            # a descendant that exited after sending: its sender pid was
            # verified, only its process group can no longer be; moot anyway
            logger.debug("watchdog: ignored a %s request of exited pid %d", request.op, request.pid)
            return
        if worker is None:
            if final or self._closing:
                self._reject(request.pid, _not_a_worker(request.pid))
            elif len(self._held) >= MAX_HELD:
                self._reject(request.pid, "too many requests from pids that are not workers")
            else:
                self._held.append(request)
            return
        if self._closing or worker in self._firing or worker in self._exited:
            return  # nothing to enforce any more: closed, being killed, or gone
        key = (request.pid, request.id)
        old = self._timers.pop(key, None)
        if old is not None:
            old.handle.cancel()
        if request.op == "release":
            if old is None:
                logger.debug("watchdog: pid %d released unknown timer %d", *key)
            return
        if len(self._timers) >= MAX_TIMERS:
            self._reject(request.pid, f"more than {MAX_TIMERS} timers armed")
            return
        assert self._loop is not None
        when = request.received + min(request.after, MAX_DELAY)
        handle = self._loop.call_at(when, self._expire, key)
        rank = self._workers[worker]
        self._timers[key] = _Timer(handle, worker, rank, request.pid, request.scope, request.after)

    def _worker_of(self, pid: int) -> int | None:
        """The current worker ``pid`` is or whose process group it is in.

        ``None`` when it is neither, ``_GONE`` when no process ``pid`` exists.
        """
        if pid in self._workers:
            return pid
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            return _GONE
        except OSError:
            return None
        return pgid if pgid in self._workers else None

    def _reject(self, pid: int | None, reason: str) -> None:
        self._rejected += 1
        sender = "an unknown sender" if pid is None else f"pid {pid}"
        if self._rejected <= _MAX_WARNINGS:
            logger.warning("watchdog: rejected a request from %s: %s", sender, reason)
            if self._rejected == _MAX_WARNINGS:
                logger.warning("watchdog: further rejected requests are logged at DEBUG level")
        else:
            logger.debug("watchdog: rejected a request from %s: %s", sender, reason)

    # --------------------------------------------------------------- expiry

    def _expire(self, key: tuple[int, int]) -> None:
        timer = self._timers.pop(key, None)
        if timer is None or self._closing or timer.worker in self._firing:
            return
        if timer.pid != timer.worker and self._worker_of(timer.pid) != timer.worker:
            # a descendant that has exited (or left the group) since: as torch
            # drops timers of processes no longer running, so do we
            logger.debug("watchdog: dropped timer %r of exited pid %d", timer.scope, timer.pid)
            return
        self._firing.add(timer.worker)
        for other_key, other in list(self._timers.items()):
            if other.worker == timer.worker:  # the whole group is about to die
                other.handle.cancel()
                del self._timers[other_key]
        logger.warning(
            "watchdog: timer %r of rank %d (pid %d) expired after %g s; "
            "dumping its stack and killing process group %d",
            timer.scope,
            timer.rank,
            timer.pid,
            timer.after,
            timer.worker,
        )
        try:
            self._on_expired(timer.rank, timer.pid, timer.scope, timer.after)
        except Exception:
            logger.exception("watchdog: on_expired callback failed")
        assert self._loop is not None
        task = self._loop.create_task(
            self._dump_and_kill(timer.pid, timer.worker), name=f"aioproc-watchdog-{timer.pid}"
        )
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _dump_and_kill(self, pid: int, worker: int) -> None:
        assert self._loop is not None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._dump_waiters[pid] = waiter
        try:
            try:
                os.kill(pid, signal.SIGUSR2)
            except OSError:
                pass  # gone, or not ours any more: nothing to dump
            else:
                # faulthandler writes the dump from a C-level handler, even while
                # the main thread is stuck in C code, but says nothing when done.
                # The worker's chained Python handler then sends "dumped", which
                # resolves the waiter; it cannot run while the main thread is
                # stuck in C code (or was not installed: first use off the main
                # thread, SIGUSR2 taken), hence the bound.
                await asyncio.wait({waiter}, timeout=DUMP_TIMEOUT)
        finally:
            if self._dump_waiters.get(pid) is waiter:
                del self._dump_waiters[pid]
            waiter.cancel()
            try:
                os.killpg(worker, signal.SIGKILL)
            except OSError:
                pass  # the group is gone already


def open_watchdog(
    on_expired: Callable[[int, int, str, float], None],
) -> OpenResource[WatchdogServer]:
    """A started ``WatchdogServer``: awaited, or with ``async with`` (whose end closes it).

    Args:
        on_expired: as for ``WatchdogServer``; checked at the call.

    Returns:
        An ``OpenResource``: ``await`` it (then ``await server.aclose()``),
        or use it with ``async with``.

    Raises:
        TypeError: ``on_expired`` is not callable (at the call).
        RuntimeError: the platform has no ``SO_PASSCRED`` (when opened).

    Cancellation: the start is not interrupted (it does not wait); leaving
    the ``async with`` block by a cancellation closes the server (see
    ``WatchdogServer.aclose``).
    """
    server = WatchdogServer(on_expired)

    async def start() -> WatchdogServer:
        await server.start()
        return server

    async def close(server: WatchdogServer, exc: BaseException | None) -> None:
        await server.aclose()

    return OpenResource(start, close, "open_watchdog(...)")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _credentials(ancdata: list[tuple[int, int, bytes]]) -> tuple[int | None, bool]:
    """The kernel-verified sender pid, and whether fds came along (closed here)."""
    pid = None
    had_fds = False
    for level, kind, data in ancdata:
        if level != socket.SOL_SOCKET:
            continue
        if kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid = _UCRED.unpack_from(data)[0]
        elif kind == socket.SCM_RIGHTS:
            # fds nobody asked for (our buffer has no room for them, so the
            # kernel drops them; should any arrive, they must not leak)
            had_fds = True
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
    return pid, had_fds


def _not_a_worker(pid: int) -> str:
    return f"pid {pid} is neither a worker of this agent nor in a worker's process group"


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _parse(data: bytes, received: float) -> _Request:
    try:
        message = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError
        raise _Rejected(f"malformed request ({type(e).__name__}: {_short(str(e))})") from None
    if not isinstance(message, dict):
        raise _Rejected(f"malformed request (not a JSON object: {_short(repr(message))})")
    op = message.get("op")
    if op not in _OPS:
        raise _Rejected(f"unknown op {_short(repr(op))}")
    pid = message.get("pid")
    if not _is_int(pid):
        raise _Rejected(f"malformed {op} request: 'pid' must be an int, got {_short(repr(pid))}")
    if pid <= 0:
        raise _Rejected(f"it names pid {pid}, which is not a process")
    request = _Request(op, pid, received=received)
    if op == "dumped":
        return request
    timer_id = message.get("id")
    if not _is_int(timer_id) or timer_id < 0:
        raise _Rejected(
            f"malformed {op} request: 'id' must be an int >= 0, got {_short(repr(timer_id))}"
        )
    request.id = timer_id
    if op == "release":
        return request
    scope = message.get("scope")
    if not isinstance(scope, str) or len(scope) > MAX_SCOPE_LEN:
        raise _Rejected(
            f"malformed acquire request: 'scope' must be a str of at most {MAX_SCOPE_LEN} "
            f"characters, got {_short(repr(scope))}"
        )
    after = message.get("after")
    if isinstance(after, bool) or not isinstance(after, (int, float)):
        raise _Rejected(
            f"malformed acquire request: 'after' must be a number, got {_short(repr(after))}"
        )
    if not math.isfinite(after) or after < 0:
        raise _Rejected(f"malformed acquire request: 'after' must be >= 0, got {after!r}")
    request.scope = scope
    request.after = float(after)
    return request


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
