"""The supervisor: ``start_processes``, ``PContext``, ``RunProcsResult`` and ``run``.

A ``PContext`` owns one group of workers.  ``start()`` validates everything,
then spawns every worker (``_spawn``), registers its process group with a
guardian (``_lifeline``) and starts one watcher task per worker.  A watcher
awaits the worker's exit (a pidfd, not polling), then the bytes the worker
wrote before exiting (``_drain``), and records the outcome.  The first
failure makes the supervisor stop every other worker at once
(all-or-nothing); the group's result is final when every worker is done.
``close()`` stops whatever still runs, gracefully then by force
(``_shutdown``), drains and closes the pipes and dismisses the guardian.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import shutil
import signal
import socket
import string
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple, TypeAlias

from . import _wire
from ._boot import CallEncoder, boot_argv, boot_blob, init_frame, rebuild_exception
from ._channel import Channel
from ._cm import OpenResource
from ._lifeline import Guardian
from ._output import TeeProtocol
from ._shield import shielded
from ._shutdown import stop_groups, warn_forced
from ._spawn import Child, spawn
from .errors import ChildFailedError, ProcessFailure
from .logs import DefaultLogsSpecs, LogsDest, LogsSpecs
from .signals import SignalException, pending_signal
from .sinks import CallbackSink, ConsoleSink, FileSink, Sink, _FilteredFileSink, close_sinks

__all__ = ["PContext", "RunProcsResult", "WorkerEvent", "run", "start_processes"]

logger = logging.getLogger("aioproc")

SinkLike: TypeAlias = Sink | Callable[..., Any] | str | IO[str]
"""A sink, a callable taking an ``OutputLine``, a file path or an open text file."""

START_METHODS = ("spawn",)
DEFAULT_GRACE_PERIOD = 30.0
"""Seconds between ``death_sig`` and SIGKILL when a failure stops the group."""
_DRAIN_TIMEOUT = 2.0
"""Bound on waiting for EOF of a killed group's pipes (a setsid'd descendant may hold them)."""


@dataclass
class RunProcsResult:
    """Outcome of a worker group.

    Attributes:
        return_values: ``{local_rank: value}`` of the workers that succeeded
            (``None`` for binaries and for functions that ended via
            ``sys.exit(0)``).  When the group failed, the ranks that did
            succeed are still listed.
        failures: ``{local_rank: ProcessFailure}``; empty when all succeeded.
        stdouts: ``{local_rank: path}`` of stdout log files ("" if none).
        stderrs: ``{local_rank: path}`` of stderr log files ("" if none).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class WorkerEvent(NamedTuple):
    """A worker started or exited (``exitcode`` is None for "started")."""

    kind: str  # "started" | "exited"
    local_rank: int
    pid: int
    exitcode: int | None
    time: float


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
    error_files``.
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
        if not isinstance(grace_period, (int, float)) or grace_period < 0:
            raise ValueError(f"grace_period must be a number >= 0, got {grace_period!r}")
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
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._guardian: Guardian | None = None
        self._results: dict[int, bytearray] = {}
        self._errors: dict[int, bytearray] = {}
        self._values: dict[int, Any] = {}
        self._failures: dict[int, ProcessFailure] = {}
        self._remote: dict[int, BaseException] = {}
        self._stopping = False
        self._auto_stop: asyncio.Task[None] | None = None
        self._finished: asyncio.Future[None] | None = None
        self._spawned: asyncio.Event | None = None  # set when start() stops launching
        self._forced: list[Child] = []

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

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start every worker.

        Raises:
            ValueError/RuntimeError: if already started (``_AlreadyStartedError``
                is both, like torch's ValueError and trio's RuntimeError).
            OSError: if a worker cannot be launched; workers already started
                are stopped first.

        Cancellation: if cancelled part-way, every worker started so far is
        stopped (shielded, bounded) before the cancellation propagates.
        """
        if self._state is not _State.NEW:
            raise _AlreadyStartedError(
                f"{self!r} was already started; a PContext can be started once"
            )
        # everything that can reject the input runs before anything is created
        payloads = self._call_payloads() if self.is_function else {}
        if not self.is_function:
            _check_executable(str(self.entrypoint), self.envs)
        self._state = _State.RUNNING
        loop = asyncio.get_running_loop()
        self._finished = loop.create_future()
        self._spawned = asyncio.Event()
        dest = self.logs_specs.reify(self.envs)
        self.stdouts = dict(dest.stdouts)
        self.stderrs = dict(dest.stderrs)
        self.error_files = dict(dest.error_files)
        for stream, path in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
            if self._filters[stream] and path:
                self._filter_sinks[stream] = _FilteredFileSink(path, self._filters[stream])
        try:
            self._guardian = Guardian()
            for rank in range(self.nprocs):
                if rank:
                    # yield between launches: each Popen blocks the loop ~1 ms, so
                    # other tasks keep running while a large group starts
                    await asyncio.sleep(0)
                child = await self._spawn_rank(rank, dest, payloads.get(rank))
                self._children[rank] = child
                self._guardian.watch(child.pgid)
                self._notify(WorkerEvent("started", rank, child.pid, None, time.time()))
                self._watchers[rank] = loop.create_task(
                    self._watch(rank, child), name=f"aioproc-watch-{child.label}"
                )
        except BaseException:
            self._spawned.set()
            await shielded(self._shutdown(signal.SIGKILL, 0))
            raise
        self._spawned.set()

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

    async def _spawn_rank(self, rank: int, dest: LogsDest, payload: list[bytes] | None) -> Child:
        env = {**os.environ, **self.envs[rank]}
        label = f"{self.name}/{rank}"
        prefix = self._prefix(rank)
        files: list[Any] = []
        parent_sock = child_sock = None
        try:
            streams: dict[str, Any] = {}
            tees: dict[str, TeeProtocol] = {}
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
                parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                argv = boot_argv(child_sock.fileno())
                pass_fds: tuple[int, ...] = (child_sock.fileno(), *self._pass_fds)
                stdin: int | None = subprocess.DEVNULL
            else:
                argv = [str(self.entrypoint), *map(str, self.args[rank])]
                pass_fds = self._pass_fds
                stdin = None
            channel = None
            if parent_sock is not None:
                channel = await Channel.open(parent_sock, self._frame_handler(rank))
            try:
                child = await spawn(
                    label,
                    argv,
                    env,
                    stdout=streams["stdout"],
                    stderr=streams["stderr"],
                    stdin=stdin,
                    pass_fds=pass_fds,
                    channel=channel,
                    tee_out=tees.get("stdout"),
                    tee_err=tees.get("stderr"),
                )
            except BaseException:
                for t in tees.values():
                    if t.log_file is not None:
                        t.log_file.close()
                if channel is not None:
                    await channel.aclose()
                raise
        finally:
            for f in files:
                f.close()  # the child has its own copy
            if child_sock is not None:
                child_sock.close()
        if channel is not None and payload is not None:
            init, *call = payload
            channel.send_raw(boot_blob())
            channel.send(_wire.INIT, init)
            channel.send(_wire.CALL, *call)
        return child

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
        code = await child.watcher.future
        try:
            settled = child.output_settled()
            if settled:
                await asyncio.wait(settled, timeout=_DRAIN_TIMEOUT)
        finally:
            # the outcome is recorded whatever happens, or wait() would hang
            self._record(rank, child, code)

    def _record(self, rank: int, child: Child, code: int) -> None:
        value: Any = None
        problem = ""
        if code == 0 and rank in self._results:
            try:
                value = _wire.decode_value(self._results.pop(rank))
            except Exception as e:
                problem = f"return value could not be unpickled in the supervisor: {e!r}"
        if code == 0 and not problem:
            self._values[rank] = value
        else:
            failure = ProcessFailure(
                local_rank=rank,
                pid=child.pid,
                exitcode=code,
                error_file=self.error_files.get(rank, ""),
                stopped=child.stop_requested,
            )
            if problem:
                failure.message = problem
            self._failures[rank] = failure
            remote = self._remote_exception(rank)
            if remote is not None:
                self._remote[rank] = remote
            if not self._stopping:
                self._stopping = True
                self._auto_stop = asyncio.get_running_loop().create_task(
                    self._stop_after_failure(), name=f"aioproc-stop-{self.name}"
                )
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
        # a failure can be noticed while start() is still launching ranks
        assert self._spawned is not None
        await self._spawned.wait()
        running = [c for c in self._children.values() if c.returncode is None]
        if running:
            self._forced += await stop_groups(
                list(self._children.values()), signal.SIGTERM, self.grace_period
            )
            warn_forced(self._forced, signal.SIGTERM, self.grace_period)
            self._forced.clear()

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
        others were stopped.  Nothing polls: ``period`` is accepted for
        compatibility with torch and ignored.

        Args:
            timeout: seconds to wait; negative waits forever; 0 is a poll.
            period: ignored.

        Returns:
            The ``RunProcsResult``, or ``None`` if still running at ``timeout``.

        Cancellation: cancelling ``wait()`` leaves the workers running; the
        ``async with`` block (or ``close()``) stops them.
        """
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
        return self._result()

    # ------------------------------------------------------------------ close

    async def close(self, death_sig: int | None = None, timeout: float = 30) -> None:
        """Stop every worker: ``death_sig`` to each process group, then SIGKILL.

        Waits up to ``timeout`` seconds in total for the workers to exit, then
        SIGKILLs the groups still alive (warning with ``ForcedKillWarning``)
        and reaps them with a bounded wait.  Output up to EOF reaches its
        sinks.  Idempotent.

        Args:
            death_sig: the graceful signal (default SIGTERM).
            timeout: grace period in seconds before SIGKILL.

        Cancellation: the stop runs shielded and bounded in time; a
        cancellation arriving meanwhile is re-raised once it is done.
        """
        sig = _validate_signal(signal.SIGTERM if death_sig is None else death_sig)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        if self._state is _State.CLOSED:
            return
        await shielded(self._shutdown(sig, float(timeout)))

    async def _shutdown(self, sig: int, timeout: float) -> None:
        self._stopping = True
        if self._auto_stop is not None and not self._auto_stop.done():
            self._auto_stop.cancel()
            await asyncio.wait({self._auto_stop})
        children = list(self._children.values())
        forced: list[Child] = []
        if children:
            forced = await stop_groups(children, sig, timeout)
        watchers = [t for t in self._watchers.values() if not t.done()]
        if watchers:
            await asyncio.wait(watchers, timeout=_DRAIN_TIMEOUT + 1)
        for rank, task in self._watchers.items():
            if not task.done():
                # only an unkillable worker keeps its watcher waiting
                task.cancel()
                child = self._children[rank]
                self._failures[rank] = ProcessFailure(
                    rank, child.pid, -signal.SIGKILL, self.error_files.get(rank, ""), stopped=True
                )
        await asyncio.gather(*(c.close_streams(_DRAIN_TIMEOUT) for c in children))
        own_sinks = self._sinks if self._close_sinks else []
        # bounded, and never raises: the cleanup below always runs
        await close_sinks([*own_sinks, *self._filter_sinks.values()])
        if self._watchers:
            await asyncio.wait(self._watchers.values())
        if self._guardian is not None:
            await self._guardian.aclose()
        self._check_finished()
        self._state = _State.CLOSED
        self.logs_specs.prune()
        warn_forced(forced, sig, timeout)


async def _start(pc: PContext) -> PContext:
    await pc.start()
    return pc


async def _close_on_exit(pc: PContext, exc: BaseException | None) -> None:
    """Leaving ``async with start_processes(...)``: a signal stops the workers with it."""
    sig: int = signal.SIGTERM
    if isinstance(exc, SignalException):
        sig = exc.sigval
    elif isinstance(exc, asyncio.CancelledError):
        sig = pending_signal() or signal.SIGTERM
    await pc.close(sig, pc.grace_period)


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


async def run(
    entrypoint: Callable[..., Any] | str,
    nprocs: int,
    args: Mapping[int, tuple[Any, ...]] | tuple[Any, ...] | None = None,
    envs: Mapping[int, Mapping[str, str]] | None = None,
    *,
    name: str | None = None,
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | str | None = None,
    start_method: str = "spawn",
    timeout: float | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    sinks: Sequence[SinkLike] | None = None,
) -> RunProcsResult:
    """Run ``nprocs`` workers to completion: start, wait, close.

    Args:
        entrypoint: a callable or an executable, as for ``start_processes``.
        nprocs: number of workers (> 0).
        args: one tuple for every rank, or ``{local_rank: tuple}``; default
            no arguments.
        envs: ``{local_rank: {name: value}}``; default no extra variables.
        name: group name (default: the function's or executable's name).
        timeout: seconds before the group is stopped and ``TimeoutError``
            raised (its ``result`` attribute holds the partial result).

    Returns:
        The ``RunProcsResult`` when every worker succeeded.

    Raises:
        ChildFailedError: a worker failed; its ``__cause__`` is the root-cause
            worker's own exception (function workers), whose ``__cause__``
            holds the worker's traceback.
        TimeoutError: ``timeout`` expired.

    Cancellation: the workers are stopped (shielded, bounded) before the
    cancellation propagates.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 0:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if args is None:
        args = {}
    if isinstance(args, tuple):
        rank_args: Mapping[int, tuple[Any, ...]] = {r: args for r in range(nprocs)}
    elif isinstance(args, Mapping):
        rank_args = args if args else {r: () for r in range(nprocs)}
    else:
        raise TypeError(f"args must be a tuple or a {{local_rank: tuple}} dict, got {args!r}")
    rank_envs = envs if envs else {r: {} for r in range(nprocs)}
    if name is None:
        name = (
            os.path.basename(entrypoint)
            if isinstance(entrypoint, str)
            else getattr(entrypoint, "__name__", "worker")
        )
    if len(rank_args) != nprocs:
        raise RuntimeError(
            f"args has {len(rank_args)} ranks {sorted(rank_args)} but nprocs is {nprocs}"
        )
    async with start_processes(
        name,
        entrypoint,
        rank_args,
        rank_envs,
        logs_specs,
        log_line_prefixes,
        start_method,
        grace_period=grace_period,
        sinks=sinks,
    ) as pc:
        result = await pc.wait(-1 if timeout is None else timeout)
        if result is None:
            await pc.close(signal.SIGTERM, grace_period)
            err = TimeoutError(
                f"{pc.name}: workers still running after {timeout} s; "
                f"stopped ranks {sorted(pc._failures)}"
            )
            err.result = pc.poll()  # type: ignore[attr-defined]
            raise err
        if result.is_failed():
            failed = ChildFailedError(name=pc.name, failures=result.failures)
            root, _ = failed.get_first_failure()
            raise failed from pc.remote_exception(root)
        return result


# ---------------------------------------------------------------- validation


def _validate(
    name: object,
    entrypoint: object,
    args: object,
    envs: object,
    logs_specs: object,
    log_line_prefixes: object,
    start_method: object,
) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r}")
    if not isinstance(entrypoint, str) and not callable(entrypoint):
        raise TypeError(
            f"entrypoint must be a callable (function workers) or a str "
            f"(binary workers), got {entrypoint!r}"
        )
    if isinstance(entrypoint, str) and not entrypoint:
        raise ValueError("entrypoint is an empty string")
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start_method {start_method!r}: aioproc supports only 'spawn' "
            "(every worker is a fresh interpreter; fork is unsafe with a running event loop)"
        )
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a {{local_rank: tuple}} dict, got {args!r}")
    if not isinstance(envs, Mapping):
        raise TypeError(f"envs must be a {{local_rank: dict}} dict, got {envs!r}")
    nprocs = len(args)
    if nprocs == 0:
        raise ValueError("args is empty: at least one worker (local rank 0) is needed")
    expected = set(range(nprocs))
    for what, mapping in (("args", args), ("envs", envs)):
        if set(mapping) != expected:
            raise RuntimeError(
                f"{what} local rank keys mismatch: expected {sorted(expected)}, "
                f"got {sorted(mapping, key=repr)}"
            )
    for rank, a in args.items():
        if not isinstance(a, (tuple, list)):
            raise TypeError(f"args[{rank}] must be a tuple, got {a!r}")
    for rank, env in envs.items():
        if not isinstance(env, Mapping):
            raise TypeError(f"envs[{rank}] must be a dict of str to str, got {env!r}")
        for key, value in env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"envs[{rank}] must map str to str; got {key!r}: {value!r} "
                    f"({type(value).__name__})"
                )
    if not isinstance(logs_specs, LogsSpecs):
        raise TypeError(f"logs_specs must be a LogsSpecs, got {logs_specs!r}")
    if log_line_prefixes is not None and not isinstance(log_line_prefixes, str):
        if not isinstance(log_line_prefixes, Mapping):
            raise TypeError(f"log_line_prefixes must be a dict, got {log_line_prefixes!r}")
        bad = set(log_line_prefixes) - expected
        if bad:
            raise ValueError(f"log_line_prefixes has unknown local ranks {sorted(bad, key=repr)}")


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


def _check_filters(what: str, filters: Sequence[str] | None) -> tuple[str, ...]:
    if filters is None:
        return ()
    if isinstance(filters, str) or not all(isinstance(f, str) and f for f in filters):
        raise TypeError(f"{what} must be a list of non-empty strings, got {filters!r}")
    return tuple(filters)


def _validate_signal(sig: int) -> int:
    try:
        valid = signal.Signals(sig)
    except (ValueError, TypeError):
        raise ValueError(f"death_sig must be a signal number, got {sig!r}") from None
    return int(valid)


def _check_executable(entrypoint: str, envs: Mapping[int, Mapping[str, str]]) -> None:
    """Fail like exec would, but before any worker starts."""
    if os.sep in entrypoint:
        if not os.path.exists(entrypoint):
            raise FileNotFoundError(2, f"binary entrypoint not found: {entrypoint!r}", entrypoint)
        if os.path.isdir(entrypoint) or not os.access(entrypoint, os.X_OK):
            raise PermissionError(
                13, f"binary entrypoint is not an executable file: {entrypoint!r}", entrypoint
            )
        return
    for rank, env in envs.items():
        path = env.get("PATH", os.environ.get("PATH", os.defpath))
        if shutil.which(entrypoint, path=path) is None:
            raise FileNotFoundError(
                2, f"binary entrypoint {entrypoint!r} not found on PATH of local rank {rank}"
            )
