"""What a cluster run reports: ``MultiProcessRunnerResult`` and its two errors.

Names follow TensorFlow's ``multi_process_runner``.  A task's own exception
is not wrapped: it is re-raised with its type, its ``__cause__`` holding the
task's traceback, and ``mpr_result`` attached, as TF does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._tfconfig import task_sort_key

TaskKey = tuple[str, int]
"""``(task_type, task_id)``."""


@dataclass
class MultiProcessRunnerResult:
    """Outcome of a cluster run (also the partial outcome carried by its errors).

    Attributes:
        return_value: the values the tasks returned, ordered chief, worker,
            ps, evaluator, then by index; ``None`` values are left out, as
            TensorFlow does.
        stdout: with ``return_output=True``, every line the tasks wrote
            (stdout and stderr), prefixed ``[worker-1]:`` and padded as TF
            pads it, without the newline, in order of arrival.
        task_values: ``{(task_type, task_id): value}`` of every task whose
            last attempt returned (``None`` values included).
        exit_codes: ``{(task_type, task_id): exit code}`` of every task's
            last attempt that ended (``-N``: killed by signal ``N``).
        terminated: the tasks stopped by ``terminate``/``terminate_all``, by
            the chief's exit (``dependence_on_chief``) or by a timeout,
            rather than ending by themselves; they are not failures.
    """

    return_value: list[Any] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    task_values: dict[TaskKey, Any] = field(default_factory=dict)
    exit_codes: dict[TaskKey, int] = field(default_factory=dict)
    terminated: set[TaskKey] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        values: dict[TaskKey, Any],
        stdout: list[str],
        exit_codes: dict[TaskKey, int],
        terminated: set[TaskKey],
    ) -> MultiProcessRunnerResult:
        ordered = dict(sorted(values.items(), key=lambda kv: task_sort_key(kv[0])))
        return cls(
            return_value=[v for v in ordered.values() if v is not None],
            stdout=list(stdout),
            task_values=ordered,
            exit_codes=dict(sorted(exit_codes.items(), key=lambda kv: task_sort_key(kv[0]))),
            terminated=set(terminated),
        )


class UnexpectedSubprocessExitError(RuntimeError):
    """A task exited with a non-zero code, or was killed by a signal, without raising.

    ``mpr_result`` holds the outputs and the values that did arrive.
    """

    mpr_result: MultiProcessRunnerResult

    def __init__(self, message: str, mpr_result: MultiProcessRunnerResult) -> None:
        super().__init__(message)
        self.mpr_result = mpr_result


class SubprocessTimeoutError(RuntimeError):
    """``join(timeout)`` expired with tasks still running; they were stopped.

    Attributes:
        mpr_result: the partial result (values of the tasks that had ended,
            and the output so far).
        stacks: ``{(task_type, task_id): text}``, the faulthandler dump of
            every thread of each task that was still running (also written
            into its output and quoted in the message).
    """

    mpr_result: MultiProcessRunnerResult
    stacks: dict[TaskKey, str]

    def __init__(
        self, message: str, mpr_result: MultiProcessRunnerResult, stacks: dict[TaskKey, str]
    ) -> None:
        super().__init__(message)
        self.mpr_result = mpr_result
        self.stacks = stacks
