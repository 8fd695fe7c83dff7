"""Run a worker's coroutine on an event loop of its own, stopped by cancellation.

Standard library only; asyncio (and uvloop, for a worker that asks for its
loop) is imported by the functions that run a coroutine, never by importing
this module, and ``is_coroutine_function`` imports nothing at all: a worker
tells a coroutine function from a sync one without paying for asyncio.

``run(coro, loop=...)`` is ``asyncio.run`` with two differences a supervised
worker needs.  The loop is chosen by name ("asyncio" or "uvloop") or made by
a factory, whatever the event loop policy says.  And a stop signal (SIGTERM,
SIGINT, SIGHUP: what a supervisor or torch's agent sends to stop a worker)
cancels the main task instead of ending the process at once, so its
``finally:`` blocks and ``async with`` exits run; once the task has finished
(and the loop has been cleaned up and closed, as ``asyncio.run`` does), ``run``
raises ``Stopped``, and the caller ends the process with ``die_by`` so that
its exit status is death by that signal, exactly what the same signal does to
a sync worker.  Further stop signals while the task unwinds are ignored: a
second SIGTERM (or Ctrl-C) must not cut the cleanup short, and the exit
status stays the first signal's.  A coroutine that ignores the cancellation
keeps running: the supervisor's SIGKILL at the end of its grace period ends
it, as it ends a sync worker that ignores SIGTERM.

Used by the group workers' boot code (``_child.boot``), the persistent
workers' serve loop and the pytest plugin's ranks, so a coroutine runs the
same way in each.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C core: no enum import
import os
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Awaitable, Callable, Coroutine, Iterable
    from types import TracebackType
    from typing import Any, NoReturn, TypeVar

    _T = TypeVar("_T")
    LoopKind = str | Callable[[], asyncio.AbstractEventLoop]

__all__ = [
    "LOOPS",
    "STOP_SIGNALS",
    "Stopped",
    "die_by",
    "eager_starter",
    "check_loop",
    "close_loop",
    "is_coroutine",
    "is_coroutine_function",
    "new_event_loop",
    "run",
    "user_traceback",
]

LOOPS = ("asyncio", "uvloop")
"""The event loops a worker can ask for by name."""

STOP_SIGNALS: tuple[int, ...] = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)
"""The signals that stop a worker: SIGTERM (aioproc's and torch's stop), and the
SIGINT and SIGHUP that torch's agent translates into a stop as well."""

_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE, without importing inspect


class _Kinds:
    def method(self) -> None: ...


_FUNCTION: Any = type(_Kinds.method)
_METHOD: Any = type(_Kinds().method)


class Stopped(BaseException):
    """The main coroutine was cancelled by a stop signal and has finished.

    Raised by ``run`` once the loop is closed; ``signum`` is the first stop
    signal.  An exception the coroutine raised while it unwound, instead of
    the ``CancelledError``, is its ``__cause__`` (reported, never the exit
    status: the worker was stopped).  A ``BaseException`` so that no
    ``except Exception`` of the caller takes it for the worker's failure.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by signal {self.signum}"


def is_coroutine_function(fn: Any) -> bool:
    """``inspect.iscoroutinefunction(fn)``, without importing ``inspect``.

    Methods and ``functools.partial`` objects are looked through, as
    ``inspect`` does.  A callable object whose ``__call__`` is ``async``
    counts as a sync function here (as in ``inspect``): what it returns, a
    coroutine, is what tells.
    """
    if getattr(fn, "_is_coroutine_marker", None) is not None:
        # inspect.markcoroutinefunction (3.12+) set it: inspect is imported already
        import inspect

        return inspect.iscoroutinefunction(fn)
    functools = sys.modules.get("functools")  # a partial exists only if it is loaded
    while True:
        if type(fn) is _METHOD:
            fn = fn.__func__
        elif functools is not None and isinstance(fn, functools.partial):
            fn = fn.func
        else:
            break
    return type(fn) is _FUNCTION and bool(fn.__code__.co_flags & _CO_COROUTINE)


def is_coroutine(value: Any) -> bool:
    """True if ``value`` is a coroutine object (what calling an ``async def`` returns)."""
    return type(value).__name__ == "coroutine" and type(value).__module__ == "builtins"


def check_loop(loop: Any) -> None:
    """Raise ``ValueError`` unless ``loop`` names one of ``LOOPS`` or is a factory."""
    if not callable(loop) and loop not in LOOPS:
        raise ValueError(f"worker_loop must be one of {', '.join(map(repr, LOOPS))}, got {loop!r}")


def new_event_loop(loop: LoopKind = "asyncio") -> asyncio.AbstractEventLoop:
    """A new event loop: asyncio's own, uvloop's, or what the factory ``loop`` makes.

    "asyncio" is asyncio's selector loop whatever the event loop policy
    says (a worker asked for asyncio by name); "uvloop" imports uvloop.

    Raises:
        ValueError: ``loop`` is not a name of ``LOOPS`` or a callable.
        ImportError: "uvloop", and uvloop is not installed.
    """
    check_loop(loop)
    if loop == "asyncio":
        import asyncio

        return asyncio.SelectorEventLoop()
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError as e:
            raise ImportError(
                f"worker_loop='uvloop', but uvloop cannot be imported here ({e}); "
                "install it (pip install 'aioproc[uvloop]') or use worker_loop='asyncio'"
            ) from e
        made: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return made
    assert callable(loop)
    return loop()


class _Stop:
    """The first stop signal, and the cancellation of the main task it causes."""

    def __init__(self) -> None:
        self.signum = 0
        self.task: asyncio.Future[Any] | None = None

    def __call__(self, signum: int) -> None:
        if self.signum:
            return  # the task is unwinding already: see the module docstring
        self.signum = signum
        if self.task is not None and not self.task.done():
            self.task.cancel()


def run(
    main: Awaitable[_T],
    *,
    loop: LoopKind = "asyncio",
    stop_signals: Iterable[int] = STOP_SIGNALS,
) -> _T:
    """Run ``main`` to completion on a new event loop, as ``asyncio.run`` does.

    The loop is made by ``new_event_loop(loop)``, is this thread's current
    loop while it runs (``asyncio.get_event_loop()`` finds it, and
    ``asyncio.get_running_loop()`` inside), and is closed before ``run``
    returns or raises: tasks still pending when ``main`` finishes are
    cancelled and awaited, then async generators and the default executor
    are shut down.  ``stop_signals`` (which must be empty outside the main
    thread) cancel ``main``'s task while it runs (see the module
    docstring); the handlers there were before are put back at the end.

    Args:
        main: The coroutine (or other awaitable) to run.
        loop: "asyncio", "uvloop" or a factory returning a new loop.
        stop_signals: The signals that cancel ``main``.

    Returns:
        What ``main`` returned.

    Raises:
        Stopped: a stop signal came; ``main`` has finished.
        BaseException: what ``main`` raised; past the frames of this
            module, its traceback is the awaitable's own (``user_traceback``
            drops the head).
        ValueError, ImportError: see ``new_event_loop``; ``main`` was
            closed unrun.
    """
    try:
        new = new_event_loop(loop)
    except BaseException:
        _close_unrun(main)
        raise
    import asyncio

    stop = _Stop()
    saved: dict[int, Any] = {}
    task: asyncio.Future[_T] | None = None
    error: BaseException | None = None
    try:
        asyncio.set_event_loop(new)
        for signum in stop_signals:
            saved[signum] = _signal.getsignal(signum)
            new.add_signal_handler(signum, stop, signum)
        task = asyncio.ensure_future(main, loop=new)
        stop.task = task
        try:
            value = new.run_until_complete(task)
        except BaseException as e:
            if not task.done():
                # interrupted from outside the task (a KeyboardInterrupt where
                # SIGINT is not a stop signal): the task is cancelled below
                raise
            # kept from here: a task gives its exception's traceback only once
            error = e
    finally:
        stop.task = None
        try:
            if task is None:
                _close_unrun(main)
            _cancel_all_tasks(new)
            new.run_until_complete(new.shutdown_asyncgens())
            new.run_until_complete(new.shutdown_default_executor())
        finally:
            try:
                for signum in saved:
                    new.remove_signal_handler(signum)
                asyncio.set_event_loop(None)
                new.close()
            finally:
                for signum, handler in saved.items():
                    if handler is not None:
                        _signal.signal(signum, handler)
    if stop.signum:
        raise Stopped(stop.signum) from (
            None if isinstance(error, asyncio.CancelledError) else error
        )
    if error is not None:
        raise error
    return value


def _close_unrun(main: Any) -> None:
    """Close ``main`` (a coroutine never run): no "never awaited" warning for it."""
    close = getattr(main, "close", None)
    if close is not None:
        close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await the tasks left on ``loop`` (``asyncio.runners``' own)."""
    import asyncio

    to_cancel = asyncio.all_tasks(loop)
    if not to_cancel:
        return
    for task in to_cancel:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*to_cancel, return_exceptions=True))
    for task in to_cancel:
        if task.cancelled():
            continue
        if task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception during the worker's event loop shutdown",
                    "exception": task.exception(),
                    "task": task,
                }
            )


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """End ``loop`` as ``run`` (and ``asyncio.run``) end theirs, for a loop run by hand.

    The tasks left on it are cancelled and awaited, async generators and the
    default executor are shut down, and it stops being this thread's current
    loop and is closed (also when one of those steps raises).
    """
    import asyncio

    try:
        _cancel_all_tasks(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def eager_starter(
    loop: asyncio.AbstractEventLoop,
) -> Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]:
    """A function making tasks of ``loop`` whose first step runs at once where Python can.

    Python 3.12's eager tasks: the first step runs as the task is made, so
    a coroutine that returns without waiting needs no loop iteration.
    Before 3.12, on asyncio's own loop, the same is had from a new task: its
    first step is the handle it has just put last in the loop's ready
    queue, which is taken back and run there and then (what the loop's next
    iteration would have run, at the cost of an ``epoll_wait`` and a pass
    of its ``_run_once``).  On uvloop's loop before 3.12 the task starts in
    the next iteration.  A task factory set on the loop (also later) makes
    the tasks; from 3.12 they start as that factory starts them.  Call the
    function from a callback of the running ``loop``, outside any task; a
    task that is ``done()`` when it returns ran its coroutine to the end.

    The task is made by its class, not ``loop.create_task``: a coroutine
    call that returns at once costs a fifth less in a worker without that
    method's checks and frames.
    """
    task_class: Any = sys.modules["asyncio"].Task  # imported, as the loop is
    task_factory = loop.get_task_factory
    if _EAGER_TASKS:

        def start(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
            if task_factory() is None:
                return task_class(coro, loop=loop, eager_start=True)  # type: ignore[no-any-return]
            return loop.create_task(coro)

        return start
    ready = getattr(loop, "_ready", None)
    if ready is None:
        return loop.create_task

    def start_now(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        factory = task_factory()
        task: asyncio.Task[Any] = (
            task_class(coro, loop=loop) if factory is None else loop.create_task(coro)
        )
        # only the handle of this task's step: a task factory may have queued others
        if ready and getattr(ready[-1]._callback, "__self__", None) is task:
            step = ready.pop()
            # the handle's _run() without its frame: a task's step handles
            # every exception but the ones _run() lets through as well
            step._context.run(step._callback, *step._args)
        return task

    return start_now


_EAGER_TASKS = sys.version_info >= (3, 12)


_RUNNERS = ("aioproc._child.", "asyncio.", "uvloop")


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame of the user's on: the runner's frames dropped.

    The frames of this module, the boot code and asyncio's (or uvloop's)
    machinery that a traceback starts with when an exception leaves a
    task are cut, so a worker's report starts in its own coroutine, as a
    sync worker's starts in its function.
    """
    head = tb
    while head is not None and str(head.tb_frame.f_globals.get("__name__")).startswith(_RUNNERS):
        head = head.tb_next
    return tb if head is None else head


def die_by(signum: int) -> NoReturn:
    """End this process by ``signum``'s default action (death by that signal).

    The standard streams are flushed first (what the cancelled coroutine
    printed while it unwound reaches the logs); nothing else runs, as
    nothing runs when a sync worker dies of the signal.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    _signal.signal(signum, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # not reached: the signal's default action ends the process
