"""Turn POSIX signals into an exception in the task that asked for them.

``translate_signals()`` is the asyncio form of torchelastic's signal handling:
inside ``async with translate_signals():`` a SIGTERM, SIGINT, SIGHUP or SIGQUIT
makes the guarded ``await`` raise ``SignalException``, so the supervisor can
stop its workers with that same signal and the exception reaches the caller::

    async with translate_signals():
        async with start_processes(...) as pc:
            await pc.wait()

The host's handlers
-------------------

``translate_signals`` lives inside someone else's application, so it never
takes a signal away from a handler the application installed, and leaves
every handler exactly as it found it:

* A handler the host set with ``loop.add_signal_handler`` keeps its place in
  the loop's registry (``translate_signals`` never adds or removes loop
  handlers) and runs for every signal, inside the block and after it.
* A handler the host set with ``signal.signal`` is called too: inside the
  block the signal both raises ``SignalException`` in the guarded task and
  reaches the host's handler, once, right after the delivery to the task is
  scheduled; after the block the handler is back in place.  If it raises, its
  exception propagates as it would without ``translate_signals``.
* Python's own defaults are what the translation replaces while the block
  runs: ``SIG_DFL`` (which would kill the process), ``SIG_IGN``,
  ``signal.default_int_handler`` (``KeyboardInterrupt`` wherever the code
  happens to be) and ``asyncio.Runner``'s SIGINT handler, its stand-in for
  ``default_int_handler``.  A second Ctrl-C therefore cannot interrupt the
  cleanup the first one started.
* A handler the host installs while the block runs wins: on exit
  ``translate_signals`` puts the previous handler back only if its own is
  still in place.

It works on any event loop in the main thread, whether or not the loop
implements ``add_signal_handler``.  Off the main thread, where Python cannot
deliver signals, it warns and changes nothing.
"""

# How it works
# ------------
#
# Python runs a Python-level signal handler in the main thread, between two
# bytecodes of whatever happens to be running, often the event loop's own
# bookkeeping; asyncio must not be touched from there.  So, as asyncio.Runner
# does for SIGINT, ``_Slot.python_handler`` (installed with ``signal.signal``)
# only counts the arrival in ``arrived`` and schedules
# ``_Slot.deliver_arrival`` with ``loop.call_soon_threadsafe``, whose
# self-pipe write wakes the loop; the loop runs it as an ordinary callback,
# where cancelling a task is safe.  The
# loop's own registry is never touched: the C-level handler writes each
# signal to the wakeup fd of a loop that has one (asyncio once a loop handler
# was added, uvloop always in the main thread), so the host's loop handlers
# run as before; their Python-level part (asyncio's no-op, uvloop's
# ``__sighandler``) is called like any host handler.  A loop asleep in
# epoll_wait is woken because the kernel gives a process-directed signal to
# the main thread unless that thread blocks it (only ``_uninstall`` does, and
# the thread is busy then).  A signal aimed at another thread with
# ``pthread_kill`` waits, on an asyncio loop with no wakeup fd, until the
# loop wakes for another reason, as asyncio.Runner's SIGINT does.
#
# Cancellation is the only way to interrupt an ``await`` from outside;
# ``__aexit__`` turns the resulting ``CancelledError`` into
# ``SignalException`` and calls ``Task.uncancel()`` so that
# ``Task.cancelling()``, which ``asyncio.timeout`` and ``TaskGroup`` count on,
# is what it was before the signal.
#
# The gap: a signal that arrives while the body runs its last synchronous
# lines has its delivery still queued when the body ends.  ``__aexit__``
# takes an arrival that the loop has not delivered yet, and
# ``deliver_arrival`` ignores a slot whose arrival was taken, so each arrival
# is delivered once.  Arrivals are counted, so that ``on_signal`` hears of two
# quick Ctrl-Cs even when the loop delivers them together (the first signal
# wins the translation anyway).
#
# Signal dispositions are process-wide, so each signal has one ``_Slot``
# shared by every active ``translate_signals`` (nested, or in concurrent
# tasks): it installs its handler when the first one enters and restores the
# previous handler when the last one leaves.  A signal goes to every active
# receiver of it, newest first, and to at most one receiver per task, which
# keeps its first signal until it exits.
#
# While the last receiver leaves, the signals are blocked in this thread:
# entering ``_take_arrivals`` runs any handler tripped before, the previous
# handler is restored, and a signal arriving from then on goes to it (CPython
# drops a tripped signal whose handler became SIG_DFL before it ran, which is
# why nothing may be left tripped when restoring).

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any, TypeAlias

__all__ = ["SignalException", "pending_signal", "translate_signals"]

_Handler: TypeAlias = "Callable[[int, FrameType | None], Any] | int | signal.Handlers | None"

_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class SignalException(Exception):
    """A signal reached a process inside ``translate_signals()``.

    The same name and constructor as torchelastic's
    ``torch.distributed.elastic.multiprocessing.api.SignalException``.

    Attributes:
        sigval: The signal that was received.
    """

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as cls(*args); args holds only the message.
        return (type(self), (str(self), self.sigval), self.__dict__)


def _is_default(handler: _Handler) -> bool:
    """Whether ``handler`` is Python's default behaviour, not the host's handler."""
    if not callable(handler) or handler is signal.default_int_handler:
        return True
    # asyncio.Runner installs functools.partial(runner._on_sigint, ...) in
    # place of default_int_handler, only while that is the SIGINT handler.
    runner = getattr(asyncio, "Runner", None)  # 3.11+
    return (
        runner is not None
        and isinstance(handler, functools.partial)
        and isinstance(getattr(handler.func, "__self__", None), runner)
    )


def _is_loop_handler(handler: _Handler) -> bool:
    """Whether ``handler`` is the Python-level part of a loop's signal handler."""
    # uvloop installs a bound method of the loop, asyncio a module function.
    return isinstance(getattr(handler, "__self__", None), asyncio.AbstractEventLoop) or (
        getattr(handler, "__module__", None) == "asyncio.unix_events"
    )


class _Slot:
    """The process-wide state of one translated signal (see the top comment)."""

    __slots__ = ("arrived", "chain", "handler", "loop", "previous", "receivers")

    def __init__(self, loop: asyncio.AbstractEventLoop, previous: _Handler) -> None:
        self.loop = loop
        self.previous = previous
        self.chain = None if _is_default(previous) else previous
        self.receivers: list[translate_signals] = []
        self.arrived = 0  # arrivals not delivered yet
        # One bound method, so that signal.getsignal() returns this very
        # object while it is installed.
        self.handler: Callable[[int, FrameType | None], None] = self.python_handler

    def python_handler(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes, perhaps inside the loop's bookkeeping:
        # only set a flag and queue the delivery (a deque append, then a
        # self-pipe write that wakes the loop), then call the host's handler.
        sig = signal.Signals(signum)
        if self.loop.is_closed():
            # The loop was closed under a block that never exited (its task
            # was abandoned): nobody is left to deliver to, so give this
            # signal, and the next ones, back to what was there before.
            if _slots.get(sig) is self:
                del _slots[sig]
            self.restore(sig)
            signal.raise_signal(sig)
            return
        self.arrived += 1
        self.loop.call_soon_threadsafe(self.deliver_arrival, sig)
        chain: Any = self.chain
        if chain is not None:
            chain(signum, frame)

    def deliver_arrival(self, sig: signal.Signals) -> None:
        arrivals, self.arrived = self.arrived, 0
        for _ in range(arrivals):
            for receiver in reversed(tuple(self.receivers)):
                receiver._deliver(sig)

    def install(self, sig: signal.Signals) -> None:
        signal.signal(sig, self.handler)
        signal.siginterrupt(sig, False)  # SA_RESTART, as both loops set it

    def restore(self, sig: signal.Signals) -> None:
        if signal.getsignal(sig) is not self.handler:
            return  # the host installed another handler meanwhile: it stays
        signal.signal(sig, self.previous)
        if _is_loop_handler(self.previous):
            signal.siginterrupt(sig, False)  # the loop had set SA_RESTART


_slots: dict[signal.Signals, _Slot] = {}

# The signal each task is being cancelled for: set when a signal is delivered,
# removed by the ``translate_signals`` that set it when it exits.
_pending: weakref.WeakKeyDictionary[asyncio.Task[Any], signal.Signals] = weakref.WeakKeyDictionary()


def _validate(signals: Iterable[int]) -> tuple[signal.Signals, ...]:
    if isinstance(signals, int):
        raise TypeError(
            f"signals must be an iterable of signal numbers, not the single signal "
            f"{signals!r}; pass ({signals!r},)"
        )
    result: list[signal.Signals] = []
    for value in signals:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"signals must be signal numbers, got {value!r}")
        try:
            sig = signal.Signals(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not a valid signal number (expected a signal.Signals member)"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"{sig.name} ({int(sig)}) cannot be caught, so it cannot be translated"
            )
        if sig == signal.SIGCHLD:
            # uvloop refuses it outright; asyncio would lose child exits.
            raise ValueError(
                f"{sig.name} ({int(sig)}) cannot be translated: the event loop uses it "
                "to track child processes"
            )
        if sig not in result:
            result.append(sig)
    return tuple(result)


def _is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation, or a group of nothing but cancellations."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    if sys.version_info >= (3, 11):
        if isinstance(exc, BaseExceptionGroup):  # noqa: F821 (a builtin on 3.11+)
            return all(_is_cancellation(e) for e in exc.exceptions)
    else:  # pragma: no cover - the backport's groups exist only if it is loaded
        backport = sys.modules.get("exceptiongroup")
        if backport is not None and isinstance(exc, backport.BaseExceptionGroup):
            group: Any = exc
            return all(_is_cancellation(e) for e in group.exceptions)
    return False


def _install(receiver: translate_signals, loop: asyncio.AbstractEventLoop) -> None:
    # Check every signal before installing anything.
    for sig in receiver.signals:
        if sig not in _slots and signal.getsignal(sig) is None:
            raise RuntimeError(
                f"{sig.name} has a handler installed outside Python "
                "(signal.getsignal() is None): translate_signals() could not put it "
                f"back, so it does not replace it; leave {sig.name} out of signals"
            )
    try:
        for sig in receiver.signals:
            slot = _slots.get(sig)
            if slot is not None and slot.loop is loop:
                slot.receivers.append(receiver)
                continue
            if slot is None:
                previous = signal.getsignal(sig)
            else:
                # Left by a context on a loop that is not running any more
                # (one loop at a time runs in the main thread): keep its
                # record of the original handler, forget the rest.
                previous = slot.previous
                del _slots[sig]
            slot = _Slot(loop, previous)
            _slots[sig] = slot
            slot.receivers.append(receiver)
            slot.install(sig)
    except BaseException:
        _uninstall(receiver)
        raise


def _uninstall(receiver: translate_signals) -> None:
    mine = [
        sig
        for sig in receiver.signals
        if sig in _slots and any(r is receiver for r in _slots[sig].receivers)
    ]
    if not mine:
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, mine)
    try:
        _take_arrivals(mine)
        for sig in mine:
            slot = _slots[sig]
            if len(slot.receivers) == 1:
                del _slots[sig]
                slot.restore(sig)
                # Tripped in another thread after _take_arrivals, before the
                # restore (this one blocks them): still ours.
                slot.deliver_arrival(sig)
            slot.receivers = [r for r in slot.receivers if r is not receiver]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _take_arrivals(sigs: list[signal.Signals]) -> None:
    # A separate function on purpose: entering it runs any Python-level
    # handler tripped before the signals were blocked.
    for sig in sigs:
        _slots[sig].deliver_arrival(sig)


class translate_signals:
    """Raise ``SignalException`` in this task when the process gets a signal.

    An async context manager.  While it is active, each of ``signals`` that
    reaches the process cancels the task that entered it (the cancellation's
    message names the signal), and leaving the context raises
    ``SignalException(f"Process {pid} got signal: {sigval}", sigval)`` in place
    of the ``CancelledError``, with the traceback of the ``await`` the signal
    interrupted.  ``pending_signal()`` tells code running in the task during
    that cancellation which signal it is for.

    A signal still raises ``SignalException`` if the body finished anyway: it
    caught the cancellation, or the signal arrived after its last ``await``.
    If the body leaves with another exception, for instance one raised by
    cleanup that was interrupted, that exception propagates unchanged.

    The first signal wins: later ones, while its cancellation is in flight,
    do not interrupt the task again, so they cannot interrupt the cleanup
    the first one started (``on_signal`` still hears of them).  The same
    goes for nested contexts in one task; contexts in concurrent tasks each
    get the signal.

    The host application's handlers are left in place: one set with
    ``loop.add_signal_handler`` or ``signal.signal`` runs too, for each
    signal, inside the block and after it; on exit the handlers are exactly
    what they were (see the module docstring for the details, and for the
    defaults such as SIGINT's ``KeyboardInterrupt`` that the translation
    replaces while it is active).

    It works on any event loop running in the main thread: it never asks the
    loop to register signal handlers.  Python delivers signals only to the
    main thread; entered in another thread it issues a ``RuntimeWarning``
    and does nothing else.

    Args:
        signals: The signals to translate.  Defaults to SIGTERM, SIGINT,
            SIGHUP and SIGQUIT.
        on_signal: Called with each of ``signals`` this context receives,
            the first one and every later one, as a plain callback on the
            event loop (never inside the signal handler; an exception it
            raises goes to the loop's exception handler).  A supervisor
            stops its workers gracefully on the first signal and can, say,
            kill them at once on the second.

    Raises:
        TypeError: ``signals`` is a single number, or holds a non-integer.
        ValueError: A signal is not a valid signal number, or cannot be
            caught (SIGKILL, SIGSTOP), or belongs to the event loop (SIGCHLD).
            Raised before anything is installed.
        RuntimeError: On entering, if a signal has a handler installed
            outside Python (``signal.getsignal()`` returns ``None``), which
            could not be put back.  Nothing is installed.

    Example::

        try:
            async with translate_signals():
                await serve()
        except SignalException as e:
            sys.exit(128 + e.sigval)
    """

    def __init__(
        self,
        signals: Iterable[int] = _DEFAULT_SIGNALS,
        *,
        on_signal: Callable[[signal.Signals], object] | None = None,
    ) -> None:
        if on_signal is not None and not callable(on_signal):
            raise TypeError(f"on_signal must be callable, got {on_signal!r}")
        self._signals = _validate(signals)
        self._on_signal = on_signal
        self._task: asyncio.Task[Any] | None = None
        self._state = "new"  # -> "active" or "inert" (off the main thread) -> "exited"
        self._received: signal.Signals | None = None
        self._cancelled = False

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals this context translates."""
        return self._signals

    @property
    def received(self) -> signal.Signals | None:
        """The signal this context received, or ``None``."""
        return self._received

    def __repr__(self) -> str:
        names = ",".join(sig.name for sig in self._signals) or "no signals"
        state = f"got {self._received.name}" if self._received is not None else self._state
        return f"<translate_signals {names} {state}>"

    async def __aenter__(self) -> translate_signals:
        if self._state != "new":
            raise RuntimeError(f"{self!r} cannot be entered twice")
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("translate_signals() must be entered in an asyncio task")
        if threading.current_thread() is not threading.main_thread():
            self._state = "inert"
            warnings.warn(
                "translate_signals(): signals cannot be translated off the main thread "
                f"(this is {threading.current_thread().name!r}); the body runs with the "
                "process's signal handlers unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return self
        self._task = task
        _install(self, loop)
        self._state = "active"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        active = self._state == "active"
        self._state = "exited"
        if not active:
            return
        try:
            _uninstall(self)
        finally:
            sig = self._received
            if sig is not None and self._task is not None:
                _pending.pop(self._task, None)
                if self._cancelled and sys.version_info >= (3, 11):
                    self._task.uncancel()
        if sig is None or (exc is not None and not _is_cancellation(exc)):
            return
        error = SignalException(f"Process {os.getpid()} got signal: {sig}", sig)
        if exc is None:
            raise error
        # Point at the await the signal interrupted; the cancellation is only
        # the vehicle, and stays reachable as __context__.
        raise error.with_traceback(tb) from None

    def _deliver(self, sig: signal.Signals) -> None:
        """Take ``sig`` unless this task already has one in flight; tell ``on_signal``."""
        task = self._task
        if task is None or task.done():
            return
        if self._on_signal is not None:
            # after the cancellation below, whatever the order of the calls
            task.get_loop().call_soon(self._on_signal, sig)
        if task in _pending:
            return
        _pending[task] = sig
        self._received = sig
        # From __aexit__ (an arrival taken at exit) the task is the one
        # running: it is leaving anyway, there is nothing to interrupt.
        if task is not asyncio.current_task():
            task.cancel(f"got signal {sig.name}")
            self._cancelled = True


def pending_signal(task: asyncio.Task[Any] | None = None) -> signal.Signals | None:
    """The signal ``task`` is being cancelled for by ``translate_signals()``.

    A supervisor that sees ``CancelledError`` calls it to stop its workers
    with the same signal before the exception propagates.  Signals are
    recorded per task: only code running in the task that entered
    ``translate_signals()`` (or given that task) sees them.

    Args:
        task: The task to ask about; defaults to the current task.

    Returns:
        The signal, from its delivery until the ``translate_signals()`` that
        received it exits; ``None`` otherwise, and outside an event loop.
    """
    if task is None:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running event loop
            return None
        if task is None:
            return None
    return _pending.get(task)
