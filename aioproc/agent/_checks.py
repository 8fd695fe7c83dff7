"""``LocalElasticAgent``'s argument checks, in the order the agent makes them.

The messages are the agent's: they name its arguments (``spec``,
``logs_specs``, ``stop()``'s ``death_sig`` and ``grace_period``...).
"""

from __future__ import annotations

import math
import signal

from .._base.checks import check_duration, check_path_name, check_preload, check_start_method
from .._group.resources import check_capacity
from ..logs import LogsSpecs
from .spec import WorkerSpec

__all__ = ["check_agent_args", "check_stop_args"]


def check_agent_args(
    spec: WorkerSpec,
    logs_specs: LogsSpecs | None,
    start_method: str,
    exit_barrier_timeout: float,
    log_line_prefix_template: str | None,
    *,
    log_dir: str | None,
    grace_period: float,
    run_id: str | None,
    event_history_size: int,
    capacity: object = None,
) -> tuple[tuple[str, ...], float, float]:
    """Check ``LocalElasticAgent``'s arguments (see the agent for each).

    Returns:
        ``(preload, grace_period, exit_barrier_timeout)``: the spec's
        preload as a tuple, the durations as floats.

    Raises:
        TypeError, ValueError: as ``LocalElasticAgent`` documents.
    """
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"spec must be a WorkerSpec, got {spec!r}")
    if logs_specs is not None and not isinstance(logs_specs, LogsSpecs):
        raise TypeError(
            f"logs_specs must be a LogsSpecs (the second argument, as in torch >= 2.2), "
            f"got {logs_specs!r}"
        )
    if logs_specs is not None and log_dir is not None:
        raise ValueError(
            f"give log_dir={log_dir!r} or logs_specs, not both (logs_specs has its own log_dir)"
        )
    if log_line_prefix_template is not None and not isinstance(log_line_prefix_template, str):
        raise TypeError(f"log_line_prefix_template must be a str, got {log_line_prefix_template!r}")
    check_start_method(start_method)
    preload = check_preload(start_method, spec.preload)
    grace_period = check_duration("grace_period", grace_period)
    exit_barrier_timeout = check_duration("exit_barrier_timeout", exit_barrier_timeout)
    if run_id is not None:
        check_path_name("run_id", run_id)
    if (
        isinstance(event_history_size, bool)
        or not isinstance(event_history_size, int)
        or event_history_size <= 0
    ):
        raise ValueError(f"event_history_size must be a positive int, got {event_history_size!r}")
    check_capacity(capacity, spec.local_world_size)
    return preload, grace_period, exit_barrier_timeout


def check_stop_args(
    death_sig: int, grace: float | None, default: float, *, name: str = "grace_period"
) -> tuple[signal.Signals, float]:
    """Check a stop's arguments; ``default``: the agent's grace period, for ``grace=None``.

    Args:
        death_sig: the graceful signal.
        grace: seconds before SIGKILL, or None for ``default``.
        default: the agent's ``grace_period``.
        name: how the caller spelled ``grace`` (``"grace_period"``, or the
            deprecated ``"timeout"``), for the message.

    Returns:
        ``(signal, grace)``: ``death_sig`` as a ``signal.Signals``, and the
        grace period before SIGKILL (``grace`` as given, or ``default``).

    Raises:
        ValueError: as ``LocalElasticAgent.stop`` documents.
    """
    try:
        sig = signal.Signals(death_sig)
    except (ValueError, TypeError):
        raise ValueError(f"death_sig must be a signal number, got {death_sig!r}") from None
    value = default if grace is None else grace
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a number >= 0, got {grace!r}")
    return sig, value
