"""Persistent worker processes: one interpreter answering requests (``open_worker``).

A ``WorkerProcess`` is a function worker started in *serve* mode: it runs an
optional ``init`` once, then answers CALL and PING frames on its control
channel until it is told to terminate.  It reuses the group machinery: the
same launch path (``_func.launch``: boot code, channel, spawn in its own session,
pidfd exit watcher, the process-wide guardian) and graceful-then-forced
shutdown.

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
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._base.checks import check_duration, check_env, check_preload, check_start_method
from ._base.loops import check_loop
from ._base.offloop import run_detached
from ._base.resource import OpenResource
from ._base.shield import shielded
from ._child import channel as _wire
from ._child import shm as _shm
from ._errors.failure import BrokenWorkerError
from ._func import template as _template
from ._func.boot import CallEncoder, Definitions, encode_call, init_frame, rebuild_exception
from ._func.launch import Frame, launch_function
from ._func.template import Template
from ._group.resources import (
    GroupResources,
    check_capacity,
    check_worker_cpus,
    check_worker_limits,
)
from ._limits.affinity import ROUND_ROBIN, allowed_cpus
from ._limits.capacity import Capacity
from ._limits.spec import Limits
from ._output.tee import TeeProtocol
from ._proc.channel import Channel, frame
from ._proc.shutdown import release, stop_groups, warn_forced
from ._proc.spawn import Child
from .results import Usage
from .sinks import ConsoleSink, Sink

__all__ = ["WorkerProcess", "open_worker"]

_get_running_loop = asyncio._get_running_loop  # None outside a loop; no exception to raise
_MARSHAL_BYTE = _wire.MARSHAL_BYTE

STDERR_TAIL = 20
"""Lines of a worker's stderr kept for ``BrokenWorkerError`` messages."""


class _Undelivered(BrokenWorkerError):
    """The worker died before it read the request: the call never ran.

    Raised by ``WorkerProcess`` calls as the ``BrokenWorkerError`` it is; a
    pool catches it to run the call on a fresh worker instead.
    """


class _TailSink(Sink):
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


class _Turn:
    """One request at a time, in arrival order (``asyncio.Lock``'s contract).

    Taken without a coroutine when free (``take_now``), the case of every
    call made one after the other; a waiter is handed the turn directly by
    ``release``, so nobody arriving meanwhile can overtake it.
    """

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self._held

    def take_now(self) -> bool:
        if self._held or self._waiters:
            return False
        self._held = True
        return True

    def join(self) -> asyncio.Future[None] | None:
        """Take the turn now (None), or queue for it and return the place held.

        The caller must then ``wait`` for the place, or ``leave`` it.
        """
        if self.take_now():
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def wait(self, waiter: asyncio.Future[None] | None) -> None:
        """Wait until the place ``join`` returned reaches the turn.

        Cancellation: the place is left as ``leave`` does.
        """
        if waiter is None:
            return
        try:
            await waiter
        except asyncio.CancelledError:
            self.leave(waiter)
            raise

    def leave(self, waiter: asyncio.Future[None] | None) -> None:
        """Give up a place ``join`` returned: pass the turn on if it was ours."""
        if waiter is None or (waiter.done() and not waiter.cancelled()):
            self.release()
        else:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass  # dropped by release() already

    async def take(self) -> None:
        """Wait for the turn.

        Cancellation: a waiter cancelled before its turn leaves the queue; one
        cancelled as the turn reached it passes the turn on.
        """
        await self.wait(self.join())

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the turn passes on: still held
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.take()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class WorkerProcess:
    """A persistent worker; built by ``open_worker`` (or a pool).

    Calls are serialised: one runs at a time, later ones wait their turn.
    """

    def __init__(
        self,
        name: str,
        child: Child,
        channel: Channel,
        shutdown_timeout: float,
        tail: _TailSink,
        console: Sink,
        resources: GroupResources | None = None,
    ) -> None:
        self.name = name
        self._child = child
        self._channel = channel
        self._shutdown_timeout = shutdown_timeout
        self._tail = tail
        self._console = console
        self._lock = _Turn()
        self._definitions = Definitions()  # the by-value functions this worker keeps
        self._reply: asyncio.Future[tuple[int, bytearray]] | None = None
        self._closed = False
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
            reply.set_exception(self._broken(code, "before it read this request", _Undelivered))
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
        how = _exit_text(code, self._oom_of(code))
        tail = "\n".join(f"    {line}" for line in self._tail.lines_seen)
        tail = f"; last lines of its stderr:\n{tail}" if tail else "; its stderr was empty"
        return error(f"worker {self.name} (pid {self.pid}) {how} {when}{tail}")

    def _check_usable(self) -> None:
        """Raise what says why no request can be sent now, if so."""
        if self._child.returncode is not None:
            code = self._child.returncode
            raise self._broken(code, "before this request (while idle)", _Undelivered)
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
        """Ask the worker to exit, wait ``shutdown_timeout``, then kill its group.

        A worker that needed SIGKILL is named in a ``ForcedKillWarning``.
        Idempotent.

        Cancellation: shielded and bounded by ``shutdown_timeout`` plus a
        few seconds.
        """
        check_loop(self._child.watcher.loop, self)
        if self._closed:
            return
        self._closed = True
        await shielded(self._shutdown())

    async def _shutdown(self) -> None:
        forced: list[Child] = []
        if self._child.returncode is None:
            self._channel.send(_wire.TERMINATE)
            done, _ = await asyncio.wait(
                {self._child.watcher.future}, timeout=self._shutdown_timeout
            )
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
            warn_forced(
                forced, signal.SIGKILL, self._shutdown_timeout, request="the terminate request"
            )


def _exit_text(code: int, oom: str | None) -> str:
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


async def _start_worker(
    name: str,
    init: Callable[..., Any] | None,
    init_args: tuple[Any, ...],
    init_timeout: float,
    shutdown_timeout: float,
    env: Mapping[str, str] | None,
    template: Template | None = None,
    resources: GroupResources | None = None,
) -> WorkerProcess:
    """Start one persistent worker: wait for its slot, launch, join, run ``init``.

    ``resources`` (a group of one, see ``_group.resources``) belong to the
    worker from here on: closed with it, or at once if the start fails.

    Cancellation: a cancelled start holds no slot, and kills and reaps the
    half-started worker (shielded) before its placement is removed.
    """
    resources = resources or GroupResources(name, 1, None, None)
    try:
        if init is not None and not callable(init):
            raise TypeError(f"init must be callable, got {init!r}")
        for what, value in (("init_timeout", init_timeout), ("shutdown_timeout", shutdown_timeout)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{what} must be a number >= 0, got {value!r}")
        if env is not None:
            for key, val in env.items():
                if not isinstance(key, str) or not isinstance(val, str):
                    raise TypeError(f"env must map str to str; got {key!r}: {val!r}")
        await resources.acquire()  # a pool's replacement waits here for its slot
        joins = resources.open()
        return await _launch_worker(
            name, init, init_args, init_timeout, shutdown_timeout, env, template, resources, joins
        )
    except BaseException:
        # a slot handed over by a pool goes back too; a launched worker
        # was reaped by _launch_worker before its placement goes
        await shielded(resources.aclose())
        raise


async def _launch_worker(
    name: str,
    init: Callable[..., Any] | None,
    init_args: tuple[Any, ...],
    init_timeout: float,
    shutdown_timeout: float,
    env: Mapping[str, str] | None,
    template: Template | None,
    resources: GroupResources,
    joins: Mapping[int, Callable[[int], None]],
) -> WorkerProcess:
    """``_start_worker`` once its slot is held and its placement open.

    Cancellation: the half-started worker is killed and reaped (shielded).
    """
    segments: list[_shm.Segment] | None = _shm.Deferred() if _shm.AVAILABLE else None
    init_parts = CallEncoder(init).encode(init_args, {}, segments) if init is not None else None
    if segments and not await fill_segments(segments):
        segments = None  # no memory for the memfds: the value travels in the frame
        init_parts = CallEncoder(init).encode(init_args, {}, None)
    full_env = {**os.environ, **(env or {})}
    tail = _TailSink(STDERR_TAIL)
    console = ConsoleSink()
    stderr_tee = TeeProtocol(None, 0, "stderr", f"[{name}]:", [console, tail])
    child: Child | None = None
    worker: WorkerProcess | None = None
    pending_init: asyncio.Future[tuple[int, bytearray]] | None = None

    def on_frame(kind: int, body: bytearray) -> None:
        if worker is not None:
            worker._on_frame(kind, body)
        elif pending_init is not None and not pending_init.done():
            pending_init.set_result((kind, body))

    frames: list[Frame] = [(_wire.INIT, [init_frame(serve=True, has_init=init_parts is not None)])]
    if init_parts is not None:
        pending_init = asyncio.get_running_loop().create_future()
        frames.append((_wire.CALL, init_parts))
    try:
        child = await launch_function(
            name,
            full_env,
            on_frame=on_frame,
            frames=frames,
            stdout=None,
            stderr=subprocess.PIPE,
            tee_err=stderr_tee,
            template=template,
            segments=segments or (),
            join=joins.get(0),
        )
        for segment in segments or ():
            segment.close()
        assert child.channel is not None
        if pending_init is not None:
            exited = child.watcher.future
            failed = child.channel.failed
            waits: set[asyncio.Future[Any]] = {pending_init, exited, failed}
            await asyncio.wait(
                waits,
                timeout=init_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if pending_init.done():
                kind, body = pending_init.result()
                if kind == _wire.ERROR:
                    exc = rebuild_exception(body)
                    raise exc if exc is not None else RuntimeError(f"init of {name} failed")
            elif failed.done():
                raise BrokenWorkerError(
                    f"worker {name} (pid {child.pid}) during init: {failed.result()}"
                )
            elif exited.done():
                await asyncio.wait(child.output_settled(), timeout=1.0)
                if pending_init.done() and pending_init.result()[0] == _wire.ERROR:
                    exc = rebuild_exception(pending_init.result()[1])
                    raise exc if exc is not None else RuntimeError(f"init of {name} failed")
                code = exited.result()
                how = _exit_text(code, resources.oom(0, child, code))
                raise BrokenWorkerError(f"worker {name} (pid {child.pid}) {how} during init")
            else:
                raise TimeoutError(
                    f"worker {name} (pid {child.pid}): init did not finish within "
                    f"init_timeout={init_timeout:g} s"
                )
        worker = WorkerProcess(
            name, child, child.channel, shutdown_timeout, tail, console, resources
        )
        child.channel.deliver_to(worker._on_frame)  # on_frame's forwarding, skipped
        return worker
    except BaseException:
        for segment in segments or ():
            segment.close()
        await shielded(_abandon(child))
        raise


async def _abandon(child: Child | None) -> None:
    """Kill and reap a worker that failed to start (nothing to be graceful about)."""
    children = [] if child is None else [child]
    await stop_groups(children, signal.SIGKILL, 0)
    # settles a guardian dismissed by a failed launch too
    await release(children, drain=1.0)


_counter = 0
_cpu_turn = 0  # open_worker(cpus="round-robin"): the next CPU of the allowed set


def open_worker(
    init: Callable[..., Any] | None = None,
    init_args: tuple[Any, ...] = (),
    init_timeout: float = 30,
    shutdown_timeout: float = 60,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    limits: Limits | None = None,
    cpus: Sequence[int] | str | None = None,
    capacity: Capacity | None = None,
) -> OpenResource[WorkerProcess]:
    """Start a persistent worker process (PyTorch's ``CheckpointProcess``, async).

    ``async with aioproc.open_worker(init=...) as w:`` starts it, runs
    ``init(*init_args)`` in it once (its return value is the worker state,
    read by called functions with ``aioproc.worker_state()``, which imports
    nothing heavy in the worker), and stops it
    when the block exits.  ``w = await aioproc.open_worker(...)`` also works;
    then call ``await w.aclose()``.

    Args:
        init: run once in the worker before any call.
        init_args: arguments for ``init``.
        init_timeout: seconds ``init`` may take (``TimeoutError`` beyond).
        shutdown_timeout: seconds the worker gets to exit after the
            terminate request before its process group is SIGKILLed.
        env: extra environment variables for the worker.
        name: used in messages and as the stderr prefix ``[name]:``.
        start_method: ``"spawn"`` or ``"forkserver"`` (forked from the
            template for ``preload``; see ``start_processes``).
        preload: modules the forkserver template imports first.
        limits: resource limits for the worker and every process it starts
            (``aioproc.Limits``; its own cgroup, else rlimits: see
            ``start_processes``), removed once the worker is reaped.  Killed
            by the kernel's OOM killer, the worker fails the call in flight
            with a ``BrokenWorkerError`` that says so; past an rlimit, the
            allocation fails instead (the call raises ``MemoryError``).
        cpus: the CPUs the worker runs on (Linux): a list of CPU ids,
            ``"numa:<node>"`` (that node's CPUs, from
            ``/sys/devices/system/node/node<N>/cpulist``, among the allowed
            ones) or ``"round-robin"`` (one CPU of this process's allowed
            set, ``os.sched_getaffinity(0)``, the next one for each worker
            opened).  Set from this process before the worker runs ``init``.
        capacity: a process budget (``aioproc.Capacity``) shared with
            groups and pools: the worker waits for one slot before it starts
            and holds it until it is reaped.

    Raises:
        TypeError, ValueError: a bad argument, before anything starts (a
            CPU not in the allowed set, an empty list, a NUMA node this
            machine does not list: the message names the missing file).
        TimeoutError: ``init`` took longer than ``init_timeout``.
        Exception: whatever ``init`` raised, with the worker's traceback.
        BrokenWorkerError: the worker died during ``init``.

    Cancellation: a cancelled start (also one waiting for its ``capacity``
    slot) kills the half-started worker, removes its placement and holds no
    slot.
    """
    check_duration("init_timeout", init_timeout)
    check_duration("shutdown_timeout", shutdown_timeout)
    if env is not None:
        check_env("env", env)
    global _counter, _cpu_turn
    _counter += 1
    name = name or f"worker{_counter}"
    init_args = tuple(init_args)
    check_start_method(start_method)
    names = check_preload(start_method, preload)
    check_worker_limits(limits)
    if cpus == ROUND_ROBIN:
        allowed = allowed_cpus()
        cpus = [allowed[_cpu_turn % len(allowed)]]
        _cpu_turn += 1
    cpu_sets = check_worker_cpus(cpus, 1)
    check_capacity(capacity, 1)

    def resources() -> GroupResources:  # a placement per start: it lives and dies with it
        return GroupResources(name, 1, limits, capacity, None if cpu_sets is None else cpu_sets[0])

    async def start() -> WorkerProcess:
        if start_method == "spawn":
            return await _start_worker(
                name, init, init_args, init_timeout, shutdown_timeout, env, None, resources()
            )
        template = await _template.acquire(names)
        try:
            return await _start_worker(
                name, init, init_args, init_timeout, shutdown_timeout, env, template, resources()
            )
        finally:
            # the forked worker does not need the template any more
            await shielded(_template.release(template))

    async def close(worker: WorkerProcess, exc: BaseException | None) -> None:
        await worker.aclose()

    return OpenResource(start, close, "open_worker(...)")
