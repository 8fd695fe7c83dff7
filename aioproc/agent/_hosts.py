"""The agent's side of a run over several hosts: ``Hosts``, one per run.

Over several hosts (``spec.rdzv_handler``), ``LocalElasticAgent.run`` asks
its ``Hosts`` at each step of the restart loop: ``open()`` connects and
takes the lease before the first attempt (its renewals move the lease
fence), ``join()`` starts each attempt with a rendezvous round that gives
the host its group rank and the world, and the attempt runs inside
``fenced()``.  While the workers run, ``stop_on_change()`` races the group
with the handler's ``wait_for_change()``: a host lost, arriving or
re-joining stops the workers and starts a new round, a lost lease
(fencing) stops them within the lease's TTL, another host's final failure
ends the run with that root cause.  After an attempt, ``exit_barrier()``
(success), ``change_in_flight()`` (a failure) and ``report_failure()`` (the
last failure) speak for this host to the others; ``outcome()`` turns what
the rendezvous said into the run's end (a ``RunEnd``) or a world change to
re-join after.  ``aclose()`` ends the session; a stop closes the rendezvous
for every host.

With one host (no handler) every step is a no-op that returns at once,
without yielding to the loop: only the fence's scope is entered, and the
fence, never renewed, is never armed.

The agent keeps the decisions that are the restart loop's: how a run ends
(``RunEnd`` is what it finishes the run with), and the restart a lost host
costs.  This module does not import ``local``: it hears of the agent
through the ``publish`` and ``stopping`` callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._base.shield import shielded
from .._errors.failure import ProcessFailure
from .._proc import lifeline as _lifeline
from . import events as ev
from .spec import WorkerState

if TYPE_CHECKING:
    from .._metrics.hooks import NullRecorder
    from ..context import PContext
    from ..rendezvous import RendezvousError, RendezvousHandler, RendezvousInfo, WorldChange

__all__ = ["FAILURE_SETTLE", "Hosts", "Publish", "RunEnd"]

logger = logging.getLogger("aioproc")

FAILURE_SETTLE = 1.0
"""Seconds a failed attempt on several hosts waits for a world change in flight.

When another host stops its workers for a new round, a worker here that was
talking to them can fail before this host's watch delivers the same change;
such a failure is the change's doing and must not spend a restart."""


class Publish(Protocol):
    """The agent's ``_publish``: publish an ``AgentEvent`` of ``kind`` with ``fields``."""

    def __call__(self, kind: str, **fields: Any) -> None: ...


@dataclass
class RunEnd:
    """The run's end as the rendezvous decides it; the agent finishes the run with it.

    Attributes:
        state: the run's final state.
        message: why (the rendezvous error's text), or ``""``.
        failures: another host's root cause, keyed by global rank; no
            return values: such an end never follows a successful attempt.
    """

    state: WorkerState
    message: str = ""
    failures: dict[int, Any] = field(default_factory=dict)


class Hosts:
    """The multi-host coordination of one ``LocalElasticAgent.run``.

    Args:
        handler: ``spec.rdzv_handler``; None: one host, every step a no-op.
        publish: the agent's ``_publish`` (rendezvous events).
        stopping: whether ``stop()`` has asked for the run's end.
        grace_period: the agent's seconds between SIGTERM and SIGKILL.
        exit_barrier_timeout: how long a host whose workers succeeded waits
            for the other hosts' workers before it closes the job.
        recorder: the metrics recorder each rendezvous round is counted in
            (``rendezvous_round``); None: metrics are off.
        role: the agent's role, the rounds' ``role`` label.
    """

    def __init__(
        self,
        handler: RendezvousHandler | None,
        publish: Publish,
        stopping: Callable[[], bool],
        *,
        grace_period: float,
        exit_barrier_timeout: float,
        recorder: NullRecorder | None = None,
        role: str = "default",
    ) -> None:
        self.handler = handler
        self._recorder = recorder
        self._role = role
        self._publish = publish
        self._stopping = stopping
        self._grace_period = grace_period
        self._exit_barrier_timeout = exit_barrier_timeout
        # set when the rendezvous ends the current attempt (a world change, or an error)
        self.world_change: WorldChange | RendezvousError | None = None
        self._failed_host = ""  # the host whose failure ended a run over several hosts
        self._rdzv_scope: anyio.CancelScope | None = None  # while joining a rendezvous
        self._session = contextlib.AsyncExitStack()
        # The lease fence kept by the guardian, not by the agent's loop: the
        # workers die by the end of the fence's grace period even while this
        # process is stopped, starved or wedged, before etcd can expire the
        # lease and the other hosts re-form without this one.  The guardian
        # hears of a renewal once it moved the deadline by a grace period (every
        # renewal, when renewals are further apart): it never fences before
        # the loop would (at the deadline itself).
        self._fence = _lifeline.Fence()

    def __repr__(self) -> str:
        return f"<Hosts {self.handler!r}>"

    # ------------------------------------------------------------ the session

    async def open(self, local_world_size: int, role: str) -> RunEnd | None:
        """Open the handler's session for the run; the run's end if it does not open.

        The session publishes ``local_world_size`` and ``role`` with each
        join: every host assigns ranks from them (``RendezvousInfo``).
        Every renewal of the session's lease moves the fence's deadline.  A
        store not reached within the join timeout ends the run (FAILED,
        with the handler's one-line reason); a stop while connecting ends
        it at once (STOPPED).  With one host: nothing to open.

        Cancellation: propagates; ``aclose()`` closes the session once it
        is open.
        """
        handler = self.handler
        if handler is None:
            return None
        fence = self._fence

        def renewed(deadline: float, grace: float = handler.fence_grace) -> None:
            fence.renew(deadline + grace, lag=grace)

        session: contextlib.AbstractAsyncContextManager[Any] = handler.session(
            local_world_size, renewed, role=role
        )
        from ..rendezvous import RendezvousError

        try:
            # stop() cancels this scope, as it does a rendezvous
            with anyio.CancelScope() as self._rdzv_scope:
                await self._session.enter_async_context(session)
        except RendezvousError as e:
            return RunEnd(WorkerState.FAILED, str(e))
        finally:
            self._rdzv_scope = None
        if self._stopping():
            return RunEnd(WorkerState.STOPPED)
        return None

    def cancel_join(self) -> None:
        """Cut the session's opening or a rendezvous round short (for ``stop()``)."""
        if self._rdzv_scope is not None:
            self._rdzv_scope.cancel()

    async def aclose(self, stopped: bool) -> None:
        """Disarm the fence and end the session; ``stopped``: close the job on every host.

        Cancellation: shielded and bounded (revoking the lease and closing
        the connection time out).
        """
        self._fence.close()
        handler = self.handler
        if handler is not None:
            if stopped:
                # a stop (signal, stop(), cancellation) closes the job on every host
                await shielded(handler.shutdown())
            # bounded: revoking the lease and closing the connection time out
            with anyio.CancelScope(shield=True):
                await self._session.aclose()

    # ------------------------------------------------------------ an attempt

    async def join(self) -> RendezvousInfo | RunEnd | None:
        """The next round's info, or the run's end (a stop, or the rendezvous failed).

        With one host: None, at once.
        """
        handler = self.handler
        if handler is None:
            return None
        from ..rendezvous import RendezvousError, RendezvousGracefulExitError

        self._publish(ev.RENDEZVOUS_STARTED, message=f"joining the rendezvous of {handler!r}")
        info: RendezvousInfo | None = None
        began = time.monotonic()
        try:
            # stop() cancels this scope: a stop during the rendezvous ends the run at once
            with anyio.CancelScope() as self._rdzv_scope:
                if not self._stopping():
                    info = await handler.next_rendezvous()
        except RendezvousGracefulExitError as e:
            # the job finished while this node waited for a round: nothing left to do
            self._count_round("failed", began)
            return RunEnd(WorkerState.SUCCEEDED, str(e))
        except RendezvousError as e:
            # a job found closed on arrival ran nothing here: no success (torchrun exits 1 too)
            self._count_round("failed", began)
            return RunEnd(WorkerState.FAILED, str(e))
        finally:
            self._rdzv_scope = None
        if info is None:
            return RunEnd(WorkerState.STOPPED)  # a stop cut the round short: no round to count
        self._count_round("succeeded", began)
        self._publish(
            ev.RENDEZVOUS_COMPLETED,
            message=f"round {info.round}: group rank {info.group_rank} of "
            f"{info.group_world_size} nodes, world size {info.world_size}",
        )
        return info

    def _count_round(self, outcome: str, began: float) -> None:
        """Count a round that returned or raised (torch's ``_rendezvous`` metrics)."""
        if self._recorder is not None and self.handler is not None:
            backend = self.handler.get_backend()
            self._recorder.rendezvous_round(self._role, backend, outcome, time.monotonic() - began)

    def fenced(self) -> contextlib.AbstractContextManager[None]:
        """The scope of an attempt: the worker groups started in it join the lease fence."""
        return self._fence.scope()

    async def stop_on_change(self, pc: PContext, errors: list[Exception]) -> None:
        """When the world changes, keep the change in ``world_change`` and stop ``pc``.

        A task of the attempt's task group, started only over several
        hosts.  A lost lease (fencing) cuts the grace period to the
        handler's ``fence_grace``.  An error of the close goes into
        ``errors`` (surfaced by ``run()``, outside the task group).

        Cancellation: the wait ends with nothing stopped; a close already
        under way is shielded (``PContext.close``) and finishes.
        """
        from ..rendezvous import RendezvousError, RendezvousLeaseLostError

        handler = self.handler
        assert handler is not None
        change: WorldChange | RendezvousError
        try:
            change = await handler.wait_for_change()
        except RendezvousError as e:
            change = e
        self.world_change = change
        # fenced: the workers must be gone before the lease expires in etcd
        grace = self._grace_period
        if isinstance(change, RendezvousLeaseLostError):
            grace = min(grace, handler.fence_grace)
        try:
            await pc.close(signal.SIGTERM, grace)
        except Exception as e:  # surfaced by run(), outside the task group
            errors.append(e)

    # --------------------------------------------------------- after an attempt

    async def exit_barrier(self) -> WorldChange | RendezvousError | None:
        """Wait for the other hosts' workers; a change if the world re-forms meanwhile.

        Any other error of the barrier (the store gone, a bug) is logged
        with its traceback and the barrier counts as passed, as torch's
        ``_exit_barrier`` does: this host's workers succeeded, and a failed
        wait for the others must not turn that into a failure.  A signal
        (``SignalException``) still ends the run.  With one host: None, at
        once.

        Cancellation: propagates (the wait for the other hosts ends).
        """
        handler = self.handler
        if handler is None:
            return None
        from ..rendezvous import RendezvousError

        try:
            return await handler.exit_barrier(self._exit_barrier_timeout)
        except RendezvousError as e:
            return e
        except Exception as e:
            if type(e).__name__ == "SignalException":
                raise  # a signal ends the run, as in torch
            logger.exception("exit barrier failed; this host's workers succeeded all the same")
            return None

    async def change_in_flight(self) -> WorldChange | RendezvousError | None:
        """A world change that arrives within ``FAILURE_SETTLE`` of a failed attempt.

        With one host or a fixed world (a backend that is not ``elastic``):
        None, at once.
        """
        handler = self.handler
        if handler is None or not handler.elastic:
            return None
        from ..rendezvous import RendezvousError

        try:
            with anyio.move_on_after(FAILURE_SETTLE):
                return await handler.wait_for_change()
        except RendezvousError as e:
            return e
        return None

    async def report_failure(self, rank: int, failure: Any) -> None:
        """Tell every host this host's root cause, which ends the run (no-op with one host)."""
        handler = self.handler
        if handler is None:
            return
        from ..rendezvous import RendezvousError

        try:
            await handler.report_failure(_failure_record(rank, failure))
        except RendezvousError as e:  # fenced meanwhile: the others see the lost lease
            logger.warning("could not tell the other hosts of this failure: %s", e)

    def outcome(self, change: WorldChange | RendezvousError) -> RunEnd | WorldChange:
        """After the rendezvous ended an attempt: the run's end, or the change to re-join after."""
        from ..rendezvous import RendezvousClosedError, RendezvousJobFailedError

        self.world_change = None
        if isinstance(change, RendezvousClosedError):
            state = WorkerState.SUCCEEDED if change.finished else WorkerState.FAILED
            return RunEnd(state, str(change))
        if isinstance(change, Exception):
            failures: dict[int, Any] = {}
            if isinstance(change, RendezvousJobFailedError) and change.failure is not None:
                rank, failure = _remote_failure(change.failure)
                failures[rank] = failure
                self._failed_host = str(change.failure.get("host", ""))
            return RunEnd(WorkerState.FAILED, str(change), failures)
        return change

    def failure_host(self) -> str:
        """Where the run's failures happened: the failed host, else this one ("" with one host)."""
        return self._failed_host or (self.handler.addr if self.handler is not None else "")


def _failure_record(rank: int, failure: Any) -> dict[str, Any]:
    """What other hosts are told of this host's root cause (JSON)."""
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        message = (extra.get("py_callstack") if isinstance(extra, dict) else None) or message.get(
            "message", ""
        )
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "how": how,
        "error_file": failure.error_file,
        "message": str(message),
        "timestamp": failure.timestamp,
    }


def _remote_failure(record: dict[str, Any]) -> tuple[int, ProcessFailure]:
    """Another host's root cause as a ``ProcessFailure`` for this host's summary."""
    failure = ProcessFailure(
        int(record.get("local_rank", -1)),
        int(record.get("pid", -1)),
        int(record.get("exitcode", 1)),
        "<N/A>",
    )
    failure.error_file = str(record.get("error_file", "<N/A>"))
    failure.message = str(record.get("message", ""))
    failure.timestamp = int(record.get("timestamp", failure.timestamp))
    return int(record.get("rank", -1)), failure
