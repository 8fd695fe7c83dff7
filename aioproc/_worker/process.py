"""A persistent worker process: one interpreter answering requests.

A ``WorkerProcess`` is a function worker started in *serve* mode (see
``start``): it runs an optional initializer once, then answers CALL and
PING frames on its control channel until it is told to terminate.  It
reuses the group machinery: the same launch path (``_func.launch``: boot
code, channel, spawn in its own session, pidfd exit watcher, the
process-wide guardian) and graceful-then-forced stop.

Never hangs: every wait is also a wait on the worker's exit.  If the worker
dies mid-call the call raises ``BrokenWorkerError`` with the exit code or
signal and the last lines of its stderr, as soon as the exit is noticed.

Resources: a worker given ``limits=`` or ``cpus=`` is a group of one to
``_group.resources``: its own placement (cgroups or rlimits), joined and
pinned from this process before it runs user code, removed once the worker
is reaped, when its ``Usage`` is read.  A pool's workers are built the same
way, each with its own placement and, with ``capacity=``, its own slot.
"""

from __future__ import annotations

import asyncio
import collections
import marshal
import signal
from collections.abc import Callable, Sequence
from typing import Any

from .._base.loops import check_loop
from .._base.offloop import run_detached
from .._base.shield import shielded
from .._child import channel as _wire
from .._child import shm as _shm
from .._errors.failure import BrokenWorkerError
from .._func.boot import Definitions, encode_call, rebuild_exception
from .._group.resources import GroupResources
from .._proc.channel import Channel, frame
from .._proc.shutdown import release, stop_groups, warn_forced
from .._proc.spawn import Child
from ..results import Usage
from ..sinks import Sink
from .turn import Turn

__all__ = [
    "FILL_OFF_LOOP",
    "STDERR_TAIL",
    "TailSink",
    "Undelivered",
    "WorkerProcess",
    "exit_text",
    "fill_segments",
]

_get_running_loop = asyncio._get_running_loop  # None outside a loop; no exception to raise
_MARSHAL_BYTE = _wire.MARSHAL_BYTE

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


class WorkerProcess:
    """A persistent worker; built by ``open_worker`` (or a pool).

    Calls are serialised: one runs at a time, later ones wait their turn.
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
    ) -> None:
        self.name = name
        self._child = child
        self._channel = channel
        self._grace_period = grace_period
        self._tail = tail
        self._console = console
        self._lock = Turn()
        self._definitions = Definitions()  # the by-value functions this worker keeps
        self._reply: asyncio.Future[tuple[int, bytearray]] | None = None
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
            state = "busy" if self._lock.locked() else "idle"
        return f"<WorkerProcess {self.name} pid={self.pid} {state}>"

    @property
    def pid(self) -> int:
        return self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.returncode

    @property
    def busy(self) -> bool:
        """A call or ping is in flight (or waiting for the one before it)."""
        return self._lock.locked()

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
        reply = self._reply
        if reply is not None and not reply.done():
            reply.set_result((kind, body))

    def _on_channel_failed(self, failed: asyncio.Future[BrokenWorkerError]) -> None:
        # the worker broke the frame protocol: nothing it sends can be trusted
        # any more, so the call in flight fails now and the worker is killed
        error = BrokenWorkerError(f"worker {self.name} (pid {self.pid}): {failed.result()}")
        self._killed = True
        self._child.signal_group(signal.SIGKILL)
        reply = self._reply
        if reply is not None and not reply.done():
            reply.set_exception(error)

    async def _watch_exit(self) -> None:
        code = await self._child.watcher.future
        settled = self._child.output_settled()
        if settled:
            await asyncio.wait(settled, timeout=1.0)
        # a reply written just before exiting has been delivered by now
        reply = self._reply
        if reply is None or reply.done():
            return
        # a request the worker never read did not run (TERMINATE, sent by
        # aclose, may be the unread bytes instead: then say nothing)
        unread = not self._closed and await self._channel.dropped_by_peer()
        if reply.done():
            return
        if unread:
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

    def _send(self, kind: int, parts: list[bytes]) -> asyncio.Future[tuple[int, bytearray]]:
        """Write a request at once and return the future its reply resolves.

        The caller holds the lock, awaits the future, calls ``_abandon`` if
        that is cancelled and clears ``_reply`` however it ends.
        """
        self._check_usable()
        reply: asyncio.Future[tuple[int, bytearray]] = self._loop.create_future()
        self._reply = reply
        self._channel.send(kind, *parts)
        return reply

    def _abandon(self) -> None:
        # The worker is busy with a request nobody waits for: kill it
        # (like anyio's cancellable=True) rather than let it run on.
        self._killed = True
        self._child.signal_group(signal.SIGKILL)

    async def _request(self, kind: int, parts: list[bytes]) -> tuple[int, bytearray]:
        reply = self._send(kind, parts)
        try:
            return await reply
        except asyncio.CancelledError:
            self._abandon()
            raise
        finally:
            self._reply = None

    # ------------------------------------------------------------------- API

    async def ping(self) -> None:
        """Round trip to the worker; raises ``BrokenWorkerError`` if it died.

        Cancellation: as for :meth:`call`, a ping that was sent cannot be
        withdrawn: cancelling it kills the worker, and later calls raise
        ``BrokenWorkerError``.
        """
        check_loop(self._child.watcher.loop, self)
        async with self._lock:
            kind, _ = await self._request(_wire.PING, [])
            assert kind == _wire.PONG

    async def call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in the worker and return its value.

        Raises:
            Exception: whatever ``fn`` raised, rebuilt in the caller; its
                ``__cause__`` holds the worker's traceback.  The worker stays
                usable.
            BrokenWorkerError: the worker died during the call, or before
                it read the request (then ``fn`` did not run; the message
                says which).
            TypeError: ``fn`` or its arguments cannot be pickled.

        Cancellation: cancelling a call kills the worker (its process group),
        since the request cannot be withdrawn; later calls raise
        ``BrokenWorkerError`` (a pool replaces the worker).
        """
        if _get_running_loop() is not self._loop:
            check_loop(self._child.watcher.loop, self)
        # Encoded at each attempt: a pool may send a call twice, and the
        # shared-memory segments of large arguments are closed however it ends.
        segments: list[_shm.Segment] | None = (
            _shm.Deferred() if self._channel.fd_socket is not None else None
        )
        parts, cached = encode_call(fn, args, kwargs, segments)
        turn = self._lock
        place: asyncio.Future[None] | None = None
        queued = False
        if segments:
            # The copy may run off the loop: the call queues first, so calls
            # still reach the worker in the order they were made.
            place, queued = turn.join(), True
            try:
                if not await fill_segments(segments):
                    segments = None  # no memory for the memfds: the value travels in the frame
                    parts, cached = encode_call(fn, args, kwargs, None)
            except BaseException:
                turn.leave(place)
                raise
        # The hot path (``_request`` inlined): an idle worker's request is
        # written before anything suspends, the protocol resolves the reply
        # future as the frame is read, and this coroutine resumes in the next
        # loop iteration; no task, timeout scope or queue in between.
        defined = None
        try:
            if queued:
                await turn.wait(place)
            elif turn._held or turn._waiters:  # take_now, inlined
                await turn.take()
            else:
                turn._held = True
            try:
                # _send, inlined
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
                        before, defined = frame(_wire.DEFINE, definition), cached.fid
                reply: asyncio.Future[tuple[int, bytearray]] = self._loop.create_future()
                self._reply = reply
                if segments or before:
                    self._channel.send(_wire.CALL, *parts, segments=segments or (), before=before)
                else:
                    self._channel.send(_wire.CALL, *parts)
                try:
                    kind, body = await reply
                except asyncio.CancelledError:
                    self._abandon()
                    raise
                finally:
                    self._reply = None
                self.calls += 1
            finally:
                if turn._waiters:
                    turn.release()
                else:  # release, inlined
                    turn._held = False
        finally:
            if segments:
                for segment in segments:
                    segment.close()
        if kind == _wire.RESULT and body[0] == _MARSHAL_BYTE:
            return marshal.loads(memoryview(body)[1:])  # decode_value's usual case, inlined
        if kind == _wire.ERROR:
            if defined is not None:
                self._definitions.forget(defined)
            exc = rebuild_exception(body)
            if exc is None:
                raise RuntimeError(f"worker {self.name}: call failed (unreadable error report)")
            raise exc
        return _wire.decode_value(body)

    async def _call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``call`` with the arguments as the pool keeps them."""
        return await self.call(fn, *args, **kwargs)

    async def aclose(self) -> None:
        """Stop the worker: a terminate request, ``grace_period`` seconds, then SIGKILL.

        The worker is asked to exit over its control channel; one still
        running ``grace_period`` seconds later is SIGKILLed with its whole
        process group and named in a ``ForcedKillWarning``.  What it left in
        its group is stopped too.  Idempotent: a second call waits for the
        first, and when any call returns the worker is reaped and its
        placement and slot are given back.

        Cancellation: shielded and bounded by ``grace_period`` plus a few
        seconds (a second caller cancelled while it waits leaves the stop
        to the first).
        """
        check_loop(self._child.watcher.loop, self)
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
            self._channel.send(_wire.TERMINATE)
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
