"""A persistent worker process: one interpreter answering requests.

A ``WorkerProcess`` is a function worker started in *serve* mode (see
``start``): it runs an optional initializer once, then answers CALL and
PING frames on its control channel until it is told to terminate.  It
reuses the group machinery: the same launch path (``_func.launch``: boot
code, channel, spawn in its own session, pidfd exit watcher, the
process-wide guardian) and graceful-then-forced stop.

Requests carry ids (``_child.channel``): every call in flight has a reply
future of its own, resolved by the answer that ends with its id.  Coroutine
calls take one of ``max_concurrency`` slots and run concurrently in the
worker; sync calls and pings also take the turn, one at a time, as the
worker runs them one at a time.  A cancelled coroutine call is withdrawn
(CANCEL) and waited for until its coroutine ended; a cancelled sync call,
which cannot be, kills the worker.

Never hangs: every wait is also a wait on the worker's exit.  If the worker
dies mid-call every call in flight raises ``BrokenWorkerError`` with the
exit code or signal and the last lines of its stderr, as soon as the exit
is noticed.

Resources: a worker given ``limits=`` or ``cpus=`` is a group of one to
``_group.resources``: its own placement (cgroups or rlimits), joined and
pinned from this process before it runs user code, removed once the worker
is reaped, when its ``Usage`` is read.  A pool's workers are built the same
way, each with its own placement and, with ``capacity=``, its own slot.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import marshal
import signal
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from .._base.checks import check_duration
from .._base.loops import check_loop
from .._base.offloop import run_detached
from .._base.resource import handle_closed
from .._base.shield import shielded
from .._child import aio as _aio
from .._child import shm as _shm
from .._child.channel import (
    CALL,
    CANCEL,
    DEFINE,
    ERROR,
    ID_SIZE,
    MARSHAL_BYTE,
    PING,
    PONG,
    RESULT,
    TERMINATE,
    decode_value,
    kind_name,
)
from .._errors.failure import BrokenWorkerError, ForcedKillWarning
from .._func.boot import Definitions, encode_call, rebuild_exception
from .._group.resources import GroupResources
from .._proc.channel import Channel, frame
from .._proc.fence import fenced_out
from .._proc.shutdown import release, stop_groups, warn_forced
from .._proc.spawn import Child
from ..results import Usage
from ..sinks import Sink
from .turn import Slots, Turn

__all__ = [
    "DEFAULT_MAX_CONCURRENCY",
    "FILL_OFF_LOOP",
    "STDERR_TAIL",
    "Sent",
    "TailSink",
    "Undelivered",
    "WorkerProcess",
    "coroutine_call",
    "describe",
    "exit_text",
    "fill_segments",
]

_get_running_loop = asyncio._get_running_loop  # None outside a loop; no exception to raise
_ID = struct.Struct(">Q")  # a call id (``ID_SIZE`` bytes)
assert _ID.size == ID_SIZE
_pack_id = _ID.pack
_unpack_id = _ID.unpack_from

DEFAULT_MAX_CONCURRENCY = 100
"""Calls one persistent worker has in flight at most, by default (``max_concurrency``)."""

STDERR_TAIL = 20
"""Lines of a worker's stderr kept for ``BrokenWorkerError`` messages."""


class Undelivered(BrokenWorkerError):
    """The worker died before it read the request: the call never ran.

    Raised by ``WorkerProcess`` calls as the ``BrokenWorkerError`` it is; a
    pool catches it to run the call on a fresh worker instead.
    """


class TailSink(Sink):
    """Keeps the last lines of a stream (for error messages)."""

    def __init__(self, maxlen: int) -> None:
        self.lines_seen: collections.deque[str] = collections.deque(maxlen=maxlen)

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.lines_seen.extend(lines)

    def text(self, rank: int, stream: str, prefix: str, text: str) -> None:
        keep = self.lines_seen.maxlen
        assert keep is not None
        # only the last lines are split off: a flood costs no object per line
        self.lines_seen.extend(text.rsplit("\n", keep)[-keep:])


class Sent:
    """How far one call got: its request went out (for the messages of timeouts)."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = False


def coroutine_call(fn: Callable[..., Any]) -> bool:
    """Whether a call of ``fn`` is a coroutine call: run concurrently, cancelled in the worker.

    ``inspect.iscoroutinefunction``: an ``async def`` function, also through
    ``functools.partial`` and bound methods.  Anything else is scheduled and
    cancelled as a sync call, even if what it returns is a coroutine (which
    the worker then runs on its loop all the same).
    """
    fn_type = type(fn)
    if fn_type is _FunctionType:  # the usual cases first, without attribute lookups
        return bool(fn.__code__.co_flags & _CO_COROUTINE) or (
            _MARKED and _aio.is_coroutine_function(fn)
        )
    if fn_type in _NEVER_COROUTINES:
        return _MARKED and _aio.is_coroutine_function(fn)
    return _aio.is_coroutine_function(fn)


_FunctionType = type(coroutine_call)
_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE
_NEVER_COROUTINES = frozenset({type, type(len), type(str.join), type(str.__add__)})
"""Classes, builtins and slot methods: never coroutine functions, unless marked so."""
_MARKED = sys.version_info >= (3, 12)  # inspect.markcoroutinefunction can mark any callable


class WorkerProcess:
    """A persistent worker; built by ``open_worker`` (or a pool).

    Coroutine calls run concurrently in the worker, at most
    ``max_concurrency`` calls in flight; sync calls (and pings) take turns:
    one at a time, later ones wait their turn.
    """

    def __init__(
        self,
        name: str,
        child: Child,
        channel: Channel,
        grace_period: float,
        tail: TailSink,
        console: Sink,
        resources: GroupResources | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ) -> None:
        self.name = name
        self._child = child
        self._channel = channel
        self._grace_period = grace_period
        self._tail = tail
        self._console = console
        self._turn = Turn()  # sync calls and pings: one at a time
        self._slots = Slots(max_concurrency)  # calls in flight
        self._definitions = Definitions()  # the by-value functions this worker keeps
        # the reply future of every request in flight, by its id (0 was the initializer's)
        self._replies: dict[int, asyncio.Future[tuple[int, bytearray]]] = {}
        self._next_id = 1
        self._last_sent = 0  # id of the last request written (0: the last frame was none)
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # the one stop, once asked
        self._killed = False
        self._resources = resources or GroupResources(name, 1, None, None)
        self._oom: str | None = None  # why the OOM killer ended it, once its exit is seen
        self._usage: Usage | None = None
        self.calls = 0
        self._loop = asyncio.get_running_loop()
        self._exit_task = self._loop.create_task(self._watch_exit())
        channel.failed.add_done_callback(self._on_channel_failed)

    def __repr__(self) -> str:
        if self.returncode is not None:
            state = f"exited {self.returncode}"
        elif self._closed:
            state = "closing"
        else:
            state = "busy" if self.busy else "idle"
        return f"<WorkerProcess {self.name} pid={self.pid} {state}>"

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    @property
    def busy(self) -> bool:
        """A call or ping is in flight (or waiting for its turn or a slot)."""
        return bool(self._replies) or self._turn.locked() or self._slots.used > 0

    @property
    def max_concurrency(self) -> int:
        """Calls this worker has in flight at most; more wait their turn in the supervisor."""
        return self._slots.limit

    @property
    def usage(self) -> Usage | None:
        """What the worker used (CPU time, peak RSS), once it exited and was reaped.

        ``None`` while it runs, and until ``aclose()`` reaped it (a pool
        reaps a dead worker when it replaces it).  With ``limits=`` the
        ``tree_*`` figures are its cgroup's: the worker and every process
        it started.
        """
        return self._usage

    @property
    def alive(self) -> bool:
        """Running and usable (False once killed, even before its exit is noticed)."""
        return self._child.returncode is None and not self._closed and not self._killed

    # ------------------------------------------------------------- internals

    def _on_frame(self, kind: int, body: bytearray) -> None:
        # every answer ends with the id of its request
        try:
            cid = _unpack_id(body, -ID_SIZE)[0]
        except struct.error:
            self._broke(f"worker sent a {kind_name(kind)} frame without a call id")
            return
        reply = self._replies.pop(cid, None)
        if reply is not None and not reply.done():
            reply.set_result((kind, body))

    def _on_channel_failed(self, failed: asyncio.Future[BrokenWorkerError]) -> None:
        # the worker broke the frame protocol: nothing it sends can be trusted
        # any more, so the calls in flight fail now and the worker is killed
        self._broke(failed.result())

    def _broke(self, problem: object) -> None:
        error = BrokenWorkerError(f"worker {self.name} (pid {self.pid}): {problem}")
        self._killed = True
        self._child.signal_group(signal.SIGKILL)
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            if not reply.done():
                reply.set_exception(error)

    async def _watch_exit(self) -> None:
        code = await self._child.watcher.future
        settled = self._child.output_settled()
        if settled:
            await asyncio.wait(settled, timeout=1.0)
        # a reply written just before exiting has been delivered by now
        if not any(not reply.done() for reply in self._replies.values()):
            return
        # Frames are read in order, so a request the worker never read was the
        # last one written (TERMINATE, sent by aclose, may be the unread
        # bytes instead: then say nothing).
        unread = not self._closed and await self._channel.dropped_by_peer()
        replies, self._replies = self._replies, {}
        for cid, reply in replies.items():
            if reply.done():
                continue
            if unread and cid == self._last_sent:
                reply.set_exception(self._broken(code, "before it read this request", Undelivered))
            else:
                reply.set_exception(self._broken(code, "during a call"))

    def _oom_of(self, code: int) -> str | None:
        """Why the kernel's OOM killer ended the worker (exit ``code``), or None; asked once."""
        if self._oom is None and not self._killed:
            self._oom = self._resources.oom(0, self._child, code)
        return self._oom

    def _broken(
        self, code: int, when: str, error: type[BrokenWorkerError] = BrokenWorkerError
    ) -> BrokenWorkerError:
        how = exit_text(code, self._oom_of(code))
        tail = "\n".join(f"    {line}" for line in self._tail.lines_seen)
        tail = f"; last lines of its stderr:\n{tail}" if tail else "; its stderr was empty"
        return error(f"worker {self.name} (pid {self.pid}) {how} {when}{tail}")

    def _check_usable(self) -> None:
        """Raise what says why no request can be sent now, if so."""
        if self._child.returncode is not None:
            code = self._child.returncode
            raise self._broken(code, "before this request (while idle)", Undelivered)
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        failed = self._channel.failed
        if failed.done():
            raise BrokenWorkerError(f"worker {self.name} (pid {self.pid}): {failed.result()}")

    def _abandon(self) -> None:
        # The worker is busy with a request nobody waits for: kill it
        # (like anyio's cancellable=True) rather than let it run on.
        self._killed = True
        self._child.signal_group(signal.SIGKILL)

    async def _withdraw(self, cid: int) -> None:
        """Cancel the coroutine of call ``cid`` in the worker and wait until it ended.

        The worker answers a cancelled call once its coroutine is done (its
        ``finally`` blocks ran); that answer is dropped.  One that has not
        ended within ``grace_period`` gets the worker killed, as a stop
        would, with a ``ForcedKillWarning``.

        Cancellation: shielded; bounded by ``grace_period``.
        """
        answer: asyncio.Future[tuple[int, bytearray]] = self._loop.create_future()
        self._replies[cid] = answer  # resolved by the answer, the exit or a broken channel
        self._channel.send(CANCEL, cid.to_bytes(ID_SIZE, "big"))
        self._last_sent = 0
        try:
            await shielded(self._await_withdrawn(answer))
        finally:
            if self._replies.get(cid) is answer:
                del self._replies[cid]

    async def _await_withdrawn(self, answer: asyncio.Future[tuple[int, bytearray]]) -> None:
        done, _ = await asyncio.wait({answer}, timeout=self._grace_period)
        if done:
            answer.exception()  # retrieved: an exit or a broken channel may have answered
            return
        self._abandon()
        warnings.warn(
            f"worker {self.name} (pid {self.pid}): a cancelled coroutine call did not end "
            f"within grace_period={self._grace_period:g} s; the worker was killed with SIGKILL "
            "(its other calls fail with BrokenWorkerError)",
            ForcedKillWarning,
            stacklevel=2,
        )

    # ------------------------------------------------------------------- API

    async def ping(self) -> None:
        """Round trip to the worker; raises ``BrokenWorkerError`` if it died.

        A ping waits for the sync call in flight, if any (it takes its turn
        as a sync call does); coroutine calls do not hold it up.

        Cancellation: as for a sync :meth:`call`, a ping that was sent cannot
        be withdrawn: cancelling it kills the worker, and later calls raise
        ``BrokenWorkerError``.
        """
        check_loop(self._child.watcher.loop, self)
        async with self._turn:
            self._check_usable()
            cid = self._next_id
            self._next_id = cid + 1
            reply: asyncio.Future[tuple[int, bytearray]] = self._loop.create_future()
            self._replies[cid] = reply
            self._last_sent = cid
            self._channel.send(PING, cid.to_bytes(ID_SIZE, "big"))
            try:
                kind, _ = await reply
            except asyncio.CancelledError:
                self._abandon()
                raise
            finally:
                self._replies.pop(cid, None)
            assert kind == PONG

    async def call(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` in the worker and return its value.

        A coroutine function (``async def``) runs on the worker's event loop
        (asyncio's, or uvloop's with ``worker_loop="uvloop"``), started at its
        first coroutine call; calls in flight run concurrently there, at most
        ``max_concurrency`` at once (more wait here, in the order they were
        made).  A sync function runs on the same thread, one call at a time,
        between two iterations of that loop: it holds up the I/O of the
        coroutine calls only while it runs.

        ``timeout`` belongs to this method, not to ``fn`` (as for
        ``WorkerPool.submit``): to give ``fn`` a keyword named ``timeout``,
        bind it with ``functools.partial``.

        Args:
            fn: a picklable callable (lambdas and closures too).
            *args: positional arguments for ``fn``.
            timeout: seconds from this call until the value is back, waiting
                for a turn included; ``None`` (the default): no limit.
            **kwargs: keyword arguments for ``fn``.

        Raises:
            Exception: whatever ``fn`` raised, rebuilt in the caller; its
                ``__cause__`` holds the worker's traceback.  The worker stays
                usable.
            BrokenWorkerError: the worker died during the call, or before
                it read the request (then ``fn`` did not run; the message
                says which).  A worker that dies fails every call in flight.
            TimeoutError: ``timeout`` passed; the call was cancelled as below.
            RuntimeError: the worker was closed while the coroutine ran
                (``aclose()`` cancels the coroutine calls in flight), or the
                coroutine was cancelled inside the worker.
            TypeError: ``fn`` or its arguments cannot be pickled.
            ValueError: ``timeout`` is not a positive number of seconds.

        Cancellation: a coroutine call is cancelled in the worker: its
        coroutine gets ``CancelledError`` (its ``finally`` blocks run), and
        the cancellation of this call completes once it ended; the worker
        stays usable.  One that does not end within ``grace_period`` gets the
        worker killed (a ``ForcedKillWarning``).  A sync call cannot be
        withdrawn once sent: cancelling it kills the worker (its process
        group), and its other calls and later ones raise
        ``BrokenWorkerError`` (a pool replaces the worker).  A call still
        waiting for its turn or a slot is never sent.
        """
        if _get_running_loop() is not self._loop:
            check_loop(self._child.watcher.loop, self)
        if timeout is not None:
            return await self._call_within(timeout, fn, args, kwargs)
        return await self._call(fn, args, kwargs, None)

    async def _call_within(
        self, timeout: float, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``call(..., timeout=...)``."""
        limit = check_duration("call(timeout=...)", timeout, allow_negative=True)
        if limit <= 0:
            raise ValueError(f"call(timeout=...) must be > 0 seconds, got {timeout!r}")
        sent = Sent()
        with anyio.move_on_after(limit) as scope:
            return await self._call(fn, args, kwargs, sent)
        assert scope.cancelled_caught
        what = f"call {describe(fn)} on worker {self.name} timed out after timeout={limit:g} s"
        if not sent.sent:
            raise TimeoutError(f"{what} waiting for its turn; it never ran")
        if self.alive:
            raise TimeoutError(f"{what}; its coroutine was cancelled in the worker, which goes on")
        raise TimeoutError(f"{what}; the worker (pid {self.pid}) running it was killed")

    async def _call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sent: Sent | None,
    ) -> Any:
        """``call`` with its arguments as the pool keeps them; ``sent`` learns if it went out."""
        # coroutine_call, inlined
        fn_type = type(fn)
        if fn_type is _FunctionType:
            is_async = fn.__code__.co_flags & _CO_COROUTINE or (_MARKED and coroutine_call(fn))
        elif fn_type in _NEVER_COROUTINES:
            is_async = _MARKED and coroutine_call(fn)
        else:
            is_async = coroutine_call(fn)
        # Encoded at each attempt: a pool may send a call twice, and the
        # shared-memory segments of large arguments are closed however it ends.
        segments: list[_shm.Segment] | None = (
            _shm.Deferred() if self._channel.fd_socket is not None else None
        )
        parts, cached = encode_call(fn, args, kwargs, segments)
        turn = self._turn
        slots = self._slots
        place: asyncio.Future[None] | None = None
        queued = False
        if segments:
            # The copy may run off the loop: a sync call queues first, so sync
            # calls still reach the worker in the order they were made.
            if not is_async:
                place, queued = turn.join(), True
            try:
                if not await fill_segments(segments):
                    segments = None  # no memory for the memfds: the value travels in the frame
                    parts, cached = encode_call(fn, args, kwargs, None)
            except BaseException:
                if queued:
                    turn.leave(place)
                raise
        # The hot path (the waits inlined): an idle worker's request is
        # written before anything suspends, the protocol resolves the reply
        # future as the frame is read, and this coroutine resumes in the next
        # loop iteration; no task, timeout scope or queue in between.
        defined = None
        has_turn = False
        try:
            if is_async:
                pass
            elif queued:
                await turn.wait(place)
                has_turn = True
            elif turn._held or turn._waiters:  # take_now, inlined
                await turn.take()
                has_turn = True
            else:
                turn._held = has_turn = True
            if slots.used < slots.limit and not slots._waiters:  # take_now, inlined
                slots.used += 1
            else:
                await slots.take()
            try:
                if (
                    self._closed
                    or self._child.returncode is not None
                    or self._channel.failed.done()
                ):
                    self._check_usable()
                before = b""
                if cached is not None:
                    # decided as the frame goes out, in the order frames go out
                    definition = self._definitions.use(cached)
                    if definition is not None:
                        before, defined = frame(DEFINE, definition), cached.fid
                cid = self._next_id
                self._next_id = cid + 1
                reply: asyncio.Future[tuple[int, bytearray]] = self._loop.create_future()
                self._replies[cid] = reply
                self._last_sent = cid
                ident = _pack_id(cid)
                if segments or before:
                    self._channel.send(CALL, *parts, ident, segments=segments or (), before=before)
                else:
                    self._channel.send(CALL, *parts, ident)
                if sent is not None:
                    sent.sent = True
                try:
                    kind, body = await reply
                except asyncio.CancelledError:
                    # the caller's cancellation cancelled ``reply`` too: whether the
                    # worker answered is whether the id is still waiting
                    if self._replies.get(cid) is reply:
                        if is_async:
                            await self._withdraw(cid)
                        else:
                            del self._replies[cid]
                            self._abandon()
                    raise
                self.calls += 1
            finally:
                if slots._waiters:
                    slots.release()
                else:  # release, inlined
                    slots.used -= 1
        finally:
            if has_turn:
                if turn._waiters:
                    turn.release()
                else:  # release, inlined
                    turn._held = False
            if segments:
                for segment in segments:
                    segment.close()
        if kind == RESULT and body[0] == MARSHAL_BYTE:
            # decode_value's usual case, inlined
            return marshal.loads(memoryview(body)[1:-ID_SIZE])
        if kind == ERROR:
            if defined is not None:
                self._definitions.forget(defined)
            exc = rebuild_exception(body[:-ID_SIZE])
            if exc is None:
                raise RuntimeError(f"worker {self.name}: call failed (unreadable error report)")
            if isinstance(exc, asyncio.CancelledError):
                # never a cancellation of the caller's task: the caller was not cancelled
                raise RuntimeError(self._cancelled_inside(fn)) from exc.__cause__
            raise exc
        return decode_value(body, ID_SIZE)

    def _cancelled_inside(self, fn: Callable[..., Any]) -> str:
        who = f"worker {self.name} (pid {self.pid})"
        if self._closed:
            return f"{who} was closed while call {describe(fn)} ran: its coroutine was cancelled"
        return f"call {describe(fn)} was cancelled inside {who}, not by its caller"

    async def aclose(self) -> None:
        """Stop the worker: a terminate request, ``grace_period`` seconds, then SIGKILL.

        The worker is asked to exit over its control channel; one still
        running ``grace_period`` seconds later is SIGKILLed with its whole
        process group and named in a ``ForcedKillWarning``.  A worker running
        coroutine calls cancels them first and waits for them (their
        ``finally`` blocks run within the grace period; the calls raise
        ``RuntimeError``); a sync call in flight runs to its end first.
        A stopped worker (SIGSTOP) is continued with the request.
        What it left in its group is stopped too.  Idempotent: a second call
        waits for the first, and when any call returns the worker is reaped
        and its placement and slot are given back.

        Cancellation: shielded and bounded by ``grace_period`` plus a few
        seconds (a second caller cancelled while it waits leaves the stop
        to the first).
        """
        check_loop(self._child.watcher.loop, self)
        handle_closed(self)
        if self._closing is not None:
            await asyncio.wait({self._closing})
            return
        self._closed = True
        self._closing = asyncio.ensure_future(self._shutdown())
        await shielded(self._closing)

    close = aclose
    """torch's ``CheckpointProcess.close()``, awaited: an alias of ``aclose``."""

    async def _shutdown(self) -> None:
        forced: list[Child] = []
        if self._child.returncode is None:
            self._channel.send(TERMINATE)
            # a stopped worker (a debugger, a suspended job) must run to read
            # the request: continued as systemd continues what it stops, unless
            # its lease fence expired (then its world is stale: never continued)
            if self._child.pgid not in fenced_out():
                self._child.signal_group(signal.SIGCONT)
            done, _ = await asyncio.wait({self._child.watcher.future}, timeout=self._grace_period)
            if not done:
                forced = await stop_groups([self._child], signal.SIGKILL, 0)
            else:
                await stop_groups([self._child], signal.SIGTERM, 0.0)  # descendants only
        else:
            await stop_groups([self._child], signal.SIGKILL, 0)  # descendants only
        await self._exit_task
        try:
            await release([self._child], drain=1.0, sinks=[self._console, self._tail])
        finally:
            # reaped now: its usage is final, and its cgroups and slot go back
            self._usage = self._resources.usage({0: self._child}).get(0)
            await self._resources.aclose()
        if forced:
            warn_forced(forced, signal.SIGKILL, self._grace_period, request="the terminate request")


def describe(fn: Callable[..., Any]) -> str:
    """``fn`` as a message names it: ``module.qualname``, through ``functools.partial``."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({describe(fn.func)}, ...)"
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if isinstance(qualname, str):
        return f"{module}.{qualname}" if isinstance(module, str) else qualname
    return repr(fn)


def exit_text(code: int, oom: str | None) -> str:
    """How a worker ended, for messages: ``"was killed by SIGSEGV"``, the OOM killer's text."""
    if oom is not None and not oom.startswith("a process"):
        # the placement's text starts "killed by the kernel's OOM killer" where
        # the kernel counted the kill; else it names the limit's hits
        return f"was {oom}" if oom.startswith("killed by") else f"was killed by SIGKILL ({oom})"
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    # "a process in its cgroup was killed by the kernel's OOM killer": its child
    return f"{how} ({oom})" if oom is not None else how


FILL_OFF_LOOP = 4 << 20
"""Bytes of large values from which they are copied into shared memory on a
thread: below, the copy takes about a millisecond, less than a thread costs."""


async def fill_segments(segments: Sequence[_shm.Segment]) -> bool:
    """Copy a call's large values into their memfds, off the loop when they are big.

    Returns False (the segments closed) when the memfds cannot be filled
    (no memory for them): the caller encodes the value into the frame.

    Cancellation: the copy runs to completion on its thread and the
    segments are closed after it; the caller must not use them again.
    """

    def fill() -> None:
        for segment in segments:
            segment.fill()

    def close() -> None:
        for segment in segments:
            segment.close()

    try:
        if sum(segment.size for segment in segments) < FILL_OFF_LOOP:
            fill()
        else:
            await run_detached(fill, close)
    except OSError:
        close()
        return False
    return True
