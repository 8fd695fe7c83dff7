"""The supervisor of one worker group: ``PContext`` (built by ``start_processes``).

``PContext`` is torch's face over the group's crew (``_supervisor``): its
constructor, ``start``, ``wait``, ``poll``, ``close`` (and ``aclose``),
``pids``, ``remote_exception`` and the attributes torch users read.  The
crew owns its work in one supervisor task: the launch of every rank, the
exits' records, the hold of workers that returned, and the one stop that a
first failure or a ``close()`` asks for.  A worker's exit (a pidfd, not
polling) is recorded with the output it wrote and its error file; the first
failure stops every other worker (all-or-nothing); the group's result is
final when every rank is done.  ``close()`` stops whatever still runs,
gracefully then by force, during a launch too (ranks not launched yet are
reported as never started), drains and closes the pipes, reaps the
leaders (kept as zombies until then, so a recycled pid is never signalled)
and lets the guardian forget their groups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from ._base import public_module
from ._base.checks import check_duration, check_signal
from ._base.loops import check_loop
from ._base.resource import handle_closed, handle_opened
from ._group.preimport import preimport as preimport
from ._supervisor.spec import GroupSpec
from ._supervisor.supervisor import Supervisor
from .logs import LogsSpecs
from .results import RunProcsResult, WorkerEvent
from .signals import SignalException, pending_signal

__all__ = ["PContext", "RunProcsResult", "WorkerEvent", "close_on_exit", "preimport"]

public_module(__name__, preimport)

_POSITIONAL = ("name", "entrypoint", "args", "envs", "logs_specs", "log_line_prefixes")
_OPTIONS = frozenset(f.name for f in dataclasses.fields(GroupSpec)) - set(_POSITIONAL)


class _AlreadyStartedError(RuntimeError, ValueError):
    """Raised by a second ``start()`` (a ValueError too, as torch raises)."""


class PContext:
    """A group of worker processes supervised all-or-nothing.

    Built by ``start_processes``; a callable entrypoint gives function
    workers, a ``str`` gives binary workers.  torch's constructor works as
    well (``PContext(name, entrypoint, args, envs, logs_specs,
    log_line_prefixes)``, then ``await pc.start()``), with
    ``start_processes``' options as keywords.  A started ``PContext`` also
    works as ``async with pc:`` (closed when the block exits).

    Attributes:
        name, entrypoint, args, envs, nprocs, logs_specs, start_method:
            torch's; ``envs`` gains ``TORCHELASTIC_ERROR_FILE`` at start.
        stdouts, stderrs, error_files: ``{local_rank: path}`` once started.
        filtered_stdout, filtered_stderr: once started, the file that
            collects the lines matching ``duplicate_stdout_filters`` /
            ``duplicate_stderr_filters`` (None without such filters; torch
            holds the open file there).
        grace_period: seconds from the graceful signal to SIGKILL, for the
            stop after a failure and for ``close()`` without one.
        kwargs: ``{local_rank: {name: value}}`` for function workers.
        preload: the modules a forkserver template imports.
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
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(f"PContext() got unexpected keyword arguments {unknown}")
        spec = GroupSpec(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method, **options
        )
        self._sup = Supervisor(spec.check())

    @classmethod
    def _from_spec(cls, spec: GroupSpec) -> PContext:
        """The group ``spec`` describes, checked here (``start_processes``, the
        agent and the cluster runner build theirs)."""
        pc = cls.__new__(cls)
        pc._sup = Supervisor(spec.check())
        return pc

    @property
    def name(self) -> str:
        return self._sup.spec.name

    @property
    def entrypoint(self) -> Callable[..., Any] | str:
        return self._sup.spec.entrypoint

    @property
    def args(self) -> Mapping[int, tuple[Any, ...]]:
        return self._sup.spec.args

    @property
    def envs(self) -> dict[int, dict[str, str]]:
        return self._sup.envs

    @property
    def nprocs(self) -> int:
        return self._sup.spec.nprocs

    @property
    def logs_specs(self) -> LogsSpecs:
        return self._sup.spec.logs_specs

    @property
    def start_method(self) -> str:
        return self._sup.spec.start_method

    @property
    def grace_period(self) -> float:
        return self._sup.spec.grace_period

    @property
    def kwargs(self) -> Mapping[int, Mapping[str, Any]]:
        return self._sup.spec.kwargs or {}

    @property
    def preload(self) -> tuple[str, ...]:
        return tuple(self._sup.spec.preload)

    @property
    def worker_loop(self) -> str:
        return self._sup.spec.worker_loop

    @property
    def stdouts(self) -> dict[int, str]:
        return self._sup.dest.stdouts

    @property
    def stderrs(self) -> dict[int, str]:
        return self._sup.dest.stderrs

    @property
    def error_files(self) -> dict[int, str]:
        return self._sup.dest.error_files

    @property
    def filtered_stdout(self) -> str | None:
        return self._sup.filtered.get("stdout")

    @property
    def filtered_stderr(self) -> str | None:
        return self._sup.filtered.get("stderr")

    @property
    def is_function(self) -> bool:
        """True for function workers, False for binaries."""
        return self._sup.spec.is_function

    def __repr__(self) -> str:
        kind = "function" if self.is_function else "binary"
        return f"<PContext {self.name} nprocs={self.nprocs} {kind} {self._sup.state}>"

    async def __aenter__(self) -> PContext:
        if self._sup.state == "new":
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await close_on_exit(self, exc)

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
        state = self._sup.state
        if state != "new":
            done = "was closed" if state == "closed" else "was already started"
            raise _AlreadyStartedError(f"{self!r} {done}; a PContext can be started once")
        handle_opened(self)  # until close(): a leak check names a group left open
        try:
            await self._sup.start()
        finally:
            if self._sup.state in ("new", "closed"):
                handle_closed(self)  # a failed start leaves nothing to close

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the started workers."""
        return self._sup.pids()

    def remote_exception(self, local_rank: int) -> BaseException | None:
        """The exception a function worker raised, rebuilt in the supervisor.

        Its ``__cause__`` is a ``RemoteTraceback`` holding the worker's own
        formatted traceback.  ``None`` for binaries and ranks that did not raise.
        """
        return self._sup.remote_exception(local_rank)

    def poll(self) -> RunProcsResult | None:
        """The group's result if every worker is done, else ``None``; never blocks."""
        if not self._sup.started:
            raise RuntimeError(f"{self!r} has not been started")
        return self._sup.result() if self._sup.finished.done() else None

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
        check_loop(self._sup.loop, self)
        timeout = check_duration("wait(timeout=...)", timeout, allow_negative=True)
        if not self._sup.started:
            raise RuntimeError(f"{self!r} has not been started")
        finished = self._sup.finished
        if not finished.done():
            if timeout == 0:
                return None
            try:
                await asyncio.wait_for(asyncio.shield(finished), None if timeout < 0 else timeout)
            except asyncio.TimeoutError:
                return None
        await self.close(signal.SIGTERM)
        return self._sup.result()

    async def close(
        self,
        death_sig: int | None = None,
        timeout: float | None = None,
        *,
        grace_period: float | None = None,
    ) -> None:
        """Stop every worker: ``death_sig`` to each process group, then SIGKILL.

        Waits up to the grace period in total for the workers and what they
        left in their process groups to exit, then SIGKILLs the groups still
        alive (warning with ``ForcedKillWarning``) and reaps them with a
        bounded wait.  Output up to EOF reaches its sinks.  During ``start()``
        it stops the launch first.  Idempotent: a second ``close()`` (also
        from another task, or after a failure began the same stop) waits for
        the first to finish; its grace period can only cut the first one's
        short (``death_sig=SIGKILL``: kill now), as a second Ctrl-C does in
        ``aioproc run``.

        Args:
            death_sig: the graceful signal (default SIGTERM).
            timeout: torch's name for ``grace_period``.
            grace_period: seconds from ``death_sig`` to SIGKILL; default: the
                group's own ``grace_period``.

        Raises:
            TypeError: both ``timeout`` and ``grace_period`` are given.
            ValueError: a bad signal or duration, named in the message.

        Cancellation: the stop runs shielded and bounded in time; a
        cancellation arriving meanwhile is re-raised once it is done.
        """
        check_loop(self._sup.loop, self)
        sig = check_signal(signal.SIGTERM if death_sig is None else death_sig)
        if timeout is not None and grace_period is not None:
            raise TypeError(
                f"close() takes grace_period or timeout (torch's name for it), not both: "
                f"got grace_period={grace_period!r} and timeout={timeout!r}"
            )
        if timeout is not None:
            grace = check_duration("close(timeout=...)", timeout)
        elif grace_period is not None:
            grace = check_duration("close(grace_period=...)", grace_period)
        else:
            grace = self.grace_period
        handle_closed(self)
        await self._sup.close(sig, float(grace))

    async def aclose(self, *, grace_period: float | None = None) -> None:
        """Stop every worker and release the group: ``close()`` with SIGTERM.

        Args:
            grace_period: seconds from SIGTERM to SIGKILL; default: the
                group's own ``grace_period``.

        Cancellation: as ``close()``: shielded, bounded, then re-raised.
        """
        await self.close(grace_period=grace_period)


async def close_on_exit(pc: PContext, exc: BaseException | None) -> None:
    """Leaving ``async with``: a signal stops the workers with it."""
    sig: int | None = None
    if isinstance(exc, SignalException):
        sig = exc.sigval
    elif isinstance(exc, asyncio.CancelledError):
        sig = pending_signal()
    if sig is not None:
        pc._sup.stopping(sig)
    await pc.close(signal.SIGTERM if sig is None else sig)
