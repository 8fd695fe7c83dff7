"""The recorder's hooks, and the process-wide recorder the launcher reads.

The launcher imports this module and nothing else of the wing: it defines
``NullRecorder``, whose hooks do nothing, and ``current``, the recorder in
force (a ``NullRecorder`` until ``aioproc.metrics.enable()``).  A hot path
pays one attribute check while metrics are off::

    rec = hooks.current  # once, when a group (pool, agent) opens
    ...
    if rec.enabled:
        rec.output(name, role, "stdout", lines, nbytes)

It imports nothing (not even ``typing``), so importing it costs a launcher
nothing it would notice.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT",
    "NullRecorder",
    "OUTCOMES",
    "POOL_OUTCOMES",
    "STREAMS",
    "current",
    "outcome_of",
]

OUTCOMES = ("succeeded", "failed", "signalled", "stopped")
"""How a worker or a group ended: exit code 0; another exit code; killed by a
signal it was not sent by aioproc; stopped by aioproc (a close, a restart, a
cancellation)."""

POOL_OUTCOMES = ("succeeded", "failed", "broken", "timeout", "cancelled")
"""How a pool call ended: returned; raised; its worker died (``BrokenWorkerError``);
ran past ``timeout=``; its caller was cancelled."""

STREAMS = ("stdout", "stderr")
"""The output streams whose lines and bytes are counted."""


def outcome_of(returncode: int, *, stopped: bool = False) -> str:
    """The outcome label of a worker that exited with ``returncode``.

    Here, not with the ``Recorder``, so that the launcher imports nothing
    else of this wing (``aioproc.metrics.outcome_of`` is this function).

    Args:
        returncode: ``Popen.returncode``: the exit code, or minus the signal
            that killed it.
        stopped: aioproc stopped it (a close, restart or cancellation sent
            the signal).

    Returns:
        ``"succeeded"`` for 0, else ``"stopped"`` when aioproc stopped it,
        ``"signalled"`` for a signal it was not sent by aioproc,
        ``"failed"`` for another exit code.
    """
    if returncode == 0:
        return "succeeded"
    if stopped:
        return "stopped"
    return "signalled" if returncode < 0 else "failed"


class NullRecorder:
    """A recorder that records nothing: the process default until metrics are enabled.

    Its methods are the hooks the launcher calls; ``aioproc.metrics.Recorder``
    overrides every one of them.  ``enabled`` is the one attribute a hot path
    checks before it calls a hook, so that disabled metrics cost no call.

    Labels are bounded by design: ``group`` is the name given to
    ``start_processes`` (the agent's role), ``role`` the agent's role
    (``"default"`` for a plain group, torch's ``DEFAULT_ROLE``), ``stream``
    one of ``STREAMS`` and ``outcome`` one of ``OUTCOMES``; never a pid or a
    rank.
    """

    enabled: bool = False
    """True for a recorder that records; a hot path checks it before each hook."""

    def __repr__(self) -> str:
        return "<NullRecorder: metrics are off>"

    def group_started(self, group: str, role: str, seconds: float) -> None:
        """Every worker of a group has started.

        Call in the group's start (``PContext``'s start, the agent's attempt),
        once, after the last ``worker_started``; ``seconds`` runs from the
        moment the group had its ``Capacity`` slots (``group_queued``) to
        then, so a wait for slots is never counted as start time.  A group
        that fails to start calls neither this nor ``group_exited``.

        Args:
            group: the group's name.
            role: the agent's role, or ``"default"``.
            seconds: how long the start took.
        """

    def group_queued(self, group: str, role: str, seconds: float) -> None:
        """A group has its ``Capacity`` slots: its start begins.

        Call in the group's start, once, when its wait for slots is over
        (at once, ``seconds`` 0, without a ``Capacity``); a group whose
        wait is ended by a close or a cancellation calls nothing.

        Args:
            group: the group's name.
            role: the agent's role, or ``"default"``.
            seconds: how long the group waited for its slots.
        """

    def group_exited(self, group: str, role: str, outcome: str) -> None:
        """A started group is over, with its verdict.

        Call once for every ``group_started``, when the group's result is
        final (the first ``wait()``/``poll()`` that returns a result, or the
        close that stopped it).

        Args:
            group: the group's name.
            role: the agent's role, or ``"default"``.
            outcome: one of ``OUTCOMES``: ``"succeeded"`` when every worker
                exited 0, ``"stopped"`` when a close, restart or cancellation
                stopped it, else the outcome of its first failure.
        """

    def group_stopped(self, group: str, role: str, seconds: float) -> None:
        """A close that had workers to stop has finished.

        Call at the end of every stop that signalled at least one worker,
        whatever caused it: a ``close()`` (and the cleanup a cancelled
        ``async with`` runs), and the stop of the other ranks after a
        failure; ``seconds`` runs from the first signal to the last worker
        reaped, escalation to SIGKILL included.

        Args:
            group: the group's name.
            role: the agent's role, or ``"default"``.
            seconds: how long the stop took.
        """

    def worker_started(self, group: str, role: str) -> None:
        """A worker's process exists and is watched.

        Call where the group learns a worker's pid (its ``"started"``
        ``WorkerEvent``), once per worker start, restarts included.

        Args:
            group: the worker's group.
            role: the agent's role, or ``"default"``.
        """

    def worker_exited(self, group: str, role: str, outcome: str) -> None:
        """A started worker was reaped.

        Call where its exit is reported (its ``"exited"`` ``WorkerEvent``),
        once for every ``worker_started``.  ``outcome_of(returncode,
        stopped=...)`` gives the outcome.

        Args:
            group: the worker's group.
            role: the agent's role, or ``"default"``.
            outcome: one of ``OUTCOMES``.
        """

    def restarted(self, group: str, role: str, remaining: int | None = None) -> None:
        """The agent restarts a failed group.

        Call where the agent schedules a restart (its ``restart_scheduled``
        event), before the backoff.

        Args:
            group: the group's name.
            role: the agent's role.
            remaining: restarts left after this one (torch's
                ``remaining_restarts``); None leaves the gauge as it is.
        """

    def run_finished(self, group: str, role: str, outcome: str, restarts: int) -> None:
        """An agent's ``run()`` returned its result, after any restarts.

        Call once per ``LocalElasticAgent.run()``, where it returns (torch's
        ``_record_metrics``).

        Args:
            group: the group's name.
            role: the agent's role.
            outcome: ``"succeeded"``, ``"failed"`` or ``"stopped"`` (an
                ``agent.stop()`` or a signal).
            restarts: how many restarts the run used.
        """

    def output(self, group: str, role: str, stream: str, lines: int, nbytes: int) -> None:
        """A tee'd stream delivered lines to its sinks.

        Call where the tee splits a chunk it read from the pipe into lines
        (once per chunk, not per line); a final line without a newline
        counts when it is flushed at EOF.

        Args:
            group: the worker's group.
            role: the agent's role, or ``"default"``.
            stream: ``"stdout"`` or ``"stderr"``.
            lines: complete lines in the chunk.
            nbytes: bytes read from the pipe.
        """

    def backpressure(self, group: str, role: str, stream: str, seconds: float) -> None:
        """A stream's reading was paused because a consumer fell behind, and resumed.

        Call where the flow control resumes a paused transport (and where a
        paused transport is closed), with the time it stayed paused: the
        worker was blocked on its own pipe that long.

        Args:
            group: the worker's group.
            role: the agent's role, or ``"default"``.
            stream: ``"stdout"`` or ``"stderr"``.
            seconds: how long reading stayed paused.
        """

    def pool_call(self, pool: str, outcome: str, seconds: float) -> None:
        """A pool call (``submit``, or one worker's share of ``run``) finished.

        Call where the call's result (or error) reaches its caller;
        ``seconds`` runs from the call to then, waiting for an idle worker
        included.

        Args:
            pool: the pool's name (``open_pool(name=...)``).
            outcome: one of ``POOL_OUTCOMES``.
            seconds: the call's latency.
        """

    def capacity(self, name: str, total: int, in_use: int, waiting: int) -> None:
        """A ``Capacity`` changed: slots were taken or given back, or a request queued.

        Call from ``Capacity`` itself after each change, with its figures then.

        Args:
            name: the capacity's name (``Capacity(name=...)``).
            total: its slots.
            in_use: the slots held now.
            waiting: the requests waiting for slots now.
        """

    def rendezvous_round(self, role: str, backend: str, outcome: str, seconds: float) -> None:
        """A rendezvous round ended.

        Call where the agent's rendezvous returns or raises (torch's
        ``_rendezvous``), once per round, re-rendezvous after a membership
        change included.

        Args:
            role: the agent's role.
            backend: the rendezvous backend (``"c10d"``, ``"etcd"``, ``"static"``).
            outcome: ``"succeeded"`` or ``"failed"``.
            seconds: how long the round took.
        """


DEFAULT = NullRecorder()
"""The recorder in force while metrics are off."""

current: NullRecorder = DEFAULT
"""The process-wide recorder; set by ``aioproc.metrics.enable()`` and ``disable()``."""
