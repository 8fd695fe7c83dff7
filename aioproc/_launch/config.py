"""``LaunchConfig``: torch 2.13's launch configuration, field for field, and its checks.

The fields, their order and their defaults are torch's
(``torch.distributed.launcher.api.LaunchConfig``), and so is what
construction fills in: the rendezvous ``timeout`` (``rdzv_timeout``, else
900 s), a ``DefaultLogsSpecs`` when none is given, and the shutdown
timeout from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``.  A config is plain data a
caller may change until it is launched; ``check_config`` reads every field
when a launch begins, before anything starts.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._base.checks import check_path_name
from .._cli.devices import NUMA_MODES
from .._cli.run import _grace_period
from .._cli.values import _parse_signals
from ..logs import DefaultLogsSpecs, LogsSpecs

__all__ = ["LaunchConfig", "check_config", "entrypoint_name", "numa_mode", "signals"]

DEFAULT_RDZV_TIMEOUT = 900
"""torch's rendezvous ``timeout`` when the config names none (seconds)."""

START_METHODS = ("spawn", "fork", "forkserver")


@dataclass
class LaunchConfig:
    """How to launch the workers of one node (torch's ``LaunchConfig``, the same fields).

    Attributes:
        min_nodes, max_nodes: the job's nodes, each launching its own
            workers; with ``max_nodes == 1`` this host runs alone, whatever
            the rendezvous fields say (as ``aioproc run`` does).
        nproc_per_node: the workers this node starts.
        logs_specs: where the workers' output goes, an aioproc
            ``LogsSpecs`` (default: ``DefaultLogsSpecs()``: the console,
            error files in a private temp dir).
        run_id: the job's id (``TORCHELASTIC_RUN_ID``); ``""``: a random
            one, written back here when the launch begins, as torch does.
        role: the workers' role (``ROLE_NAME``, the console prefix).
        rdzv_endpoint, rdzv_backend: where and how the nodes meet: any
            backend of ``aioproc.rendezvous`` (``c10d``, ``etcd``,
            ``static``).  ``static`` takes the master's ``HOST:PORT`` as its
            endpoint and this node's rank as ``rdzv_configs["rank"]``.
        rdzv_configs: the backend's options (``--rdzv-conf``).
        rdzv_timeout: torch's legacy way to set ``rdzv_configs["timeout"]``.
        max_restarts: restarts of the whole group after a failure.
        monitor_interval: accepted for torch's sake; exits are acted on
            when they happen.
        start_method: ``spawn``, ``forkserver``, or torch's ``fork``
            (function workers are then forked from the forkserver's
            template, never from the caller; programs are spawned).
        log_line_prefix_template: the console prefix, with
            ``${role_name}``, ``${rank}``, ``${local_rank}``.
        metrics_cfg: accepted for torch's sake; aioproc's metrics are
            ``aioproc.metrics``.
        local_addr: the address this node is known by in the rendezvous.
        event_log_handler: where torch's elastic events go (``null``,
            ``console``, ``dynamic_rendezvous``, or a handler registered in
            torch's events module).
        numa_options: ``None``, one of torch's affinity modes (``"node"``,
            ``"socket"``, ``"exclusive"``, ``"core-complex"``), or torch's
            ``NumaOptions``: each worker's CPUs near its GPU.
        signals_to_handle: the signals that stop the workers when a blocking
            launch runs in the main thread (comma-separated names); the
            workers get it as ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
        duplicate_stdout_filters, duplicate_stderr_filters: tee'd lines
            containing any of these are also written to the attempt's
            ``filtered_std*.log``.
        virtual_local_rank: every worker gets ``LOCAL_RANK=0`` and sees only
            its own GPU.
        shutdown_timeout: seconds from the stop signal to SIGKILL (default:
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30).

    Raises:
        ValueError: a negative ``shutdown_timeout``, or a bad
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``.
        TypeError: ``rdzv_configs`` is not a dict.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: LogsSpecs | None = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rdzv_configs, dict):
            raise TypeError(
                f"LaunchConfig.rdzv_configs must be a dict of the backend's options, "
                f"got {self.rdzv_configs!r}"
            )
        # torch's order: the legacy argument wins, else a timeout the configs name
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT
        if self.logs_specs is None:
            self.logs_specs = DefaultLogsSpecs()
        if self.shutdown_timeout is None:
            # --shutdown-timeout's default, read as aioproc run reads it
            self.shutdown_timeout = _grace_period(argparse.Namespace(grace_period=None))
        elif _number(self.shutdown_timeout) and self.shutdown_timeout < 0:
            raise ValueError(
                f"LaunchConfig.shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}"
            )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LaunchConfig.{name} must be an int >= {minimum}, got {value!r}")


def _seconds(name: str, value: Any) -> None:
    if not _number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"LaunchConfig.{name} must be a number of seconds >= 0, got {value!r}")


def _text(name: str, value: Any, *, empty: bool = False) -> None:
    if not isinstance(value, str) or (not empty and not value):
        what = "a str" if empty else "a non-empty str"
        raise TypeError(f"LaunchConfig.{name} must be {what}, got {value!r}")


def _filters(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str) or not all(isinstance(item, str) for item in value):
        raise TypeError(f"LaunchConfig.{name} must be a list of str or None, got {value!r}")


def numa_mode(value: Any) -> str | None:
    """``numa_options`` as one of torch's affinity modes (None: no binding).

    Raises:
        ValueError: neither None, a mode name, nor torch's ``NumaOptions``.
    """
    if value is None:
        return None
    mode = getattr(getattr(value, "affinity_mode", value), "value", value)
    if mode not in NUMA_MODES:
        raise ValueError(
            f"LaunchConfig.numa_options must be None, one of {', '.join(NUMA_MODES)} "
            f"or torch's NumaOptions, got {value!r}"
        )
    return str(mode)


def check_config(config: LaunchConfig) -> None:
    """Read every field of ``config`` as a launch will, before anything starts.

    The rendezvous options and the logs are checked where they are used
    (the backend's handler, the agent), with messages naming them.

    Raises:
        TypeError: ``config`` is no ``LaunchConfig``, or a field has the
            wrong type (the message names it).
        ValueError: a field's value is out of range, or names no start
            method, signal, NUMA mode or run id.
    """
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"expected an aioproc.launcher.LaunchConfig, got {config!r}")
    _count("min_nodes", config.min_nodes, 1)
    _count("max_nodes", config.max_nodes, 1)
    if config.max_nodes < config.min_nodes:
        raise ValueError(
            f"LaunchConfig.max_nodes ({config.max_nodes}) must be >= min_nodes ({config.min_nodes})"
        )
    _count("nproc_per_node", config.nproc_per_node, 1)
    _count("max_restarts", config.max_restarts, 0)
    _seconds("monitor_interval", config.monitor_interval)
    _seconds("shutdown_timeout", config.shutdown_timeout)
    if not isinstance(config.logs_specs, LogsSpecs):
        raise TypeError(
            f"LaunchConfig.logs_specs must be an aioproc LogsSpecs (aioproc.DefaultLogsSpecs "
            f"takes torch's arguments), got {config.logs_specs!r}"
        )
    _text("run_id", config.run_id, empty=True)
    if config.run_id:
        check_path_name("LaunchConfig.run_id", config.run_id)  # a directory of the logs
    _text("role", config.role)
    _text("rdzv_backend", config.rdzv_backend)
    _text("rdzv_endpoint", config.rdzv_endpoint, empty=True)
    if not isinstance(config.rdzv_configs, dict):
        raise TypeError(f"LaunchConfig.rdzv_configs must be a dict, got {config.rdzv_configs!r}")
    if config.start_method not in START_METHODS:
        raise ValueError(
            f"LaunchConfig.start_method must be one of {', '.join(START_METHODS)}, "
            f"got {config.start_method!r}"
        )
    if config.log_line_prefix_template is not None:
        _text("log_line_prefix_template", config.log_line_prefix_template, empty=True)
    if config.local_addr is not None:
        _text("local_addr", config.local_addr)
    _text("event_log_handler", config.event_log_handler)
    numa_mode(config.numa_options)
    signals(config.signals_to_handle)
    _filters("duplicate_stdout_filters", config.duplicate_stdout_filters)
    _filters("duplicate_stderr_filters", config.duplicate_stderr_filters)
    if not isinstance(config.virtual_local_rank, bool):
        raise TypeError(
            f"LaunchConfig.virtual_local_rank must be a bool, got {config.virtual_local_rank!r}"
        )


def signals(value: Any) -> tuple[Any, ...]:
    """``signals_to_handle`` as signals, read as ``--signals-to-handle`` is.

    Raises:
        ValueError: not comma-separated names of signals that can be caught.
    """
    if not isinstance(value, str):
        raise TypeError(f"LaunchConfig.signals_to_handle must be a str, got {value!r}")
    try:
        return _parse_signals(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"LaunchConfig.signals_to_handle: {e}") from None


def entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: tuple[Any, ...]) -> str:
    """The job's name in the failure summary, as torch's launcher names it.

    A function's ``__name__``; for ``sys.executable``, the first argument
    that is no option (the script or module); else the program itself.
    """
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", entrypoint))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""
