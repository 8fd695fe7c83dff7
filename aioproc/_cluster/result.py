"""What a cluster run reports: ``MultiProcessRunnerResult``, its two errors, and
``ClusterOutcomes``, which keeps each task's last outcome until ``join``.

Names follow TensorFlow's ``multi_process_runner``.  A task's own exception
is not wrapped: it is re-raised with its type, its ``__cause__`` holding the
task's traceback, and ``mpr_result`` attached, as TF does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..results import RunProcsResult
from .tfconfig import task_sort_key

DEFAULT_TIMEOUT = 200.0
"""``join()``'s default bound in seconds, TensorFlow's (kept here, beside the
timeout error, so ``aioproc.cluster`` can name it without importing the runner)."""

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
            pads it, ending with its newline as in TF, in order of arrival.
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


def _label(key: TaskKey) -> str:
    return f"{key[0]}-{key[1]}"


class ClusterOutcomes:
    """Each task's last outcome: its value or its error, exit code, whether it was stopped.

    A new attempt's outcome replaces the last one, except that an attempt
    stopped by the runner (terminate, chief gone, timeout, close) reports
    nothing of its own, so an earlier failure of the task stands (TF keeps
    the last status a task reported).  Failures keep the order in which
    they happened: ``join`` raises the first.
    """

    def __init__(self) -> None:
        self.stdout: list[str] = []  # return_output's lines (the Collect sink appends)
        self._values: dict[TaskKey, Any] = {}
        self._failures: dict[TaskKey, BaseException] = {}
        self._exit_codes: dict[TaskKey, int] = {}
        self._terminated: set[TaskKey] = set()

    def forget(self, key: TaskKey) -> None:
        """``key`` is started anew (``start_single_process``)."""
        self._values.pop(key, None)
        self._failures.pop(key, None)
        self._exit_codes.pop(key, None)
        self._terminated.discard(key)

    def fail(self, key: TaskKey, error: BaseException) -> None:
        self._failures.pop(key, None)
        self._failures[key] = error  # the latest failure goes last

    def record(
        self, key: TaskKey, result: RunProcsResult, remote: BaseException | None, stop_reason: str
    ) -> int:
        """Record the attempt's one-rank ``result``; returns its exit code.

        ``remote``: the exception the task reported, if any.  ``stop_reason``:
        why the runner stopped it ("" if it ended by itself).
        """
        self._terminated.discard(key)
        self._values.pop(key, None)
        stopped = bool(stop_reason) and stop_reason != "max_run_time"
        if 0 in result.return_values:
            code = 0
            self._values[key] = result.return_values[0]
            self._failures.pop(key, None)
        else:
            failure = result.failures[0]
            code = failure.exitcode
            if remote is not None:
                # it raised before (or while) it was stopped: an error all the same
                self.fail(key, remote)
                stopped = False
            elif stop_reason == "max_run_time":
                self._values[key] = None  # TF: a task ended by max_run_time succeeded
                self._failures.pop(key, None)
            elif not stopped:
                message = f"Subprocess {_label(key)} exited with exit code {code}"
                if code < 0:
                    message += f": it was killed by {failure.signal_name()}"
                self.fail(key, UnexpectedSubprocessExitError(message, MultiProcessRunnerResult()))
        if stopped:
            self._terminated.add(key)
        self._exit_codes[key] = code
        return code

    def result(self) -> MultiProcessRunnerResult:
        return MultiProcessRunnerResult.build(
            self._values, self.stdout, self._exit_codes, self._terminated
        )

    def raise_first_failure(self) -> None:
        """Raise the first failed task's error with ``mpr_result`` attached, if any failed."""
        if self._failures:
            error = next(iter(self._failures.values()))
            error.mpr_result = self.result()  # type: ignore[attr-defined]
            raise error

    def timeout_error(
        self, timeout: float | None, stacks: dict[TaskKey, str]
    ) -> SubprocessTimeoutError:
        names = ", ".join(_label(k) for k in stacks) or "none"
        dumps = "".join(
            f"\n--- stacks of {_label(k)} ---\n{text.rstrip()}" for k, text in stacks.items()
        )
        return SubprocessTimeoutError(
            f"join timed out after {timeout} s; tasks still running were stopped: {names}{dumps}",
            self.result(),
            stacks,
        )
