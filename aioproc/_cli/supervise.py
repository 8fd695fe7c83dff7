"""Running one ``aioproc run``: the event loop, the agent, the signals, job control.

``_run_command`` makes the run, sets up the log and SIGHUP, and runs
``_supervise`` on the loop ``AIOPROC_LOOP`` names.  ``_supervise`` serves
the metrics for the run's duration (``--metrics-port``), runs the agent
under ``translate_signals`` and ``follow_job_control``, with the live view
when there is one, and turns the result into the exit status (0, 1, 2 or
128 + a signal) and its messages.  ``_Stopper`` answers each
terminating signal: the first stops the workers gracefully, a second kills
them now.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import TYPE_CHECKING, Any

from .report import (
    _configure_logging,
    _error,
    _log_event,
    _one_line,
    _print_stderr,
    _run_log_dir,
    _show_on,
    _where_the_logs_are,
    logger,
)
from .run import _make_run, _Run
from .values import PROG

if TYPE_CHECKING:
    from ..agent import AgentEvent, LocalElasticAgent, RunResult
    from ..results import Usage
    from .live import LiveView

LOOP_ENV = "AIOPROC_LOOP"


async def _supervise(run: _Run) -> int:
    """Serve the metrics if asked, run the agent; return the exit status.

    With ``--metrics-port``, metrics are enabled (the agent, its groups and
    their output record into the process-wide recorder) and served from
    before the first worker starts until the run is over.  An address that
    cannot be listened on is a usage error (2): nothing was started.

    Cancellation: the agent stops the workers (shielded, bounded) before the
    cancellation propagates; the metrics server is closed after them.
    """
    if run.metrics is None:
        return await _run_agent(run)
    from .. import metrics

    host, port = run.metrics
    enabled_here = not metrics.is_enabled()
    metrics.enable()
    try:
        try:
            server = await metrics.serve(host, port)
        except OSError as e:
            _print_stderr(
                f"{PROG} run: error: --metrics-port {port}: cannot listen on "
                f"{host}:{port}: {e.strerror or e}"
            )
            return 2
        try:
            if port == 0:
                _print_stderr(f"{PROG} run: metrics at {server.url}")
            return await _run_agent(run)
        finally:
            await server.aclose()
    finally:
        if enabled_here:
            metrics.disable()


async def _run_agent(run: _Run) -> int:
    """Run the agent; return the exit status.

    Cancellation: the agent stops the workers (shielded, bounded) before the
    cancellation propagates.
    """
    from .._func.template import TemplateError
    from .._proc.jobcontrol import follow_job_control
    from ..agent import LocalElasticAgent
    from ..agent import events as ev
    from ..errors import ChildFailedError, RemoteTraceback
    from ..signals import SignalException, translate_signals
    from .devices import bind

    view: LiveView | None = None
    if run.live:
        from .live import LiveView

        view = LiveView(
            run.spec.role, run.spec.local_world_size, run.spec.max_restarts, title=run.name
        )
        say: Callable[[str], None] = view.note
        show_event: Callable[[AgentEvent], None] = _show_on(view)
    else:
        say = _print_stderr
        show_event = _log_event
    attempt = 0

    def on_event(event: AgentEvent) -> None:
        nonlocal attempt
        if event.kind == ev.ATTEMPT_STARTED:
            attempt = event.attempt
            stopper.started = True
        if event.kind == ev.WORKER_STARTED and event.pid is not None:
            cpus = run.numa.get(event.local_rank if event.local_rank is not None else -1)
            if cpus is not None:
                bind(event.pid, cpus)  # --numa-binding, before the worker gets far
        show_event(event)
        if run.event_log is not None:
            run.event_log.on_event(event, agent.get_worker_group(), agent.run_id)
        if run.show_log_dir and event.kind == ev.WORKER_STARTED and event.local_rank == 0:
            run_dir = _run_log_dir(run.logs_specs)
            if run_dir is not None and event.attempt == 0:
                say(f"{PROG} run: logs in {run_dir}")

    agent = LocalElasticAgent(
        run.spec,
        run.logs_specs,
        run.start_method,
        log_line_prefix_template=run.log_line_prefix_template,
        grace_period=run.grace_period,
        run_id=run.run_id,
        sinks=[view] if view is not None else None,
        on_event=on_event,
    )
    stopper = _Stopper(agent, run.grace_period, say)
    for note in run.notes:
        say(f"{PROG} run: {note}")
    try:
        try:
            if view is not None:
                view.start()
            with follow_job_control():
                async with translate_signals(run.signals, on_signal=stopper.on_signal):
                    result = await agent.run()
        except BaseException as e:
            if run.event_log is not None:  # torch's agent FAILED: its run raised
                run.event_log.failed(agent.get_worker_group(), agent.run_id, attempt, e)
            raise
        else:
            if run.event_log is not None:  # torch's agent SUCCEEDED: its run returned
                run.event_log.finished(agent.get_worker_group(), agent.run_id, attempt, result)
            if view is not None:
                view.show_usage(_usage_by_local_rank(agent, result))
        finally:
            await stopper.aclose()
            if view is not None:
                view.stop()  # before anything else is printed
            if run.event_log is not None:
                run.event_log.close()
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        if stopper.started:
            _error(f"got {sig.name}: the workers were stopped")
        else:  # still connecting to the rendezvous, or joining it
            _error(f"got {sig.name}: stopped before any worker started")
        return 128 + int(sig)
    except OSError as e:  # a --no-python binary that cannot be run, an unusable --log-dir
        _error(str(e))
        return 1
    except (ImportError, TemplateError) as e:  # --preload failed in the template
        if isinstance(e.__cause__, RemoteTraceback):
            _print_stderr(e.__cause__.tb.rstrip())  # the template's traceback
        _error(str(e))
        return 1
    if not result.is_failed():
        if result.message and run.spec.rdzv_handler is not None:
            _error(result.message)  # e.g. a late joiner: the job already finished
        if result.log_dir and not run.show_log_dir:
            # a private temp dir that holds output: say where, or it is litter
            _error(f"logs of this run kept in {result.log_dir}")
        return 0
    if result.message:
        _error(result.message)
    if result.failures:
        failure = ChildFailedError(
            run.name, result.failures, result.log_dir, host=result.host or None
        )
        summary = failure.format_msg()
        _print_stderr(summary)
        rank, root = failure.get_first_failure()
        for line in _where_the_logs_are(run.logs_specs, attempt, rank, root.local_rank, summary):
            _error(line)
    return 1


def _usage_by_local_rank(agent: LocalElasticAgent, result: RunResult) -> dict[int, Usage]:
    """``result.usage`` (keyed by global rank) keyed by local rank, as the live view's rows are."""
    local = {w.global_rank: w.local_rank for w in agent.get_worker_group().workers}
    return {local[rank]: usage for rank, usage in result.usage.items() if rank in local}


class _Stopper:
    """What the command does on each terminating signal.

    The first one stops the workers gracefully (``translate_signals``
    cancels the agent's run, which stops them with that signal); this says
    so.  A second one kills them now, skipping the rest of the grace period.
    """

    def __init__(
        self, agent: LocalElasticAgent, grace_period: float, say: Callable[[str], None]
    ) -> None:
        self._agent = agent
        self._grace_period = grace_period
        self._say = say
        self._received = 0
        self._kill: asyncio.Task[None] | None = None
        self.started = False  # whether a worker group was started: what a signal stops

    def on_signal(self, sig: signal.Signals) -> None:
        self._received += 1
        if self._received == 1 and not self.started:
            self._say(f"{PROG} run: got {sig.name}: stopping (no worker was started)")
        elif self._received == 1:
            again = "Ctrl-C again" if sig == signal.SIGINT else "a second signal"
            self._say(
                f"{PROG} run: got {sig.name}: stopping the workers (SIGKILL in "
                f"{self._grace_period:g} s; {again} kills them now)"
            )
        elif self._kill is None and self.started:  # with no worker, the first one ends it all
            self._say(
                f"{PROG} run: got {sig.name} again: killing the workers now with SIGKILL, "
                f"without waiting out the {self._grace_period:g} s grace period"
            )
            self._kill = asyncio.get_running_loop().create_task(
                self._agent.stop(signal.SIGKILL, 0.0), name="aioproc-run-kill-now"
            )

    async def aclose(self) -> None:
        """Wait for the kill, if one was asked (it ends with the agent's run)."""
        if self._kill is not None:
            await self._kill


def _ignore_signal(signum: int, frame: FrameType | None) -> None:
    """A handler that does nothing.

    Unlike SIG_IGN, a caught signal is reset to its default across exec, so
    the workers keep the default disposition.
    """


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``AIOPROC_LOOP`` names (``None``: asyncio's default).

    Raises:
        ValueError: an unknown name, or uvloop is not installed.
    """
    choice = os.environ.get(LOOP_ENV, "").strip().lower()
    if choice in ("", "asyncio"):
        return None
    if choice != "uvloop":
        raise ValueError(f"{LOOP_ENV} must be 'asyncio' or 'uvloop', got {choice!r}")
    try:
        import uvloop
    except ImportError:
        raise ValueError(
            f"{LOOP_ENV}=uvloop but uvloop is not installed (pip install 'aioproc[uvloop]')"
        ) from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _run_loop(
    coro: Coroutine[Any, Any, int], factory: Callable[[], asyncio.AbstractEventLoop] | None
) -> int:
    """``asyncio.run(coro)``, on a loop from ``factory`` if given."""
    if factory is None:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    loop = factory()  # pragma: no cover - Python 3.10 has no asyncio.Runner
    try:  # pragma: no cover
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:  # pragma: no cover
        asyncio.set_event_loop(None)
        loop.close()


def _run_command(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Make the run from ``ns`` and run it; return the exit status.

    Flags that do not make a run are usage errors, reported on ``parser``
    (``SystemExit`` 2).
    """
    try:
        run = _make_run(ns)
        factory = _loop_factory()
    except (TypeError, ValueError, OSError) as e:
        parser.error(str(e))
    restore_logging = _configure_logging()
    previous_hup: Any = None
    if signal.SIGHUP not in run.signals:
        previous_hup = signal.signal(signal.SIGHUP, _ignore_signal)
    try:
        return _run_loop(_supervise(run), factory)
    except (TypeError, ValueError) as e:
        # Bad input found only as the workers are about to start (an argv and
        # environment too big for exec, say): a usage error, told in one line.
        # Nothing was started.  LOGLEVEL=DEBUG shows the traceback.
        logger.debug("aioproc run stopped by an error", exc_info=True)
        _print_stderr(f"{PROG} run: error: {_one_line(str(e))}")
        return 2
    finally:
        if previous_hup is not None:
            signal.signal(signal.SIGHUP, previous_hup)
        restore_logging()
