"""The pieces of a cluster run that are not the runner: a task's record, its
names and prefix, the sink behind ``return_output``, argument checks."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._func.barrier import ControlHub
from .._group.restart import RestartPolicy
from .._supervisor.spec import GroupSpec
from ..context import PContext
from ..logs import DefaultLogsSpecs, Std
from ..results import WorkerEvent
from ..sinks import Sink
from .result import TaskKey

Restarts = tuple[RestartPolicy, int]
"""The backoff policy and the restarts allowed per task."""


def task_label(task_type: str, task_id: int) -> str:
    """``worker-1``: how TF names a task in prefixes and messages."""
    return f"{task_type}-{task_id}"


def line_prefix(task_type: str, task_id: int) -> str:
    """``"[worker-1]:    "``: TF pads the tag to 14 columns, then one space."""
    return f"[{task_label(task_type, task_id)}]:".ljust(14) + " "


class Collect(Sink):
    """``return_output``: every line, prefixed, with its newline, in order of arrival.

    TF's reader thread keeps each line's newline (it iterates over the text
    pipe), so a test written for TF that looks for ``"...\n"`` in
    ``stdout`` finds it here too.  A last line the task ended without a
    newline gets one all the same: the sinks see whole lines only.
    """

    def __init__(self, out: list[str]) -> None:
        self._out = out

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self._out.extend(prefix + line + "\n" for line in lines)


@dataclass
class Task:
    """One task: its current attempt and what its last attempt ended with."""

    key: TaskKey
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pc: PContext | None = None
    pid: int | None = None
    exit_code: int | None = None
    stop_reason: str = ""  # "" ran by itself; "user", "chief", "timeout", "close", "max_run_time"
    restarts: int = 0
    started_at: float = 0.0
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # current attempt recorded
    # the attempt's exit is recorded by its group, or its group was closed
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def label(self) -> str:
        return task_label(*self.key)

    @property
    def running(self) -> bool:
        return self.pc is not None and self.exit_code is None


def base_spec(
    grace_period: float, sinks: list[Sink], hub: ControlHub, worker_loop: str
) -> GroupSpec:
    """What every task's one-rank group shares; ``task_group`` fills in the task.

    Lines go to the runner's sinks (which outlive each attempt), no files;
    ``barrier()`` goes through the runner's hub, keyed by task; a coroutine
    task runs on a ``worker_loop`` loop.
    """
    return GroupSpec(
        "",
        "",
        {},
        {},
        DefaultLogsSpecs(log_dir=os.devnull, tee=Std.ALL),  # lines to the sinks, no files
        grace_period=grace_period,
        sinks=sinks,
        close_sinks=False,
        hub=hub,
        worker_loop=worker_loop,
    )


def task_group(task: Task, tf_config: str, env: Mapping[str, str], base: GroupSpec) -> PContext:
    """A one-rank group running ``task``'s current attempt (not started)."""
    spec = dataclasses.replace(
        base,
        name=task.label,
        entrypoint=task.fn,
        args={0: task.args},
        # a crashing task prints its stacks (faulthandler), as under TF
        envs={0: {"PYTHONFAULTHANDLER": "1", **env, "TF_CONFIG": tf_config}},
        log_line_prefixes={0: line_prefix(*task.key)},
        kwargs={0: task.kwargs},
        on_event=functools.partial(on_exited, task.exited),  # this attempt's event
        hub_keys={0: task.label},
    )
    return PContext._from_spec(spec)


def will_restart(task: Task, code: int, restarts: Restarts) -> bool:
    """Whether an attempt that ended with ``code`` is followed by another (auto_restart).

    Failures and user terminations are; successes and stops by the runner
    (chief gone, timeout, close) are not, nor anything past the budget, which
    an attempt that stayed up ``reset_after`` seconds renews.
    """
    policy, budget = restarts
    if task.stop_reason in ("chief", "timeout", "close"):
        return False
    if code == 0 and task.stop_reason != "user":
        return False
    reset = policy.reset_after
    if reset is not None and time.monotonic() - task.started_at >= reset:
        return True
    return task.restarts < budget


def restart_delay(task: Task, restarts: Restarts) -> float:
    """The backoff before ``task``'s next attempt (renewing a healthy task's budget)."""
    policy, _ = restarts
    reset = policy.reset_after
    if reset is not None and time.monotonic() - task.started_at >= reset:
        task.restarts = 0
    return policy.delay(task.restarts)


def on_exited(exited: asyncio.Event, event: WorkerEvent) -> None:
    if event.kind == "exited":
        exited.set()


def check_call(
    args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args is None:
        args = ()
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list, got {args!r}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs must be a dict with str keys, got {kwargs!r}")
    return tuple(args), dict(kwargs)
