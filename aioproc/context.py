"""The supervisor of one worker group: ``PContext`` and ``start_processes``.

A ``PContext`` owns its work in ONE supervisor task and the anyio task group
inside it: the launch of every rank, one watcher per worker, the stop after
a first failure, and the final shutdown.  ``start()`` creates the supervisor
and waits until every rank is launched; ``close()`` (from any task, any
number of times) asks it to stop and waits until it has finished; the
``await`` and ``async with`` forms of ``start_processes`` are thin wrappers.

A watcher awaits its worker's exit (a pidfd, not polling), then the bytes the
worker wrote before exiting (``_drain``), and records the outcome.  The first
failure makes the supervisor stop every other worker (all-or-nothing); the
group's result is final when every rank is done.  ``close()`` stops whatever
still runs, gracefully then by force (``_shutdown``), during a launch too
(ranks not launched yet are reported as never started), drains and closes the
pipes, reaps the leaders (kept as zombies until then, so a recycled pid is
never signalled) and lets the guardian forget their groups.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import string
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import IO, Any, TypeAlias

import anyio
import anyio.abc

from . import _lifeline, _wire
from ._boot import CallEncoder, init_frame, rebuild_exception
from ._cm import OpenResource
from ._launch import launch_function
from ._output import TeeProtocol
from ._shield import shielded
from ._shutdown import stop_groups, warn_forced
from ._spawn import Child, spawn
from ._validate import START_METHODS as START_METHODS
from ._validate import check_duration, check_start
from ._validate import check_executable as _check_executable
from ._validate import check_filters as _check_filters
from ._validate import check_signal as _validate_signal
from ._validate import validate_group as _validate
from .errors import ProcessFailure
from .logs import DefaultLogsSpecs, LogsDest, LogsSpecs
from .results import DEFAULT_GRACE_PERIOD, RunProcsResult, WorkerEvent
from .signals import SignalException, pending_signal
from .sinks import CallbackSink, ConsoleSink, FileSink, Sink, _FilteredFileSink, close_sinks

__all__ = ["PContext", "RunProcsResult", "WorkerEvent", "start_processes"]

logger = logging.getLogger("aioproc")

SinkLike: TypeAlias = Sink | Callable[..., Any] | str | IO[str]
"""A sink, a callable taking an ``OutputLine``, a file path or an open text file."""

NEVER_STARTED = 127
"""Exit code of a rank the group was closed before launching (pid -1): what a
shell reports for a command it could not run; never a signal."""
_DRAIN_TIMEOUT = 2.0
"""Bound on waiting for EOF of a killed group's pipes (a setsid'd descendant may hold them)."""


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class _AlreadyStartedError(RuntimeError, ValueError):
    """Raised by a second ``start()`` (a ValueError too, as torch raises)."""


class PContext:
    """A group of worker processes supervised all-or-nothing.

    Built by ``start_processes``; a callable entrypoint gives function
    workers, a ``str`` gives binary workers.  Attributes mirror torch's
    ``PContext``: ``name, entrypoint, args, envs, nprocs, stdouts, stderrs,
    error_files``.  A started ``PContext`` also works as ``async with pc:``
    (closed when the block exits).
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Mapping[int, str] | str | None = None,
        start_method: str = "spawn",
        *,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        sinks: Sequence[SinkLike] | None = None,
        duplicate_stdout_filters: Sequence[str] | None = None,
        duplicate_stderr_filters: Sequence[str] | None = None,
        pass_fds: Sequence[int] = (),
        on_event: Callable[[WorkerEvent], None] | None = None,
        close_sinks: bool = True,
    ) -> None:
        grace_period = check_duration("grace_period", grace_period)
        _validate(name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method)
        self._sinks = _make_sinks(sinks)
        self._filters = {
            "stdout": _check_filters("duplicate_stdout_filters", duplicate_stdout_filters),
            "stderr": _check_filters("duplicate_stderr_filters", duplicate_stderr_filters),
        }
        self._filter_sinks: dict[str, Sink] = {}
        if isinstance(pass_fds, (str, bytes)) or not all(
            isinstance(fd, int) and fd >= 0 for fd in pass_fds
        ):
            raise TypeError(f"pass_fds must be a sequence of fds, got {pass_fds!r}")
        self._pass_fds = tuple(pass_fds)
        self._on_event = on_event
        self._close_sinks = close_sinks or sinks is None
        self.name = name
        self.entrypoint = entrypoint
        self.nprocs = len(args)
        self.args: dict[int, tuple[Any, ...]] = {r: tuple(args[r]) for r in range(self.nprocs)}
        self.envs: dict[int, dict[str, str]] = {r: dict(envs[r]) for r in range(self.nprocs)}
        self.logs_specs = logs_specs
        self.start_method = start_method
        self.grace_period = float(grace_period)
        self.stdouts: dict[int, str] = {}
        self.stderrs: dict[int, str] = {}
        self.error_files: dict[int, str] = {}
        self._prefix_template = log_line_prefixes if isinstance(log_line_prefixes, str) else None
        self._prefixes = dict(log_line_prefixes) if isinstance(log_line_prefixes, Mapping) else {}
        self._state = _State.NEW
        self._children: dict[int, Child] = {}
        self._results: dict[int, bytearray] = {}
        self._errors: dict[int, bytearray] = {}
        self._values: dict[int, Any] = {}
        self._failures: dict[int, ProcessFailure] = {}
        self._remote: dict[int, BaseException] = {}
        self._stopping = False  # a failure stop or a close has begun
        # owned by the supervisor task (created by start())
        self._supervisor: asyncio.Task[None] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._launched: asyncio.Future[None] | None = None
        self._launching = True
        self._launch_done: asyncio.Event | None = None
        self._launch_scope: anyio.CancelScope | None = None
        self._close_request: asyncio.Future[tuple[int, float]] | None = None
        self._watching: dict[int, anyio.CancelScope] = {}
        self._watched: dict[int, asyncio.Event] = {}
        self._auto_stop: anyio.CancelScope | None = None
        self._auto_stopped: asyncio.Event | None = None
        self._finished: asyncio.Future[None] | None = None
        # reads failed ranks' error files off the loop; shut down at close,
        # so no thread outlives the group (the default executor's would)
        self._reader: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        kind = "function" if callable(self.entrypoint) else "binary"
        if self._state is _State.RUNNING and self._finished is not None:
            state = "finished" if self._finished.done() else "running"
        else:
            state = self._state.value
        return f"<PContext {self.name} nprocs={self.nprocs} {kind} {state}>"

    @property
    def is_function(self) -> bool:
        return not isinstance(self.entrypoint, str)

    async def __aenter__(self) -> PContext:
        if self._state is _State.NEW:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await _close_on_exit(self, exc)

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start every worker.

        Raises:
            ValueError/RuntimeError: if already started (``_AlreadyStartedError``
                is both, like torch's ValueError and trio's RuntimeError).
            OSError: if a worker cannot be launched; workers already started
                are stopped first.

        Cancellation: if cancelled part-way, the launch stops and every worker
        started so far is killed with its group (shielded, bounded) before the
        cancellation propagates; a cancellation by ``translate_signals`` stops
        them with that signal and the grace period instead.  A ``close()``
        from another task during the launch stops it too; ``start()`` then
        returns and the ranks that were never launched are reported as such.
        """
        if self._state is not _State.NEW:
            raise _AlreadyStartedError(
                f"{self!r} was already started; a PContext can be started once"
            )
        # everything that can reject the input runs before anything is created
        check_start(self.entrypoint, self.args, self.envs, self.logs_specs)
        payloads = self._call_payloads() if self.is_function else {}
        if not self.is_function:
            _check_executable(str(self.entrypoint), self.envs)
        dest = self.logs_specs.reify(self.envs)
        self._state = _State.RUNNING
        loop = asyncio.get_running_loop()
        self._finished = loop.create_future()
        self._launched = loop.create_future()
        self._close_request = loop.create_future()
        self._launch_done = asyncio.Event()
        self._auto_stopped = asyncio.Event()
        self.stdouts = dict(dest.stdouts)
        self.stderrs = dict(dest.stderrs)
        self.error_files = dict(dest.error_files)
        for stream, path in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
            if self._filters[stream] and path:
                self._filter_sinks[stream] = _FilteredFileSink(path, self._filters[stream])
        self._supervisor = loop.create_task(
            self._supervise(dest, payloads), name=f"aioproc-supervisor-{self.name}"
        )
        try:
            await asyncio.shield(self._launched)
        except asyncio.CancelledError:
            # A translated signal stops the workers with that signal, as when
            # leaving ``async with``; any other cancellation kills them at once.
            sig = pending_signal()
            if sig is not None:
                self._notify(WorkerEvent("stopping", -1, -1, -sig, time.time()))
                await shielded(self._close(sig, self.grace_period))
            else:
                await shielded(self._close(signal.SIGKILL, 0.0))
            raise

    def _call_payloads(self) -> dict[int, list[bytes]]:
        """Encode the INIT and CALL frames of every rank, before anything starts."""
        init = init_frame()
        encoder = CallEncoder(self.entrypoint)
        out: dict[int, list[bytes]] = {}
        for rank in range(self.nprocs):
            try:
                out[rank] = [init, *encoder.encode(self.args[rank], {})]
            except TypeError as e:
                if "arguments for" not in str(e):
                    raise
                raise TypeError(f"args for local rank {rank} cannot be pickled: {e}") from e
        return out

    async def _supervise(self, dest: LogsDest, payloads: dict[int, list[bytes]]) -> None:
        """The group's one owner: launch, watch, stop after a failure, shut down."""
        assert self._launched is not None
        assert self._close_request is not None
        assert self._launch_done is not None
        launch_error: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                with anyio.CancelScope() as scope:
                    self._launch_scope = scope
                    try:
                        await self._launch_all(tg, dest, payloads)
                    except Exception as e:
                        launch_error = e
                        self._request_close(signal.SIGKILL, 0.0)
                self._launch_scope = None
                self._launching = False
                self._launch_done.set()
                self._mark_never_started()
                if launch_error is None and not self._launched.done():
                    self._launched.set_result(None)
                try:
                    sig, timeout = await asyncio.shield(self._close_request)
                except asyncio.CancelledError:
                    # the loop is shutting down with the group still open
                    sig, timeout = signal.SIGKILL, 0.0
                with anyio.CancelScope(shield=True):
                    await self._shutdown(sig, timeout)
        except BaseException:
            # a bug escaped the task group: never leave a worker behind
            with anyio.CancelScope(shield=True):
                await self._emergency_stop()
            raise
        finally:
            self._state = _State.CLOSED
            if not self._launched.done():
                if launch_error is not None:
                    self._launched.set_exception(launch_error)
                else:
                    self._launched.set_result(None)

    async def _launch_all(
        self, tg: anyio.abc.TaskGroup, dest: LogsDest, payloads: dict[int, list[bytes]]
    ) -> None:
        assert self._close_request is not None
        for rank in range(self.nprocs):
            if rank:
                # yield between launches: each Popen blocks the loop ~1 ms, so
                # other tasks keep running while a large group starts
                await asyncio.sleep(0)
            if self._close_request.done():
                return
            child = await self._spawn_rank(rank, dest, payloads.get(rank))
            self._children[rank] = child
            self._watched[rank] = asyncio.Event()
            self._notify(WorkerEvent("started", rank, child.pid, None, time.time()))
            tg.start_soon(self._watch, rank, child, name=f"aioproc-watch-{child.label}")

    def _mark_never_started(self) -> None:
        for rank in range(self.nprocs):
            if rank not in self._children:
                failure = ProcessFailure(rank, -1, NEVER_STARTED, "", stopped=True)
                failure.message = (
                    f"local rank {rank} was never started: the group was closed while it "
                    "was being launched"
                )
                self._failures[rank] = failure
        self._check_finished()

    async def _spawn_rank(self, rank: int, dest: LogsDest, payload: list[bytes] | None) -> Child:
        env = {**os.environ, **self.envs[rank]}
        label = f"{self.name}/{rank}"
        prefix = self._prefix(rank)
        files: list[Any] = []
        tees: dict[str, TeeProtocol] = {}
        try:
            streams: dict[str, Any] = {}
            for key, path, tee_map in (
                ("stdout", dest.stdouts.get(rank, ""), dest.tee_stdouts),
                ("stderr", dest.stderrs.get(rank, ""), dest.tee_stderrs),
            ):
                if not path:
                    streams[key] = None
                    continue
                sinks = list(self._sinks) if rank in tee_map else []
                if key in self._filter_sinks:
                    sinks.append(self._filter_sinks[key])
                # a local open(); the tee owns it or it is closed below
                f = open(path, "wb", buffering=0)  # noqa: ASYNC230, SIM115
                if sinks:
                    streams[key] = subprocess.PIPE
                    tees[key] = TeeProtocol(f, rank, key, prefix, sinks)
                else:
                    streams[key] = f
                    files.append(f)
            if payload is not None:
                init, *call = payload
                return await launch_function(
                    label,
                    env,
                    on_frame=self._frame_handler(rank),
                    frames=[(_wire.INIT, [init]), (_wire.CALL, call)],
                    stdout=streams["stdout"],
                    stderr=streams["stderr"],
                    pass_fds=self._pass_fds,
                    tee_out=tees.get("stdout"),
                    tee_err=tees.get("stderr"),
                )
            return await spawn(
                label,
                [str(self.entrypoint), *map(str, self.args[rank])],
                env,
                stdout=streams["stdout"],
                stderr=streams["stderr"],
                stdin=None,
                pass_fds=self._pass_fds,
                tee_out=tees.get("stdout"),
                tee_err=tees.get("stderr"),
            )
        except BaseException:
            for t in tees.values():
                if t.log_file is not None:
                    t.log_file.close()
            raise
        finally:
            for f in files:
                f.close()  # the child has its own copy

    def _notify(self, event: WorkerEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            logger.exception("on_event callback failed for %s", event)

    def _prefix(self, rank: int) -> str:
        """torch's default ``[{name}{rank}]:``, a per-rank override or a template."""
        template = self._prefixes.get(rank, self._prefix_template)
        if template is None:
            return f"[{self.name}{rank}]:"
        return string.Template(template).safe_substitute(
            role_name=self.name,
            rank=self.envs[rank].get("RANK", str(rank)),
            local_rank=str(rank),
        )

    def _frame_handler(self, rank: int) -> Callable[[int, bytearray], None]:
        def on_frame(kind: int, body: bytearray) -> None:
            if kind == _wire.RESULT:
                self._results[rank] = body
            elif kind == _wire.ERROR:
                self._errors[rank] = body

        return on_frame

    # ------------------------------------------------------------ supervision

    async def _watch(self, rank: int, child: Child) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._watching[rank] = scope
                # shield: cancelling this watcher must not cancel the exit future
                code = await asyncio.shield(child.watcher.future)
                failure: ProcessFailure | None = None
                try:
                    settled = child.output_settled()
                    if settled:
                        await asyncio.wait(settled, timeout=_DRAIN_TIMEOUT)
                    if code != 0:
                        # the error file is read off the loop (capped, see errors.py)
                        if self._reader is None:
                            self._reader = ThreadPoolExecutor(1, "aioproc-error-file")
                        failure = await ProcessFailure.load(
                            rank,
                            child.pid,
                            code,
                            self.error_files.get(rank, ""),
                            child.stop_requested,
                            executor=self._reader,
                        )
                except OSError:
                    logger.exception("reading the outcome of %s failed", child.label)
            if not scope.cancelled_caught:
                # the outcome is recorded whatever the drain did, or wait() would hang
                try:
                    self._record(rank, child, code, failure)
                except Exception:  # a bug here must not take the supervisor down
                    logger.exception("recording the exit of %s failed", child.label)
                    if rank not in self._values and rank not in self._failures:
                        self._failures[rank] = ProcessFailure(rank, child.pid, code, "")
                        self._check_finished()
        finally:
            self._watched[rank].set()

    def _record(
        self, rank: int, child: Child, code: int, failure: ProcessFailure | None = None
    ) -> None:
        value: Any = None
        problem = ""
        if child.watcher.lost:
            problem = (
                f"exit status lost: process {child.pid} was reaped by somebody else's "
                "waitpid() in this process (a SIGCHLD handler or a child watcher reaping "
                "every child?), so how it ended is unknown"
            )
        elif code == 0 and rank in self._results:
            try:
                value = _wire.decode_value(self._results.pop(rank))
            except Exception as e:
                problem = f"return value could not be unpickled in the supervisor: {e!r}"
        if code == 0 and not problem:
            self._values[rank] = value
        else:
            failure = failure or ProcessFailure(
                local_rank=rank,
                pid=child.pid,
                exitcode=code,
                error_file=self.error_files.get(rank, ""),
                stopped=child.stop_requested,
            )
            if problem:
                failure.message = problem
            elif child.channel is not None and child.channel.error is not None:
                failure.message = str(child.channel.error)  # why the worker was ended
            lost = [t.write_error for t in child.tees if t.write_error is not None]
            if lost and isinstance(failure.message, str):
                failure.message += f" (its log file could not be written: {lost[0]})"
            self._failures[rank] = failure
            remote = self._remote_exception(rank)
            if remote is not None:
                self._remote[rank] = remote
            if not self._stopping and self._tg is not None:
                self._stopping = True
                self._tg.start_soon(self._stop_after_failure, name=f"aioproc-stop-{self.name}")
        self._notify(
            WorkerEvent("exited", rank, child.pid, code, child.watcher.exit_time or time.time())
        )
        self._check_finished()

    def _remote_exception(self, rank: int) -> BaseException | None:
        body = self._errors.pop(rank, None)
        return rebuild_exception(body) if body is not None else None

    def _check_finished(self) -> None:
        done = len(self._values) + len(self._failures)
        if done == self.nprocs and self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    async def _stop_after_failure(self) -> None:
        assert self._launch_done is not None
        assert self._auto_stopped is not None
        try:
            with anyio.CancelScope() as scope:
                self._auto_stop = scope
                # a failure can be noticed while ranks are still being launched
                await self._launch_done.wait()
                running = [c for c in self._children.values() if c.returncode is None]
                if running:
                    forced = await stop_groups(
                        list(self._children.values()), signal.SIGTERM, self.grace_period
                    )
                    try:
                        warn_forced(forced, signal.SIGTERM, self.grace_period)
                    except Exception:  # a filter made the warning an error: log it
                        logger.exception("warning about forced kills failed")
        finally:
            self._auto_stopped.set()

    def _result(self) -> RunProcsResult:
        return RunProcsResult(
            return_values=dict(sorted(self._values.items())),
            failures=dict(sorted(self._failures.items())),
            stdouts=dict(self.stdouts),
            stderrs=dict(self.stderrs),
        )

    def remote_exception(self, local_rank: int) -> BaseException | None:
        """The exception a function worker raised, rebuilt in the supervisor.

        Its ``__cause__`` is a ``RemoteTraceback`` holding the worker's own
        formatted traceback.  ``None`` for binaries and ranks that did not raise.
        """
        return self._remote.get(local_rank)

    # ------------------------------------------------------------------ query

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the started workers."""
        return {rank: child.pid for rank, child in self._children.items()}

    def poll(self) -> RunProcsResult | None:
        """The group's result if every worker is done, else ``None``; never blocks."""
        if self._finished is None:
            raise RuntimeError(f"{self!r} has not been started")
        return self._result() if self._finished.done() else None

    async def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait for the group's result, all-or-nothing.

        Returns as soon as every worker succeeded, or once one failed and the
        others were stopped.  As torch's ``wait()`` does, a final result also
        closes the group: what the workers left in their process groups is
        stopped (``death_sig`` SIGTERM, then SIGKILL after ``grace_period``),
        the pipes, sinks and the guardian are released.  Nothing polls:
        ``period`` is accepted for compatibility with torch and ignored.

        Args:
            timeout: seconds to wait; negative waits forever; 0 is a poll.
            period: ignored.

        Returns:
            The ``RunProcsResult``, or ``None`` if still running at ``timeout``.

        Cancellation: cancelling ``wait()`` leaves the workers running; the
        ``async with`` block (or ``close()``) stops them.  Once the result is
        final, the release runs shielded.
        """
        timeout = check_duration("wait(timeout=...)", timeout, allow_negative=True)
        if self._finished is None:
            raise RuntimeError(f"{self!r} has not been started")
        if not self._finished.done():
            if timeout == 0:
                return None
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._finished), None if timeout < 0 else timeout
                )
            except asyncio.TimeoutError:
                return None
        await self.close(signal.SIGTERM, self.grace_period)
        return self._result()

    # ------------------------------------------------------------------ close

    async def close(self, death_sig: int | None = None, timeout: float = 30) -> None:
        """Stop every worker: ``death_sig`` to each process group, then SIGKILL.

        Waits up to ``timeout`` seconds in total for the workers and what
        they left in their process groups to exit, then SIGKILLs the groups
        still alive (warning with ``ForcedKillWarning``) and reaps them with a
        bounded wait.  Output up to EOF reaches its sinks.  During ``start()``
        it stops the launch first.  Idempotent: a second ``close()`` (also
        from another task) waits for the first to finish.

        Args:
            death_sig: the graceful signal (default SIGTERM).
            timeout: grace period in seconds before SIGKILL.

        Cancellation: the stop runs shielded and bounded in time; a
        cancellation arriving meanwhile is re-raised once it is done.
        """
        sig = _validate_signal(signal.SIGTERM if death_sig is None else death_sig)
        timeout = check_duration("close(timeout=...)", timeout)
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        await shielded(self._close(sig, float(timeout)))

    def _request_close(self, sig: int, timeout: float) -> None:
        assert self._close_request is not None
        if not self._close_request.done():
            self._close_request.set_result((sig, timeout))
        if self._launch_scope is not None:
            self._launch_scope.cancel()

    async def _close(self, sig: int, timeout: float) -> None:
        if self._supervisor is None:
            return
        self._request_close(sig, timeout)
        await asyncio.wait({self._supervisor})

    async def _emergency_stop(self) -> None:
        children = list(self._children.values())
        await stop_groups(children, signal.SIGKILL, 0.0)
        for c in children:
            await c.close_streams(0.0)
            if c.watcher.future.done():
                c.release()
            else:
                c.release_when_exited()
        await _lifeline.settle()

    async def _shutdown(self, sig: int, timeout: float) -> None:
        self._stopping = True
        assert self._auto_stopped is not None
        if self._auto_stop is not None:
            # a later close() decides the signal and the grace period
            self._auto_stop.cancel()
            await self._auto_stopped.wait()
        children = list(self._children.values())
        forced: list[Child] = []
        if children:
            forced = await stop_groups(children, sig, timeout)
        watched = [e.wait() for e in self._watched.values() if not e.is_set()]
        if watched:
            with anyio.move_on_after(_DRAIN_TIMEOUT + 1):
                await asyncio.gather(*watched)
        for rank, scope in self._watching.items():
            if not self._watched[rank].is_set():
                # only an unkillable worker keeps its watcher waiting
                scope.cancel()
                child = self._children[rank]
                failure = ProcessFailure(
                    rank, child.pid, -signal.SIGKILL, self.error_files.get(rank, ""), stopped=True
                )
                failure.message = (
                    f"process {child.pid} did not exit after SIGKILL (uninterruptible sleep?); "
                    "it is still running and will be reaped when it exits"
                )
                self._failures[rank] = failure
        await asyncio.gather(*(c.close_streams(_DRAIN_TIMEOUT) for c in children))
        own_sinks = self._sinks if self._close_sinks else []
        # bounded, and never raises: the cleanup below always runs
        await close_sinks([*own_sinks, *self._filter_sinks.values()])
        _lifeline.release(children)
        for c in children:
            if not c.watcher.future.done():
                c.release_when_exited()
        await _lifeline.settle()
        if self._reader is not None:
            self._reader.shutdown(wait=True)  # idle by now: joins at once
            self._reader = None
        self._check_finished()
        self._state = _State.CLOSED
        self.logs_specs.prune()
        warn_forced(forced, sig, timeout)


async def _start(pc: PContext) -> PContext:
    await pc.start()
    return pc


async def _close_on_exit(pc: PContext, exc: BaseException | None) -> None:
    """Leaving ``async with``: a signal stops the workers with it."""
    sig: int | None = None
    if isinstance(exc, SignalException):
        sig = exc.sigval
    elif isinstance(exc, asyncio.CancelledError):
        sig = pending_signal()
    if sig is not None and pc._state is _State.RUNNING:
        pc._notify(WorkerEvent("stopping", -1, -1, -sig, time.time()))
    await pc.close(signal.SIGTERM if sig is None else sig, pc.grace_period)


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | str | None = None,
    start_method: str = "spawn",
    *,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    sinks: Sequence[SinkLike] | None = None,
    duplicate_stdout_filters: Sequence[str] | None = None,
    duplicate_stderr_filters: Sequence[str] | None = None,
    pass_fds: Sequence[int] = (),
    on_event: Callable[[WorkerEvent], None] | None = None,
    close_sinks: bool = True,
) -> OpenResource[PContext]:
    """Start ``len(args)`` workers running ``entrypoint``.

    ``await start_processes(...)`` returns the started ``PContext``;
    ``async with start_processes(...) as pc:`` also closes the group when
    the block exits, by error, cancellation or signal (a ``SignalException``,
    or a cancellation from ``translate_signals``, stops the workers with
    that same signal).

    Args:
        name: the group's name, used in log prefixes and messages.
        entrypoint: a picklable callable (function workers) or the path or
            name of an executable (binary workers: ``argv = (entrypoint,
            *map(str, args[rank]))``, never a shell).
        args: ``{local_rank: tuple}`` for ranks ``0..n-1``.
        envs: ``{local_rank: {name: value}}``, added to the parent's
            environment in each worker.
        logs_specs: where output and error files go (default:
            ``DefaultLogsSpecs()``: inherited output, error files in a
            temporary directory that is removed when left empty).
        log_line_prefixes: ``{local_rank: prefix}`` for tee'd lines, or one
            template for every rank with ``${role_name}`` (the group name),
            ``${rank}`` (the rank's ``RANK`` env var, else its local rank)
            and ``${local_rank}``; a per-rank value may be a template too.
            Default ``[{name}{local_rank}]:``.
        start_method: only ``"spawn"``: every worker is a fresh interpreter.
        grace_period: seconds between SIGTERM and SIGKILL when a failure
            stops the group or the ``async with`` block exits.
        sinks: where tee'd lines go (``aioproc.sinks``): ``Sink`` objects,
            callables taking an ``OutputLine`` (sync or async), file paths or
            open text files.  Default: one ``ConsoleSink``.
        duplicate_stdout_filters: lines of redirected or tee'd stdout that
            contain any of these strings also go, prefixed, to the attempt's
            ``filtered_stdout.log`` (torch's option).
        duplicate_stderr_filters: the same for stderr.
        pass_fds: extra fds every worker inherits (kept open under the same
            numbers), e.g. a channel the worker reports to.
        on_event: called on the loop with a ``WorkerEvent`` when a worker
            has started and when its exit has been recorded.
        close_sinks: close the given ``sinks`` when the group is closed
            (``False`` when they outlive the group, as across agent restarts).

    Raises:
        TypeError, ValueError, RuntimeError, FileNotFoundError,
        PermissionError, NotADirectoryError: for bad input, before anything
        is started.
    """
    pc = PContext(
        name,
        entrypoint,
        args,
        envs,
        logs_specs if logs_specs is not None else DefaultLogsSpecs(),
        log_line_prefixes,
        start_method,
        grace_period=grace_period,
        sinks=sinks,
        duplicate_stdout_filters=duplicate_stdout_filters,
        duplicate_stderr_filters=duplicate_stderr_filters,
        pass_fds=pass_fds,
        on_event=on_event,
        close_sinks=close_sinks,
    )
    return OpenResource(lambda: _start(pc), _close_on_exit)


# ---------------------------------------------------------------- sinks


def _make_sinks(sinks: Sequence[SinkLike] | None) -> list[Sink]:
    if sinks is None:
        return [ConsoleSink()]
    if isinstance(sinks, (str, Sink)) or not isinstance(sinks, Sequence):
        raise TypeError(f"sinks must be a list of sinks, got {sinks!r}")
    out: list[Sink] = []
    for sink in sinks:
        if isinstance(sink, Sink):
            out.append(sink)
        elif isinstance(sink, str) or hasattr(sink, "write"):
            out.append(FileSink(sink))  # type: ignore[arg-type]
        elif callable(sink):
            out.append(CallbackSink(sink))
        else:
            raise TypeError(
                f"unsupported sink {sink!r}: expected a Sink, a callable, a path or a text file"
            )
    return out
