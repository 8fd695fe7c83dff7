"""What a worker group reports: ``RunProcsResult`` and ``WorkerEvent``.

Low in the house: the supervisor, the runner, the agent and the CLI all
import these; they import nothing of aioproc's but ``errors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._errors.failure import ProcessFailure

__all__ = ["DEFAULT_GRACE_PERIOD", "RunProcsResult", "WorkerEvent"]

DEFAULT_GRACE_PERIOD = 30.0
"""Seconds between ``death_sig`` and SIGKILL when a failure stops the group."""


@dataclass
class RunProcsResult:
    """Outcome of a worker group.

    Attributes:
        return_values: ``{local_rank: value}`` of the workers that succeeded
            (``None`` for binaries and for functions that ended via
            ``sys.exit(0)``).  When the group failed, the ranks that did
            succeed are still listed.
        failures: ``{local_rank: ProcessFailure}``; empty when all succeeded.
            A rank the group was closed before launching has ``pid == -1``,
            exit code 127 (as a shell reports a command it never ran; never
            a signal) and a message saying it was never started.
        stdouts: ``{local_rank: path}`` of stdout log files ("" if none).
        stderrs: ``{local_rank: path}`` of stderr log files ("" if none).
        log_dir: the run's log directory (``<log_dir>/<run_id>_<random>``)
            while it exists; ``""`` when none was made or, for a private temp
            dir, nothing worth keeping was written (an aioproc extension).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    log_dir: str = ""

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class WorkerEvent(NamedTuple):
    """A worker started or exited, or the group is being stopped by a signal.

    ``kind`` is "started" (``exitcode`` None), "exited", or "stopping": a
    signal (``exitcode`` is minus its number) is about to stop the group,
    sent before any worker is signalled (``local_rank`` and ``pid`` are -1).
    The "exited" events of the workers a close stops come together once
    the stop is over; ``time`` is when each exit was noticed.
    """

    kind: str  # "started" | "exited" | "stopping"
    local_rank: int
    pid: int
    exitcode: int | None
    time: float
