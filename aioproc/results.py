"""What a worker group reports: ``RunProcsResult``, ``WorkerEvent`` and ``Usage``.

Low in the house: the supervisor, the runner, the agent and the CLI all
import these; they import nothing of aioproc's but ``errors``.  ``Usage``
is defined here, not in ``_limits`` (which makes it from a reap), so that
the result can name it without importing the layer above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._errors.failure import ProcessFailure

__all__ = ["DEFAULT_GRACE_PERIOD", "RunProcsResult", "Usage", "WorkerEvent"]

DEFAULT_GRACE_PERIOD = 30.0
"""Seconds between ``death_sig`` and SIGKILL when a failure stops the group."""


@dataclass(frozen=True)
class Usage:
    """The resources one worker used, from its exit.

    Attributes:
        cpu_time: CPU seconds, user and system together.
        user_time: CPU seconds spent running the process's own code.
        system_time: CPU seconds the kernel spent working for it.
        max_rss: the kernel's peak resident set size for it
            (``ru_maxrss``), in bytes.  Linux carries a process's peak over
            into the program it execs, so for a worker started by ``exec``
            (a binary, a spawned function worker) this is at least the
            supervisor's own peak when it launched the worker, and a forked
            worker counts the pages it shares with its template.  A worker
            with a memory cgroup of its own (``limits=``) whose figure does
            not rise above the supervisor's own peak (so cannot be told
            from it) gets its cgroup's peak instead, which counts only
            what is the worker's.
        tree_cpu_time: CPU seconds of every process in its cgroup (the
            worker and all its descendants, reaped or not), or ``None``
            where no cgroup counted it.
        tree_max_memory: the most memory its cgroup held at once, in bytes
            (page cache included, as the kernel charges it), or ``None``.
        rss: in a live sample (a ``"sampled"`` event), the resident set
            size at that moment, in bytes; ``max_rss`` is then the peak since
            the worker's program started (``VmHWM``).  ``None`` in figures
            taken at exit.

    The process figures cover the worker and the descendants it waited for
    itself; ``max_rss`` is the largest of theirs, not a sum.
    """

    cpu_time: float
    user_time: float
    system_time: float
    max_rss: int
    tree_cpu_time: float | None = None
    tree_max_memory: int | None = None
    rss: int | None = None


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
        usage: ``{local_rank: Usage}``: what each worker used, read from its
            reap (``os.wait4``), on success and on failure alike; the tree
            figures are set where the rank had a cgroup of its own
            (``limits={rank: Limits(...)}``).  Every started rank is in it
            once the group is closed (an aioproc extension).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    log_dir: str = ""
    usage: dict[int, Usage] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class WorkerEvent(NamedTuple):
    """A worker started or exited, or the group is being stopped by a signal.

    ``kind`` is "started" (``exitcode`` None), "exited", or "stopping": a
    signal (``exitcode`` is minus its number) is about to stop the group,
    sent before any worker is signalled (``local_rank`` and ``pid`` are -1).
    A worker's "started" event comes before any sink sees a line of its
    output, however soon it prints; a worker whose start was abandoned
    before its event (a cancelled start) sends the sinks nothing.  The
    "exited" events of the workers a close stops come together once the
    stop is over; ``time`` is when each exit was noticed.

    An "exited" event also carries ``oom``, the kernel's OOM kill of the
    worker in words (``"killed by the kernel's OOM killer: memory limit 64
    MiB reached"``; ``None`` otherwise), and ``usage``, the worker's
    ``Usage``.  An exit noticed while the group still runs leaves its
    process a zombie until the group's last signal (a recycled pid is never
    signalled); its usage is read from the zombie where the system allows
    it (Linux on x86_64, aarch64, ppc64le and s390x) and is ``None``
    elsewhere.  ``RunProcsResult.usage`` has every rank's, from the reap.

    With ``sample_interval`` (``start_processes``), every running worker
    also gets a "sampled" event that often, its ``usage`` read from
    ``/proc`` then: CPU time so far, ``rss`` now and the peak since its
    program started.
    """

    kind: str  # "started" | "exited" | "stopping" | "sampled"
    local_rank: int
    pid: int
    exitcode: int | None
    time: float
    usage: Usage | None = None
    oom: str | None = None
