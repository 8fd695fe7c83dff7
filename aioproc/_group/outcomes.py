"""What a group reports: each rank's value or failure, and when all are in.

``Outcomes`` collects the control frames a function worker sends (its
RESULT or ERROR), turns an exit into a return value or a ``ProcessFailure``
(with the reasons aioproc knows better than the exit code: a lost status, a
broken control channel, a log file that could not be written), and resolves
``finished`` once every rank has an outcome.  The supervisor decides what to
do about a failure; this module only records it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from .._child.channel import ERROR, RESULT, decode_value
from .._errors.failure import ProcessFailure
from .._func.boot import rebuild_exception
from .._proc.spawn import Child
from ..results import RunProcsResult


def _remote_message(exc: BaseException, timestamp: int) -> dict[str, Any]:
    """torch's ``@record`` message layout, built from a reported exception."""
    cause = exc.__cause__
    return {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {
            "py_callstack": str(cause) if cause is not None else f"{type(exc).__name__}: {exc}",
            "timestamp": str(timestamp),
        },
    }


NEVER_STARTED = 127
"""Exit code of a rank the group was closed before launching (pid -1): what a
shell reports for a command it could not run; never a signal."""


class Outcomes:
    """The per-rank outcomes of one group (see the module docstring)."""

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self.values: dict[int, Any] = {}
        self.failures: dict[int, ProcessFailure] = {}
        self.remote: dict[int, BaseException] = {}
        self._results: dict[int, bytearray] = {}
        self._errors: dict[int, bytearray] = {}
        self.finished: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Called on the loop when the group starts."""
        self.finished = asyncio.get_running_loop().create_future()

    def frame_handler(self, rank: int) -> Callable[[int, bytearray], None]:
        def on_frame(kind: int, body: bytearray) -> None:
            if kind == RESULT:
                self._results[rank] = body
            elif kind == ERROR:
                self._errors[rank] = body

        return on_frame

    def has(self, rank: int) -> bool:
        return rank in self.values or rank in self.failures

    def record(
        self,
        rank: int,
        child: Child,
        code: int,
        error_file: str,
        failure: ProcessFailure | None = None,
        logs: tuple[str, str] = ("", ""),
    ) -> bool:
        """Record ``rank``'s exit; True if it is a failure.

        ``logs`` are the rank's stdout and stderr log paths (``""``: none),
        named in the failure so the summary points at them.
        """
        value: Any = None
        problem = ""
        # A function worker whose result came waits for its peers' (see
        # ``_child.boot``); a stop that ends that wait by its signal ends a
        # worker that had returned: its value stands.
        returned = code == 0 or (child.stop_requested and rank in self._results)
        if child.watcher.lost:
            problem = (
                f"exit status lost: process {child.pid} was reaped by somebody else's "
                "waitpid() in this process (a SIGCHLD handler or a child watcher reaping "
                "every child?), so how it ended is unknown"
            )
        elif returned and rank in self._results:
            try:
                value = decode_value(self._results.pop(rank))
            except Exception as e:
                problem = f"return value could not be unpickled in the supervisor: {e!r}"
        if returned and not problem:
            self.values[rank] = value
            self.check_finished()
            return False
        failure = failure or ProcessFailure(
            local_rank=rank,
            pid=child.pid,
            exitcode=code,
            error_file=error_file,
            stopped=child.stop_requested,
        )
        if problem:
            failure.message = problem
        elif child.channel is not None and child.channel.error is not None:
            failure.message = str(child.channel.error)  # why the worker was ended
        lost = [t.write_error for t in child.tees if t.write_error is not None]
        if lost and isinstance(failure.message, str):
            failure.message += f" (its log file could not be written: {lost[0]})"
        failure.stdout_log, failure.stderr_log = (p if p != os.devnull else "" for p in logs)
        self.failures[rank] = failure
        body = self._errors.pop(rank, None)
        remote = rebuild_exception(body) if body is not None else None
        if remote is not None:
            self.remote[rank] = remote
            no_file = failure.error_file_data.get("message", "<NONE>") == "<NONE>"
            if not problem and no_file and failure.exitcode >= 0:
                # no error file (none asked for, e.g. log_dir=os.devnull, or the
                # worker could not write it): the channel told us what happened
                failure.message = _remote_message(remote, failure.timestamp)
        self.check_finished()
        return True

    def fallback(self, rank: int, child: Child, code: int) -> None:
        """An outcome for a rank whose recording failed (a bug): never leave it open."""
        if not self.has(rank):
            self.failures[rank] = ProcessFailure(rank, child.pid, code, "")
            self.check_finished()

    def never_started(self, rank: int) -> None:
        failure = ProcessFailure(rank, -1, NEVER_STARTED, "", stopped=True)
        failure.message = (
            f"local rank {rank} was never started: the group was closed while it was being launched"
        )
        self.failures[rank] = failure
        self.check_finished()

    def unkillable(self, rank: int, child: Child, error_file: str) -> None:
        failure = ProcessFailure(rank, child.pid, -9, error_file, stopped=True)
        failure.message = (
            f"process {child.pid} did not exit after SIGKILL (uninterruptible sleep?); "
            "it is still running and will be reaped when it exits"
        )
        self.failures[rank] = failure
        self.check_finished()

    def check_finished(self) -> None:
        done = len(self.values) + len(self.failures)
        if done == self.nprocs and self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    def result(
        self, stdouts: dict[int, str], stderrs: dict[int, str], log_dir: str = ""
    ) -> RunProcsResult:
        return RunProcsResult(
            return_values=dict(sorted(self.values.items())),
            failures=dict(sorted(self.failures.items())),
            stdouts=dict(stdouts),
            stderrs=dict(stderrs),
            log_dir=log_dir,
        )
