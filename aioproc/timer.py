"""Watchdog timers for worker code: ``with expires(after=seconds): ...``.

The worker half of ``WorkerSpec(watchdog=True)``, with the semantics of
``torch.distributed.elastic.timer.expires``: a block that is still running
``after`` seconds after it was entered makes its worker eligible to be
reaped.  The agent (``aioproc.agent.watchdog``) then dumps the Python stack
of the process that holds the timer into that process's stderr, kills the
worker's whole process group, and reports the failure as
``watchdog timer '<scope>' expired after N s``.  A block that finishes in
time never fires.

Design: the agent hands every worker one end of a private ``AF_UNIX``
datagram socketpair, inherited as an fd whose number is in
``AIOPROC_WATCHDOG_FD`` (and whose identity, ``st_dev:st_ino``, is in
``AIOPROC_WATCHDOG_INODE`` so that a descendant that did not inherit the fd
never writes into whatever else got that number).  Each acquire or release
is one JSON datagram, written with a single send: atomic, so threads and
forked children share the fd safely.  Sends never block the worker
(``MSG_DONTWAIT``): when the agent's loop is busy and the socket's queue is
full, requests wait in a bounded queue that a daemon thread delivers in
order as the agent catches up, so no release is lost; past ``MAX_PENDING``
waiting requests, new blocks are not enforced (with a warning) rather than
blocking or growing memory.  The kernel stamps every datagram
with the sender's pid (``SCM_CREDENTIALS``), which the agent checks against
the pid the request names.

This module runs inside workers: it imports only the standard library, and
importing it is cheap (``json``, ``signal`` and ``faulthandler`` are loaded
on first use).  It never imports asyncio, anyio, uvloop or a
parent-side aioproc module.

Stack dumps: on first use, ``faulthandler`` is registered for ``SIGUSR2``
(all threads, written to stderr's fd), so the dump is written by C code the
moment the signal arrives, even while the main thread is stuck in a C call.
When ``SIGUSR2`` had no handler and the first use is on the main thread, a
Python-level handler is chained after it: it flushes ``sys.stdout`` and
``sys.stderr`` and tells the agent the dump is complete, so the agent kills
at once instead of waiting out its bound.  ``SIGUSR2`` therefore belongs to
the watchdog in a worker that uses ``expires``.
"""

from __future__ import annotations

import _thread
import itertools
import math
import os
import sys
import time
import warnings

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers

if TYPE_CHECKING:
    from types import FrameType, TracebackType
    from typing import Any

__all__ = [
    "FD_ENV",
    "INODE_ENV",
    "MAX_PENDING",
    "MAX_SCOPE_LEN",
    "TimerClient",
    "WatchdogClient",
    "configure",
    "expires",
    "is_enabled",
]

FD_ENV = "AIOPROC_WATCHDOG_FD"
"""Environment variable holding the number of the inherited watchdog fd."""

INODE_ENV = "AIOPROC_WATCHDOG_INODE"
"""Environment variable holding ``"<st_dev>:<st_ino>"`` of that fd."""

MAX_SCOPE_LEN = 1024
"""Longest scope name, in characters (a request is one small datagram)."""

MAX_PENDING = 1024
"""Requests queued at most while the agent does not read; acquires beyond are dropped."""

_lock = _thread.allocate_lock()
_queue_lock = _thread.allocate_lock()  # _pending, _flushing; never held while warning
_pending: list[bytes] = []  # requests waiting for the flusher thread, oldest first
_flushing = False
_dropped_warned = False
_fd: int | None = None  # None: not configured yet; -1: disabled
_disabled_reason = ""
_warned = False
_ids = itertools.count(1)  # next() is atomic under the GIL: ids are unique per process
# (pid, scope) -> the id of that scope's live timer: torch keys timers by
# worker and scope, so a nested block of the same scope replaces the timer
# and its release ends it (the pid keeps a forked child's timers its own)
_scope_ids: dict[tuple[int, str], int] = {}


class TimerClient:
    """What ``expires`` talks to (torch's ``TimerClient`` interface).

    Subclass it to send timers elsewhere; ``configure(client)`` makes a
    client the default of ``expires``.
    """

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Start (or replace) this process's timer for ``scope_id``.

        Args:
            scope_id: the timer's name.
            expiration_time: when it expires, in ``time.time()`` seconds.
        """
        raise NotImplementedError

    def release(self, scope_id: str) -> None:
        """End this process's timer for ``scope_id`` (none running: nothing)."""
        raise NotImplementedError


class WatchdogClient(TimerClient):
    """The client of the agent's watchdog (``WorkerSpec(watchdog=True)``).

    The default client of ``expires``. As in torch's servers, a process has
    one timer per scope: acquiring a scope that is running replaces its
    deadline, releasing it ends it. Outside an aioproc agent with a
    watchdog, it warns once and does nothing.
    """

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        if isinstance(expiration_time, _Deadline):
            # from an expires() block: its exact ``after`` (no clock round
            # trip), a warning that names the user's ``with`` line, and
            # whether the agent will hear of the block
            expiration_time.accepted = self._acquire(scope_id, expiration_time.after, stacklevel=5)
        else:
            self._acquire(scope_id, expiration_time - time.time(), stacklevel=4)

    def release(self, scope_id: str) -> None:
        timer_id = _scope_ids.pop((os.getpid(), scope_id), None)
        if timer_id is not None and _fd is not None and _fd >= 0:
            _send(_fd, {"op": "release", "pid": os.getpid(), "id": timer_id})

    def _acquire(self, scope: str, after: float, stacklevel: int) -> bool:
        # True: the agent got (or will get) the request
        if not isinstance(scope, str):
            raise TypeError(f"scope_id must be a str, got {scope!r}")
        if len(scope) > MAX_SCOPE_LEN:
            raise ValueError(
                f"scope_id is {len(scope)} characters long; at most {MAX_SCOPE_LEN} fit"
            )
        fd = _channel(warn_stacklevel=stacklevel)
        if fd < 0:
            return False
        key = (os.getpid(), scope)
        timer_id = _scope_ids.get(key) or next(_ids)
        request = {
            "op": "acquire",
            "pid": key[0],
            "id": timer_id,
            "scope": scope,
            "after": max(0.0, after),
        }
        if not _send(fd, request):
            return False
        _scope_ids[key] = timer_id
        return True


_default_client = WatchdogClient()
_client: TimerClient = _default_client


def configure(timer_client: TimerClient | None) -> None:
    """Make ``timer_client`` the client ``expires`` uses by default (torch's ``configure``).

    Args:
        timer_client: the client; None restores aioproc's ``WatchdogClient``.

    Raises:
        TypeError: ``timer_client`` has no ``acquire``/``release`` methods.
    """
    global _client
    if timer_client is None:
        _client = _default_client
        return
    if not all(callable(getattr(timer_client, m, None)) for m in ("acquire", "release")):
        raise TypeError(
            f"configure() needs a TimerClient (acquire and release methods), got {timer_client!r}"
        )
    _client = timer_client


def is_enabled() -> bool:
    """Whether ``expires`` is enforced in this process.

    True when this process runs under an aioproc agent with
    ``watchdog=True`` and has inherited its watchdog fd.  The first call (or
    the first ``expires``) also installs the ``SIGUSR2`` stack-dump handler.
    """
    return _channel() >= 0


def expires(after: float, scope: str | None = None, client: TimerClient | None = None) -> _Expires:
    """A countdown timer over a ``with`` block, like torch's ``expires``.

    Usage::

        from aioproc.timer import expires

        with expires(after=60, scope="all_reduce"):
            all_reduce(...)

    Entering the block acquires a timer that expires ``after`` seconds later
    unless the block has been left by then.  An expired timer makes the
    worker eligible to be reaped: the agent dumps this process's stack to its
    stderr and kills the worker's process group, typically within a few
    milliseconds of the deadline (never before it).  Blocks nest and may run
    in several threads and in forked children that stay in the worker's
    process group.  As in torch, a process has one timer per scope: a
    nested block with the same scope (the default scope is the call site,
    so only a recursive call or an explicit scope repeats one) replaces the
    outer block's deadline, and leaving it ends the timer for both.

    Entering and leaving a block never block the worker, even while the
    agent's event loop is busy: requests the agent cannot take yet wait in a
    bounded queue (``MAX_PENDING``) delivered in order by a daemon thread,
    so a block's release is never lost; beyond that bound new blocks are not
    enforced, with a ``RuntimeWarning``.

    Unlike torch, which raises when no timer client is configured, outside an
    aioproc agent with ``watchdog=True`` (no ``AIOPROC_WATCHDOG_FD``) the
    block is not enforced: the first use emits a ``RuntimeWarning`` and every
    ``expires`` is a no-op, so the same code runs with and without a watchdog.

    Args:
        after: seconds from entering the block to the deadline, a finite
            number >= 0.
        scope: name of the timer in the failure message.  Default, as in
            torch: the caller's ``"<file>#<line>"``.
        client: the ``TimerClient`` to use; default: the one given to
            ``configure``, else the agent's watchdog.  As in torch, entering
            the block calls its ``acquire(scope, expiration_time)`` and
            leaving it its ``release(scope)``, subclasses of
            ``WatchdogClient`` included.

    Returns:
        A single-use context manager.

    Raises:
        TypeError: ``after`` is not a number, ``scope`` not a str or
            ``client`` not a ``TimerClient``.
        ValueError: ``after`` is negative or not finite, or ``scope`` is longer
            than ``MAX_SCOPE_LEN`` characters.
    """
    if isinstance(after, bool) or not isinstance(after, (int, float)):
        raise TypeError(f"expires(after=...) must be a number of seconds, got {after!r}")
    if not math.isfinite(after) or after < 0:
        raise ValueError(f"expires(after=...) must be a finite number >= 0, got {after!r}")
    if scope is None:
        caller = sys._getframe(1)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
        if len(scope) > MAX_SCOPE_LEN:
            scope = "..." + scope[-(MAX_SCOPE_LEN - 3) :]
    elif not isinstance(scope, str):
        raise TypeError(f"expires(scope=...) must be a str, got {scope!r}")
    elif len(scope) > MAX_SCOPE_LEN:
        raise ValueError(
            f"expires(scope=...) is {len(scope)} characters long; at most {MAX_SCOPE_LEN} fit"
        )
    if client is not None and not all(
        callable(getattr(client, m, None)) for m in ("acquire", "release")
    ):
        raise TypeError(f"expires(client=...) must be a TimerClient, got {client!r}")
    return _Expires(float(after), scope, client)


class _Deadline(float):
    """The ``expiration_time`` an ``expires`` block gives its client's ``acquire``.

    A float to any client (``time.time()`` seconds, as torch passes it);
    ``WatchdogClient.acquire`` also reads the block's exact ``after`` from it
    and sets ``accepted`` False when the agent will never hear of the block
    (no watchdog, or too many requests queued): ``release`` is then not
    called either.
    """

    __slots__ = ("accepted", "after")

    after: float
    accepted: bool


class _Expires:
    """One ``expires(...)`` block: acquire on enter, release on exit."""

    __slots__ = ("_client", "_entered", "_used", "after", "scope")

    def __init__(self, after: float, scope: str, client: TimerClient | None) -> None:
        self.after = after
        self.scope = scope
        self._client = client
        self._entered: TimerClient | None = None
        self._used = False

    def __repr__(self) -> str:
        state = "active" if self._entered is not None else ("done" if self._used else "new")
        return f"<expires {self.scope!r} after={self.after:g} s {state}>"

    def __enter__(self) -> None:
        if self._used:
            raise RuntimeError(f"{self!r} was already entered; call expires() for each block")
        self._used = True
        client = self._client if self._client is not None else _client
        # always the client's public acquire, as torch's expires calls it: a
        # subclass or an instrumented client sees every block
        deadline = _Deadline(time.time() + self.after)
        deadline.after = self.after
        deadline.accepted = True
        client.acquire(self.scope, deadline)
        if deadline.accepted:  # a block the agent never heard of is not active
            self._entered = client

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        client, self._entered = self._entered, None
        if client is not None:
            client.release(self.scope)


# ------------------------------------------------------------------ channel


def _channel(warn_stacklevel: int = 0) -> int:
    """The watchdog fd, configuring on first use; -1 when not enforced.

    A non-zero ``warn_stacklevel`` (counted from here) warns once when -1.
    """
    global _warned
    fd = _fd
    if fd is None:
        with _lock:
            if _fd is None:
                _configure()
            fd = _fd
        assert fd is not None
    if fd < 0 and warn_stacklevel and not _warned:
        _warned = True
        warnings.warn(
            f"aioproc.timer.expires is a no-op here: {_disabled_reason}",
            RuntimeWarning,
            stacklevel=warn_stacklevel,
        )
    return fd


def _configure() -> None:
    """Find the inherited fd and install the stack-dump handler (under _lock)."""
    global _fd, _disabled_reason
    value = os.environ.get(FD_ENV)
    reason = ""
    fd = -1
    if not value:
        reason = f"{FD_ENV} is not set (not running under an aioproc agent with watchdog=True)"
    else:
        try:
            fd = int(value)
            if fd < 0:
                raise ValueError
        except ValueError:
            reason = f"{FD_ENV}={value!r} is not a file descriptor"
            fd = -1
    if fd >= 0:
        try:
            st = os.fstat(fd)
        except OSError:
            reason = (
                f"{FD_ENV}={fd} is not open in this process "
                "(a descendant started with close_fds=True does not inherit it)"
            )
            fd = -1
        else:
            expected = os.environ.get(INODE_ENV)
            if (st.st_mode & 0o170000) != 0o140000:  # not S_ISSOCK
                reason = f"{FD_ENV}={fd} is not a socket in this process"
                fd = -1
            elif expected and expected != f"{st.st_dev}:{st.st_ino}":
                reason = f"{FD_ENV}={fd} is not the agent's watchdog socket in this process"
                fd = -1
    if fd >= 0:
        _install_dump_handler()
    _disabled_reason = reason
    _fd = fd


def _install_dump_handler() -> None:
    import faulthandler
    import signal

    try:
        err = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        err = 2
    chain = False
    if signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL:
        try:
            signal.signal(signal.SIGUSR2, _after_dump)
        except ValueError:
            pass  # not the main thread: dump only; the agent waits its bound
        else:
            chain = True
    # C-level: writes the dump even while the main thread is stuck in C code;
    # chain=True then runs _after_dump (the Python handler) once it can
    faulthandler.register(signal.SIGUSR2, file=err, all_threads=True, chain=chain)


def _after_dump(signum: int, frame: FrameType | None) -> None:
    # faulthandler's C handler has written the dump before this one runs
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()  # what is buffered would be lost to SIGKILL
        except Exception:
            pass
    fd = _fd
    if fd is not None and fd >= 0:
        _send(fd, {"op": "dumped", "pid": os.getpid()}, quiet=True)


def _send(fd: int, request: dict[str, Any], quiet: bool = False) -> bool:
    """Send one request without ever blocking the caller.

    The fast path is one ``send(MSG_DONTWAIT)``.  When the agent's loop is
    busy and the socket's queue is full, the request is queued here and a
    daemon thread delivers the queue, in order, as the agent catches up: a
    release must never be lost (the agent would then kill a worker whose
    block finished in time) nor overtake its acquire.  Acquires are dropped,
    with a warning, once ``MAX_PENDING`` requests wait: such a block is not
    enforced (fail open) rather than memory growing without bound.

    ``quiet`` (from the SIGUSR2 handler): never queue, lock or warn; a lost
    "dumped" only makes the agent wait out its bound.

    Returns:
        False when the request was not sent and will not be (dropped, or the
        channel failed and timers are no longer enforced).
    """
    import json

    data = json.dumps(request, separators=(",", ":")).encode()
    if quiet:
        try:
            _send_nowait(fd, data)
        except OSError:
            return False
        return True
    failure: OSError | None = None
    dropped = False
    with _queue_lock:  # (warnings are issued after it is released: a hook may re-enter)
        if not _pending:
            try:
                _send_nowait(fd, data)
                return True
            except BlockingIOError:
                pass
            except OSError as e:
                failure = e
        if failure is None:
            if request["op"] == "acquire" and len(_pending) >= MAX_PENDING:
                dropped = True
            else:
                _pending.append(data)
                _start_flusher(fd)
    if failure is not None:
        _channel_failed(failure)
        return False
    if dropped:
        _warn_dropped()
        return False
    return True


def _send_nowait(fd: int, data: bytes) -> None:
    import _socket  # the C core of socket: no enum, no selectors

    # one send on a SOCK_DGRAM socket: one whole datagram, atomic across
    # threads and forked children; a borrowed object, detached so it never
    # closes the fd
    sock = _socket.socket(fileno=fd)
    try:
        sock.send(data, _socket.MSG_DONTWAIT)
    finally:
        sock.detach()


def _start_flusher(fd: int) -> None:
    global _flushing
    if not _flushing:  # under _queue_lock
        _flushing = True
        _thread.start_new_thread(_flush, (fd,))


def _flush(fd: int) -> None:
    """Deliver the queued requests with blocking sends (this thread only waits)."""
    global _flushing
    while True:
        with _queue_lock:
            if not _pending:
                _flushing = False
                return
            data = _pending[0]  # stays queued while in flight: later requests queue behind
        try:
            os.write(fd, data)
        except OSError as e:
            with _queue_lock:
                _pending.clear()
                _flushing = False
            _channel_failed(e, stacklevel=1)
            return
        with _queue_lock:
            del _pending[0]


def _after_fork_in_child() -> None:
    # the parent's flusher delivers what was queued before the fork; a lock
    # held by another thread at fork time would never be released here
    global _queue_lock, _flushing
    _queue_lock = _thread.allocate_lock()
    _pending.clear()
    _flushing = False
    _scope_ids.clear()  # the parent's timers, not this process's


os.register_at_fork(after_in_child=_after_fork_in_child)


def _channel_failed(e: OSError, stacklevel: int = 4) -> None:
    """The watchdog channel is broken: warn once and stop enforcing."""
    global _fd, _disabled_reason, _warned
    with _lock:
        _fd = -1
        _disabled_reason = f"the watchdog channel failed ({e!r})"
        warn = not _warned
        _warned = True
    if warn:
        warnings.warn(
            f"aioproc.timer: {_disabled_reason}; timers are no longer enforced",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def _warn_dropped() -> None:
    global _dropped_warned
    if _dropped_warned:
        return
    _dropped_warned = True
    warnings.warn(
        f"aioproc.timer: the agent is not reading timer requests ({MAX_PENDING} are "
        "waiting); new expires() blocks are not enforced until it catches up",
        RuntimeWarning,
        stacklevel=4,
    )
