"""``ClusterRunner``: TensorFlow's ``MultiProcessRunner`` as an asyncio supervisor.

Each task ``(task_type, task_id)`` of the cluster spec is a group of its own
(a one-rank ``PContext``), so it can be stopped, restarted or added alone;
what TF does with a 1 s watchdog thread, reader threads and a Manager process
happens here on the loop: a task's exit wakes its own coroutine (``_run_task``)
at once, its lines go through the output engine to the sinks, and one
``ControlHub`` shared by every task's group carries the barrier and the stack
dumps over the tasks' private control channels.

Ownership: the runner's supervisor task holds one task group; every task's
coroutine (its attempts, its restarts with backoff, its ``max_run_time``
timer) and the chief-dependence stop live there.  ``aclose`` stops every
task and waits for the supervisor, so leaving ``async with`` leaves nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from .._base import public_module
from .._base.checks import check_duration, check_env, check_signal
from .._base.owner import Owner
from .._base.shield import shielded
from .._child import aio as _aio
from .._func.barrier import ControlHub
from .._func.boot import CallEncoder, check_worker_loop
from .._group.rank_launcher import SinkLike, make_sinks
from .._group.restart import RestartPolicy
from ..context import PContext
from ..results import RunProcsResult
from ..sinks import Sink, close_sinks
from .result import DEFAULT_TIMEOUT, ClusterOutcomes, MultiProcessRunnerResult, TaskKey
from .task import (
    Collect,
    Task,
    base_spec,
    check_call,
    restart_delay,
    task_group,
    task_label,
    will_restart,
)
from .tfconfig import assign_gpus, check_cluster_spec, tf_config, visible_gpus

__all__ = ["GRACE_PERIOD", "ClusterRunner"]

logger = logging.getLogger("aioproc.cluster")


_STACKS_TIMEOUT = 5.0
"""Bound on waiting for a task's stack dump (its main thread may hold the GIL in C)."""

GRACE_PERIOD = 5.0
"""The runner's default ``grace_period``: TF's runner kills tasks at once, so
its users expect a stop to be quick; 5 s lets a task flush and clean up."""


class ClusterRunner:
    """Run ``fn`` once per task of ``cluster_spec``, each task in its own process.

    Opened with ``aioproc.cluster.open_cluster(fn, spec, ...)``, awaited or
    with ``async with`` (whose end stops every task), as every handle of
    aioproc opens; closed with ``aclose()``.  TF's face stays: the
    constructor, ``start()``, ``join()`` and ``terminate_all()`` (and the
    constructor is its own context manager, as before).  See
    ``aioproc.cluster.run`` for the arguments; in addition:

    Args:
        sinks: extra sinks for the tasks' prefixed lines (``aioproc.sinks``).
        grace_period: seconds between SIGTERM and SIGKILL when a task is
            stopped (terminate, chief dependence, timeout, ``aclose()``).
            The runner keeps a default of its own, ``GRACE_PERIOD`` (5 s),
            not the groups' ``DEFAULT_GRACE_PERIOD`` (30 s): TF's runner
            kills its tasks at once, and its users expect a quick stop.
        chief_grace_period: with ``dependence_on_chief``, how long the other
            tasks may keep running after the chief exited before they are
            stopped (TF waits 3 s).
        restart_policy: backoff between restarts (``aioproc.agent``'s).
        max_restarts: restarts allowed per task with ``auto_restart``.
        rpc_layer: put into ``TF_CONFIG`` when given (e.g. ``"grpc"``).
        gpus: the GPU ids to hand out with ``share_gpu=False`` (default: the
            parent's ``CUDA_VISIBLE_DEVICES``, else the NVIDIA GPUs found).
        on_exit: called on the loop with ``((task_type, task_id), exit code)``
            each time an attempt of a task has ended and its outcome is
            recorded (values and errors are then visible to ``join``).
        worker_loop: the event loop an ``async def`` ``fn`` runs on in each
            task, ``"asyncio"`` (default) or ``"uvloop"``, as
            ``start_processes(worker_loop=...)`` takes it; a stop cancels it.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        cluster_spec: Mapping[str, Sequence[str] | int],
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        return_output: bool = False,
        stream_output: bool = True,
        max_run_time: float | None = None,
        dependence_on_chief: bool = True,
        auto_restart: bool = False,
        share_gpu: bool = True,
        env: Mapping[str, str] | None = None,
        rpc_layer: str | None = None,
        sinks: Sequence[SinkLike] = (),
        grace_period: float = GRACE_PERIOD,
        chief_grace_period: float = 3.0,
        restart_policy: RestartPolicy | None = None,
        max_restarts: int = 10,
        gpus: Sequence[str] | None = None,
        on_exit: Callable[[TaskKey, int], None] | None = None,
        worker_loop: str = "asyncio",
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self.cluster_spec = check_cluster_spec(cluster_spec)
        self._fn = fn
        self._args, self._kwargs = check_call(args, kwargs)
        self.max_run_time = check_duration("max_run_time", max_run_time, allow_none=True)
        self.grace_period = check_duration("grace_period", grace_period)
        self.chief_grace_period = check_duration("chief_grace_period", chief_grace_period)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
        if restart_policy is not None and not isinstance(restart_policy, RestartPolicy):
            raise TypeError(f"restart_policy must be a RestartPolicy, got {restart_policy!r}")
        if rpc_layer is not None and not isinstance(rpc_layer, str):
            raise TypeError(f"rpc_layer must be a str, got {rpc_layer!r}")
        if on_exit is not None and not callable(on_exit):
            raise TypeError(f"on_exit must be callable, got {on_exit!r}")
        self.worker_loop = check_worker_loop(worker_loop)
        self._on_exit = on_exit
        self._env = dict(env or {})
        check_env("env", self._env)
        self.return_output = bool(return_output)
        self.stream_output = bool(stream_output)
        self.dependence_on_chief = bool(dependence_on_chief)
        self.auto_restart = bool(auto_restart)
        self.share_gpu = bool(share_gpu)
        self.rpc_layer = rpc_layer
        self.max_restarts = max_restarts
        self.restart_policy = restart_policy or RestartPolicy(initial_delay=0.05, max_delay=5.0)
        self._restarts = (self.restart_policy, max_restarts)
        user_sinks = make_sinks(list(sinks))
        spec_tasks = [(t, i) for t, addrs in self.cluster_spec.items() for i in range(len(addrs))]
        if gpus is None:
            gpus = visible_gpus(os.environ) if not share_gpu else []
        self._gpus = [str(g) for g in gpus]
        self._gpu_of = {} if share_gpu else assign_gpus(spec_tasks, self._gpus)
        self._outcomes = ClusterOutcomes()
        self._sinks: list[Sink] = list(user_sinks)
        if stream_output:
            from ..sinks import ConsoleSink

            self._sinks.append(ConsoleSink())
        if return_output:
            self._sinks.append(Collect(self._outcomes.stdout))
        # the barrier counts the tasks of the spec, as TF's Manager barrier does
        self._hub = ControlHub(len(spec_tasks), returns=self._comes_back)
        self._base = base_spec(self.grace_period, self._sinks, self._hub, self.worker_loop)
        self._tasks: dict[TaskKey, Task] = {}
        self._halt = asyncio.Event()  # timeout, terminate_all, close, chief gone: no more attempts
        self._chief_succeeded = False
        self._closing = False
        self._active = 0
        self._idle: asyncio.Event | None = None
        # a close request carries True; False: the owner was cancelled (kill now)
        self._owner: Owner[bool] = Owner("aioproc-cluster")

    def __repr__(self) -> str:
        if not self._owner.started:
            state = "new"
        elif self._owner.done:
            state = "closed"
        else:
            running = sum(t.running for t in self._tasks.values())
            state = f"running={running}"
        name = getattr(self._fn, "__name__", repr(self._fn))
        return f"<ClusterRunner {name} {state}>"

    async def __aenter__(self) -> ClusterRunner:
        if not self._owner.started:
            await self._started()
        return self

    async def _started(self) -> ClusterRunner:
        """``start()``, closing what started if it fails (``open_cluster``, ``async with``)."""
        try:
            await self.start()
        except BaseException:
            # no close follows a failed open: stop what started
            await shielded(self.aclose())
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start every task of the cluster spec; return once all are running.

        Raises:
            RuntimeError: already started.
            TypeError: ``fn`` or its arguments cannot be pickled (before
                anything starts).
            OSError: a task could not be launched; the others are stopped.

        Cancellation: the tasks launched so far keep running; leaving
        ``async with`` (or ``aclose()``) stops them.
        """
        if self._owner.started:
            raise RuntimeError(f"{self!r} was already started")
        CallEncoder(self._fn).encode(self._args, self._kwargs)  # picklable, or TypeError now
        await self._open()
        keys = [(t, i) for t, addrs in self.cluster_spec.items() for i in range(len(addrs))]
        await self._launch([Task(k, self._fn, self._args, dict(self._kwargs)) for k in keys])

    async def start_in_process_as(self, as_task_type: str, as_task_id: int) -> Any:
        """Start every other task, then run ``fn`` here as ``(as_task_type, as_task_id)``.

        ``fn`` runs in a worker thread (an ``async def`` on a fresh loop of
        ``worker_loop``'s kind there) with this process's ``TF_CONFIG`` set
        to that task's (``os.environ`` is changed for the call and restored
        after, because the caller asked for it); its return value is returned.
        This task takes no part in ``barrier()``: the others meet without it.

        Cancellation: the thread cannot be interrupted; it runs to its end.
        """
        key = (as_task_type, as_task_id)
        if as_task_type not in self.cluster_spec or as_task_id >= len(
            self.cluster_spec[as_task_type]
        ):
            raise ValueError(f"{task_label(*key)} is not a task of {self.cluster_spec}")
        if self._owner.started:
            raise RuntimeError(f"{self!r} was already started")
        CallEncoder(self._fn).encode(self._args, self._kwargs)
        await self._open()
        keys = [(t, i) for t, addrs in self.cluster_spec.items() for i in range(len(addrs))]
        keys.remove(key)
        self._hub.parties -= 1  # this process takes no part in barrier()
        await self._launch([Task(k, self._fn, self._args, dict(self._kwargs)) for k in keys])
        config = tf_config(self.cluster_spec, as_task_type, as_task_id, self.rpc_layer)

        def call() -> Any:
            old = os.environ.get("TF_CONFIG")
            os.environ["TF_CONFIG"] = config
            try:
                value = self._fn(*self._args, **self._kwargs)
                if _aio.is_coroutine(value):
                    # a loop of this thread's own, of the kind the tasks run on
                    loop = _aio.new_event_loop(self.worker_loop)
                    try:
                        return loop.run_until_complete(value)
                    finally:
                        loop.run_until_complete(loop.shutdown_asyncgens())
                        loop.close()
                return value
            finally:
                if old is None:
                    os.environ.pop("TF_CONFIG", None)
                else:
                    os.environ["TF_CONFIG"] = old

        # its own thread, not the helper thread: this is the caller's task,
        # running as long as the others, and would hold up every start and stop
        return await anyio.to_thread.run_sync(call)

    async def start_single_process(
        self,
        task_type: str,
        task_id: int,
        fn: Callable[..., Any] | None = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start one task, in the spec or not (its ``TF_CONFIG`` names it all the same).

        ``fn``, ``args`` and ``kwargs`` default to the runner's.

        Raises:
            RuntimeError: the runner is not started, or is closing.
            ValueError: that task is running now.

        Cancellation: the task may still start; ``aclose()`` stops it.
        """
        if not self._owner.started or self._closing:
            raise RuntimeError(f"{self!r} is not running: start() it first")
        if not isinstance(task_type, str) or not task_type:
            raise ValueError(f"task_type must be a non-empty str, got {task_type!r}")
        if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
            raise ValueError(f"task_id must be a non-negative int, got {task_id!r}")
        key = (task_type, task_id)
        old = self._tasks.get(key)
        if old is not None and (old.running or not old.ended.is_set()):
            raise ValueError(f"{task_label(*key)} is running; terminate it first")
        fn = self._fn if fn is None else fn
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        call_args, call_kwargs = check_call(
            self._args if args is None else args, self._kwargs if kwargs is None else kwargs
        )
        CallEncoder(fn).encode(call_args, call_kwargs)
        await self._launch([Task(key, fn, call_args, call_kwargs)])

    async def _open(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self._owner.start(self._supervise, after=self._close_sinks)
        await self._owner.opened()

    async def _supervise(self, tg: anyio.abc.TaskGroup) -> None:
        graceful = await self._owner.closing(False)
        with anyio.CancelScope(shield=True):
            await self._stop_running("close", signal.SIGTERM if graceful else signal.SIGKILL)

    async def _close_sinks(self) -> None:
        await close_sinks(self._sinks)

    async def _launch(self, tasks: list[Task]) -> None:
        assert self._owner.group is not None
        assert self._idle is not None
        loop = asyncio.get_running_loop()
        launched: list[asyncio.Future[None]] = []
        for task in tasks:
            self._tasks[task.key] = task
            self._outcomes.forget(task.key)
            future: asyncio.Future[None] = loop.create_future()
            launched.append(future)
            self._active += 1
            self._idle.clear()
            self._owner.group.start_soon(self._run_task, task, future, name=f"aioproc-{task.label}")
        errors = [r for r in await asyncio.gather(*launched, return_exceptions=True) if r]
        if errors:
            # all or none of this launch: stop the tasks it did start
            keys = [t.key for t in tasks]
            await shielded(self._stop_running("close", signal.SIGKILL, keys))
            raise errors[0]

    # ------------------------------------------------------------ one task

    def _group(self, task: Task) -> PContext:
        gpu = self._gpu_of.get(task.key)
        if gpu is None and not self.share_gpu and self._gpus:
            gpu = self._gpus[len(self._tasks) % len(self._gpus)]  # a task not in the spec
        env = {**self._env, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else self._env
        config = tf_config(self.cluster_spec, *task.key, self.rpc_layer)
        return task_group(task, config, env, self._base)

    async def _run_task(self, task: Task, launched: asyncio.Future[None]) -> None:
        """Every attempt of one task: start, wait (bounded by max_run_time), record, restart."""
        assert self._idle is not None
        try:
            while True:
                task.ended = asyncio.Event()
                task.exited = asyncio.Event()
                task.pc = None  # not running (nor stoppable) until this attempt is launched
                task.exit_code = None
                task.stop_reason = ""
                pc = self._group(task)
                try:
                    await pc.start()
                except Exception as e:
                    if not launched.done():
                        launched.set_exception(e)
                    else:  # a restart that could not be launched
                        self._outcomes.fail(task.key, e)
                    return
                task.pc = pc
                task.pid = pc.pids().get(0)
                task.started_at = time.monotonic()
                if not launched.done():
                    launched.set_result(None)
                try:
                    result = await self._outcome(task, pc)
                    # recorded the moment the exit is known; the release comes after
                    self._record(task, pc, result)
                    task.ended.set()
                    await pc.close(signal.SIGTERM, self.grace_period)
                except BaseException:
                    # cancelled (the loop is shutting down): never leave the task behind
                    await shielded(pc.close(signal.SIGKILL, 0.0))
                    raise
                delay = self._restart_delay(task)
                if delay is None:
                    return
                task.restarts += 1
                logger.info("restarting %s in %.2f s", task.label, delay)
                # the backoff between attempts, cut short when restarts end
                with anyio.move_on_after(delay):
                    await self._halt.wait()
                if self._halt.is_set():
                    return
        finally:
            task.ended.set()
            if not launched.done():
                launched.set_result(None)
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _outcome(self, task: Task, pc: PContext) -> RunProcsResult:
        """The attempt's result, as soon as its exit is recorded (bounded by max_run_time)."""
        if self._closing:  # the runner began closing during the launch
            task.stop_reason = "close"
            await pc.close(signal.SIGTERM, self.grace_period)
            task.exited.set()
        with anyio.move_on_after(self.max_run_time) as scope:
            await task.exited.wait()
        if scope.cancelled_caught:  # max_run_time: TF counts such a task as done, value None
            task.stop_reason = task.stop_reason or "max_run_time"
            await pc.close(signal.SIGTERM, self.grace_period)
        result = pc.poll()  # final once the exit is recorded or the group closed
        if result is None:
            await pc.close(signal.SIGTERM, self.grace_period)
            result = pc.poll()
            assert result is not None
        return result

    def _record(self, task: Task, pc: PContext, result: RunProcsResult) -> None:
        """The outcome of ``task``'s attempt replaces what its last attempt left."""
        key = task.key
        task.exit_code = self._outcomes.record(
            key, result, pc.remote_exception(0), task.stop_reason
        )
        if key[0] == "chief" and task.exit_code == 0 and not task.stop_reason:
            self._chief_succeeded = True
        if self._on_exit is not None:
            try:
                self._on_exit(key, task.exit_code)
            except Exception:
                logger.exception("on_exit callback failed for %s", task.label)
        chief_gone = task.exit_code == 0 or not self._will_restart(task)
        group = self._owner.group
        if key[0] == "chief" and self.dependence_on_chief and chief_gone and group is not None:
            group.start_soon(self._stop_dependents, name="aioproc-chief-exited")

    def _comes_back(self, key: Hashable, code: int) -> bool:
        """The barrier's question: will a new attempt of this task take its place?"""
        for task in self._tasks.values():
            if task.label == key:
                return self._will_restart(task, code)
        return False

    def _will_restart(self, task: Task, code: int | None = None) -> bool:
        """Whether ``task``, ended with ``code``, gets another attempt."""
        if not self.auto_restart or self._halt.is_set() or self._closing:
            return False
        if self._chief_succeeded:
            return False  # TF: a chief that succeeded ends the restarts
        ended = task.exit_code if code is None else code
        return ended is not None and will_restart(task, ended, self._restarts)

    def _restart_delay(self, task: Task) -> float | None:
        """Seconds before ``task``'s next attempt, or None when it is not restarted."""
        if not self._will_restart(task):
            return None
        return restart_delay(task, self._restarts)

    async def _stop_dependents(self) -> None:
        """The chief is gone: the others get ``chief_grace_period`` to end, then are stopped."""
        assert self._idle is not None
        with anyio.move_on_after(self.chief_grace_period):
            while any(t.running for t in self._tasks.values() if t.key[0] != "chief"):
                await self._any_ended()
        self._halt.set()
        await self._stop_running("chief", signal.SIGTERM)

    async def _any_ended(self) -> None:
        running = [t.ended.wait() for t in self._tasks.values() if t.running]
        if not running:
            return
        waits = [asyncio.ensure_future(w) for w in running]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _stop_running(self, reason: str, sig: int, keys: Sequence[TaskKey] = ()) -> None:
        """Stop the running tasks (or ``keys``), gracefully then by force; wait for them."""
        targets = [t for t in self._tasks.values() if t.running and (not keys or t.key in keys)]
        timeout = 0.0 if sig == signal.SIGKILL else self.grace_period

        async def stop(task: Task) -> None:
            task.stop_reason = task.stop_reason or reason
            # this attempt's group and events: a restart may replace them meanwhile
            pc, exited, ended = task.pc, task.exited, task.ended
            assert pc is not None
            await pc.close(sig, timeout)
            exited.set()  # also when it could not be killed: the group is closed
            await ended.wait()

        async with anyio.create_task_group() as tg:
            for task in targets:
                tg.start_soon(stop, task)

    # ------------------------------------------------------------ control

    def _task(self, task_type: str, task_id: int) -> Task:
        task = self._tasks.get((task_type, task_id))
        if task is None:
            raise ValueError(f"{task_label(task_type, task_id)} does not exist")
        return task

    async def terminate(self, task_type: str, task_id: int) -> None:
        """Stop one task (SIGTERM, SIGKILL after ``grace_period``) and wait until it ended.

        The others keep running (unless it is the chief and the run depends
        on it).  The task is reported as terminated, not as a failure; with
        ``auto_restart`` it is started again.

        Raises:
            ValueError: no such task.

        Cancellation: the stop runs shielded.
        """
        task = self._task(task_type, task_id)
        if task.running:
            await shielded(self._stop_running("user", signal.SIGTERM, [task.key]))

    async def terminate_all(self, sig: int | None = None) -> None:
        """Stop every task with ``sig`` (default SIGKILL, as TF) and wait; no more restarts.

        Cancellation: the stop runs shielded.
        """
        sig = check_signal(signal.SIGKILL if sig is None else sig)
        self._halt.set()
        await shielded(self._stop_running("user", sig))

    def get_process_id(self, task_type: str, task_id: int) -> int | None:
        """The pid of the task's current (or last) process; None if it never started."""
        task = self._tasks.get((task_type, task_id))
        return None if task is None else task.pid

    def get_process_exit_code(self, task_type: str, task_id: int) -> int | None:
        """The exit code of the task's last attempt (``-N``: signal N); None while running.

        Raises:
            ValueError: no such task.
        """
        return self._task(task_type, task_id).exit_code

    def process_exists(self, task_type: str, task_id: int) -> bool:
        """Whether the task's process is running now."""
        task = self._tasks.get((task_type, task_id))
        return task is not None and task.running

    # ------------------------------------------------------------ join

    async def join(self, timeout: float | None = DEFAULT_TIMEOUT) -> MultiProcessRunnerResult:
        """Wait until every task (and every restart) has ended; the result, or the first error.

        Args:
            timeout: seconds (``None``: no bound).  When it expires, every
                task still running dumps the stacks of all its threads into
                its output, then all are stopped (gracefully, then by force)
                and ``SubprocessTimeoutError`` is raised, unless a task
                failed, whose error is raised instead (as TF does).

        Returns:
            The ``MultiProcessRunnerResult``.

        Raises:
            The first failed task's own exception (its type, its traceback as
            ``__cause__``, ``mpr_result`` attached); ``UnexpectedSubprocessExitError``
            for a task that exited non-zero or was killed by a signal without
            raising; ``SubprocessTimeoutError``.

        Cancellation: the tasks keep running; ``async with``/``aclose()``
            stops them.
        """
        timeout = check_duration("join(timeout=...)", timeout, allow_none=True)
        if self._idle is None:
            raise RuntimeError(f"{self!r} has not been started")
        stacks: dict[TaskKey, str] = {}
        timed_out = False
        with anyio.move_on_after(timeout) as scope:
            await self._idle.wait()
        if scope.cancelled_caught:
            timed_out = True
            self._halt.set()
            stacks = await shielded(self._dump_and_stop())
        self._outcomes.raise_first_failure()  # a task's error wins over the timeout
        if timed_out:
            raise self._outcomes.timeout_error(timeout, stacks)
        return self._outcomes.result()

    async def _dump_and_stop(self) -> dict[TaskKey, str]:
        running = [t for t in self._tasks.values() if t.running]
        texts = await asyncio.gather(
            *(self._hub.dump_stacks(t.label, _STACKS_TIMEOUT) for t in running)
        )
        await self._stop_running("timeout", signal.SIGTERM)
        return {t.key: text for t, text in zip(running, texts, strict=True)}

    async def aclose(self) -> None:
        """Stop every task (SIGTERM, SIGKILL after ``grace_period``) and release all.

        No more restarts; the tasks' outcomes stay readable (``join()``
        returns them).  Idempotent and safe from any task: a call while
        another closes the runner waits for the same end; a call on a
        runner never started returns at once.

        Cancellation: runs shielded and bounded; a cancellation is re-raised
        once it is done.
        """
        if not self._owner.started:
            return
        self._closing = True
        self._halt.set()
        await self._owner.close(True)


# loaded on first use by ``aioproc.cluster``, whose name it carries from the start
public_module("aioproc.cluster", ClusterRunner)
