"""One launch: a ``LaunchConfig`` and an entrypoint, run by ``LocalElasticAgent`` on this loop.

``Launch`` reads everything first: the config's fields (``check_config``),
then ``aioproc run``'s meaning of them (``flags.config_flags`` and the
functions of ``_cli.run``): the start method, the grace period, the
signals the workers are told about, the NUMA binding, the rendezvous
handler (None: this host alone), the ``WorkerSpec`` and the agent.  Bad
input raises there, before anything starts.  ``run()`` then runs the
agent and gives torch's outcome: the return values by rank, or
``ChildFailedError`` naming the failed ranks.

The blocking forms (``_launch.blocking``) run this same ``Launch`` on a
loop of their own.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._cli.devices import bind
from .._cli.run import (
    _event_log,
    _grace_period,
    _handled_signals,
    _make_rdzv_handler,
    _numa,
    _start_method,
)
from .._cli.torchrun import event_handler
from .._cli.values import SIGNALS_ENV
from .._errors.summary import ChildFailedError
from ..agent import LocalElasticAgent, RunResult, WorkerSpec
from ..agent import events as ev
from ..rendezvous.api import RendezvousError
from .config import LaunchConfig, check_config, entrypoint_name
from .flags import config_flags

if TYPE_CHECKING:
    import signal

    from .._cli.torchrun import EventLog
    from ..agent import AgentEvent

__all__ = ["Launch", "launch"]

logger = logging.getLogger("aioproc.launcher")


async def launch(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, *args: Any
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``config.nproc_per_node`` workers of this node; their values.

    The awaitable form of torch's ``elastic_launch(config, entrypoint)(*args)``:
    the same config, entrypoints and outcome, on the running loop.  A
    function runs in function workers (its return value comes back); a
    ``str`` is a program run with ``args`` as its command line
    (``sys.executable`` and a script path: a Python script).  Each worker
    gets torchrun's environment; the group restarts after a failure while
    ``config.max_restarts`` allow.  With ``config.max_nodes > 1`` the node
    meets the others through ``config.rdzv_backend`` first.

    No signal handler is installed: wrap the call in
    ``aioproc.translate_signals()`` to stop the workers on a signal (the
    blocking forms do so in the main thread, with
    ``config.signals_to_handle``).

    Args:
        config: the launch (checked before anything starts; a ``run_id`` of
            ``""`` is replaced by a random one, written back to it).
        entrypoint: a function, or a program.
        *args: the entrypoint's arguments (``"${local_rank}"`` in a string
            becomes the worker's local rank).

    Returns:
        Each worker's return value by global rank (its local rank on one
        node); ``None`` for a program's workers.

    Raises:
        ChildFailedError: the workers failed after the restarts; its
            summary names every failed rank, the first failure first.
        RendezvousError: the node could not join the job (a timeout, a
            store out of reach, a job found closed), or lost it.
        TypeError, ValueError: a bad config field or entrypoint (the
            message names it); nothing was started.
        SignalException: inside ``translate_signals``, a signal arrived;
            the workers were stopped with it first.

    Cancellation: the workers are stopped (their stop signal, then SIGKILL
    after ``config.shutdown_timeout``; shielded and bounded) and the
    rendezvous left before the cancellation propagates; no process, fd or
    temp dir of the launch is left.
    """
    return await Launch(config, entrypoint, args).run()


class Launch:
    """One launch of ``entrypoint(*args)`` as ``config`` describes it; built, not yet started.

    Raises:
        TypeError, ValueError: what ``launch`` raises for bad input.
    """

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str | None,
        args: tuple[Any, ...],
    ) -> None:
        check_config(config)
        if not callable(entrypoint) and not isinstance(entrypoint, str):
            # torch's signature allows None; there is nothing to run then
            raise TypeError(f"entrypoint must be a function or a program, got {entrypoint!r}")
        run_id = config.run_id or str(uuid.uuid4().int)
        flags = config_flags(config, function=callable(entrypoint))
        flags.run_id = run_id
        event_handler(config.event_log_handler)  # an unknown name fails here, not once running
        self.name = entrypoint_name(entrypoint, args)
        self.signals: tuple[signal.Signals, ...] = _handled_signals(flags)
        self._flags = flags
        self._numa, self._notes = _numa(flags)
        spec = WorkerSpec(
            role=config.role,
            local_world_size=config.nproc_per_node,
            entrypoint=entrypoint,
            args=tuple(args),
            max_restarts=config.max_restarts,
            monitor_interval=config.monitor_interval,
            master_addr=flags.master_addr,
            master_port=flags.master_port,
            duplicate_stdout_filters=config.duplicate_stdout_filters or None,
            duplicate_stderr_filters=config.duplicate_stderr_filters or None,
            # torch exports the list it handles; the workers see the same variable
            env={SIGNALS_ENV: ",".join(sig.name for sig in self.signals)},
            rdzv_handler=_make_rdzv_handler(flags),
            virtual_local_rank=config.virtual_local_rank,
        )
        self._agent = LocalElasticAgent(
            spec,
            config.logs_specs,
            _start_method(flags),
            log_line_prefix_template=config.log_line_prefix_template,
            grace_period=_grace_period(flags),
            run_id=run_id,
            on_event=self._on_event,
        )
        self._event_log: EventLog | None = None
        self._attempt = 0
        if not config.run_id:  # torch's: the config names the id it ran with
            config.run_id = run_id
            logger.warning("config has no run_id, generated a random run_id: %s", run_id)

    def __repr__(self) -> str:
        return f"<Launch {self.name} {self._agent!r}>"

    async def run(self) -> dict[int, Any]:
        """Run the agent; the return values by global rank (see ``launch``).

        Cancellation: as ``launch``'s.
        """
        for note in self._notes:
            logger.warning("numa_options %s: %s", self._flags.numa_binding, note)
        agent = self._agent
        self._event_log = event_log = _event_log(self._flags)
        try:
            try:
                result = await agent.run()
            except BaseException as e:
                if event_log is not None:  # torch's agent FAILED: its run raised
                    event_log.failed(agent.get_worker_group(), agent.run_id, self._attempt, e)
                raise
            if event_log is not None:  # torch's agent SUCCEEDED: its run returned
                event_log.finished(agent.get_worker_group(), agent.run_id, self._attempt, result)
        finally:
            if event_log is not None:
                event_log.close()
        return self._outcome(result)

    def _outcome(self, result: RunResult) -> dict[int, Any]:
        if not result.is_failed():
            return dict(result.return_values)
        if result.failures:
            raise ChildFailedError(
                self.name, result.failures, result.log_dir, host=result.host or None
            )
        # no worker of this node failed: the rendezvous ended the job
        raise RendezvousError(result.message or f"{self.name}: the job failed on another node")

    def _on_event(self, event: AgentEvent) -> None:
        if event.kind == ev.ATTEMPT_STARTED:
            self._attempt = event.attempt
        elif event.kind == ev.WORKER_STARTED and event.pid is not None:
            cpus = self._numa.get(event.local_rank if event.local_rank is not None else -1)
            if cpus is not None:
                bind(event.pid, cpus)  # numa_options, before the worker gets far
        if self._event_log is not None:
            agent = self._agent
            self._event_log.on_event(event, agent.get_worker_group(), agent.run_id)
