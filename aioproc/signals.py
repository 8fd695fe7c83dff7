"""Turn POSIX signals into an exception in the task that asked for them.

``translate_signals()`` is the asyncio form of torchelastic's signal handling:
inside ``async with translate_signals():`` a SIGTERM, SIGINT, SIGHUP or SIGQUIT
makes the guarded ``await`` raise ``SignalException``, so the supervisor can
stop its workers with that same signal and the exception reaches the caller::

    async with translate_signals():
        async with start_processes(...) as pc:
            await pc.wait()
"""

# How it works
# ------------
#
# Python runs a Python-level signal handler in the main thread, between two
# bytecodes of whatever happens to be running, often the event loop's own
# bookkeeping; asyncio must not be touched from there.  So we register with
# ``loop.add_signal_handler``: the C-level handler writes the signal number
# to the loop's wakeup fd, the loop wakes up and runs ``_dispatch`` as an
# ordinary callback, where cancelling a task is safe.  Cancellation is the
# only way to interrupt an ``await`` from outside; ``__aexit__`` turns the
# resulting ``CancelledError`` into ``SignalException`` and calls
# ``Task.uncancel()`` so that ``Task.cancelling()``, which ``asyncio.timeout``
# and ``TaskGroup`` count on, is what it was before the signal.
#
# The gap: a signal that arrives while the body runs its last synchronous
# lines sits unread in the wakeup fd when the body ends, and removing the
# loop's handler would drop it without a trace.  So the Python-level handler
# that the loop installs is wrapped by ``_Slot.python_handler``, which only
# sets ``arrived`` and calls the loop's own.  ``__aexit__`` takes an arrival
# that the loop has not dispatched yet, and ``_dispatch`` ignores a slot whose
# arrival was taken, so each arrival is delivered once.  ``_dispatch`` always
# finds the flag set: CPython trips a signal before writing its wakeup byte,
# and runs tripped Python-level handlers on entering any Python function, the
# loop's callback included (uvloop even calls PyErr_CheckSignals first).
#
# Signal dispositions are process-wide, so each signal has one ``_Slot``
# shared by every active ``translate_signals`` (nested, or in concurrent
# tasks): it installs the loop's handler when the first one enters and
# restores the previous Python-level handler when the last one leaves.  A
# signal goes to every active receiver of it, newest first, and to at most
# one receiver per task, which keeps its first signal until it exits.
#
# ``remove_signal_handler`` resets the disposition to SIG_DFL (or
# ``default_int_handler``) before we put the previous handler back; the
# signals are blocked in this thread meanwhile, so one arriving then goes to
# the restored handler instead of killing the process.

from __future__ import annotations

import asyncio
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


class _Slot:
    """The process-wide state of one translated signal (see the top comment)."""

    __slots__ = ("arrived", "loop", "loop_handler", "previous", "receivers")

    def __init__(self, loop: asyncio.AbstractEventLoop, previous: _Handler) -> None:
        self.loop = loop
        self.previous = previous
        self.loop_handler: _Handler = None
        self.receivers: list[translate_signals] = []
        self.arrived = False

    def python_handler(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes, perhaps inside the loop: only set a flag,
        # then let the loop's own handler do its part (uvloop notes the signal).
        self.arrived = True
        if callable(self.loop_handler):
            self.loop_handler(signum, frame)

    def deliver_arrival(self, sig: signal.Signals) -> None:
        if not self.arrived:
            return
        self.arrived = False
        for receiver in reversed(tuple(self.receivers)):
            receiver._deliver(sig)


_slots: dict[signal.Signals, _Slot] = {}

# The signal each task is being cancelled for: set when a signal is delivered,
# removed by the ``translate_signals`` that set it when it exits.
_pending: weakref.WeakKeyDictionary[asyncio.Task[Any], signal.Signals] = weakref.WeakKeyDictionary()


def _dispatch(sig: signal.Signals) -> None:
    """The loop's callback for ``sig``."""
    slot = _slots.get(sig)
    if slot is not None:
        slot.deliver_arrival(sig)


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
            loop.add_signal_handler(sig, _dispatch, sig)
            _slots[sig] = slot
            slot.receivers.append(receiver)
            slot.loop_handler = signal.getsignal(sig)
            signal.signal(sig, slot.python_handler)
            signal.siginterrupt(sig, False)  # SA_RESTART, as both loops set it
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
            slot.receivers = [r for r in slot.receivers if r is not receiver]
            if not slot.receivers:
                del _slots[sig]
                if not slot.loop.is_closed():
                    slot.loop.remove_signal_handler(sig)
                if slot.previous is not None:
                    signal.signal(sig, slot.previous)
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
    are ignored, so they cannot interrupt the cleanup the first one started.
    The same goes for nested contexts in one task; contexts in concurrent
    tasks each get the signal.

    On exit the loop's handlers are removed and the Python-level handlers
    installed before are restored.  Do not mix with your own
    ``loop.add_signal_handler`` for the same signals: leaving removes them.

    Python delivers signals only to the main thread; entered in another
    thread it issues a ``RuntimeWarning`` and does nothing else.

    Args:
        signals: The signals to translate.  Defaults to SIGTERM, SIGINT,
            SIGHUP and SIGQUIT.

    Raises:
        TypeError: ``signals`` is a single number, or holds a non-integer.
        ValueError: A signal is not a valid signal number, or cannot be
            caught (SIGKILL, SIGSTOP), or belongs to the event loop (SIGCHLD).
            Raised before anything is installed.

    Example::

        try:
            async with translate_signals():
                await serve()
        except SignalException as e:
            sys.exit(128 + e.sigval)
    """

    def __init__(self, signals: Iterable[int] = _DEFAULT_SIGNALS) -> None:
        self._signals = _validate(signals)
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
        """Take ``sig`` unless this task already has one in flight."""
        task = self._task
        if task is None or task.done() or task in _pending:
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
