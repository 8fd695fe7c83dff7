"""Building one ``aioproc run`` from its parsed flags: the spec, the logs, the rendezvous.

``_make_run`` checks the flags that only make sense together, and turns
them into a ``_Run``: the agent's ``WorkerSpec`` (with the rendezvous
handler of a multi-node job), its ``LogsSpecs`` (the live view's when
stdout is a terminal, or ``--logs-specs``'s), and what the supervision
needs (signals, grace period, prefix template, torch's event log, the
CPUs ``--numa-binding`` gives each rank, the metrics endpoint).  Each
rank's limits (``--memory-limit``, ``--cpu-limit``, ``--pids-limit``) and
CPUs (``--cpu-affinity``) go into the spec, which hands them to every
attempt's group.  Nothing starts here.  The
agent, the logs and the rendezvous are imported when a run is made, never
for ``--help``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .values import (
    SHUTDOWN_TIMEOUT_ENV,
    SIGNALS_ENV,
    _number,
    _parse_signals,
)

if TYPE_CHECKING:
    from .. import Limits
    from ..agent import WorkerSpec
    from ..logs import LogsSpecs
    from ..rendezvous import RendezvousHandler
    from .torchrun import EventLog

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PYTHON_EXEC_ENV = "PYTHON_EXEC"  # torchrun's interpreter for the script

logger = logging.getLogger("aioproc.cli")


@dataclass
class _Run:
    """What one ``aioproc run`` does, from its parsed flags."""

    name: str  # the entrypoint's name, the failure summary's title (as torchrun)
    spec: WorkerSpec
    logs_specs: LogsSpecs
    run_id: str | None
    grace_period: float
    start_method: str
    live: bool
    signals: tuple[signal.Signals, ...]
    log_line_prefix_template: str | None
    show_log_dir: bool  # --log-dir was given: say where this run's logs are
    event_log: EventLog | None = None  # --event-log-handler's, unless it drops everything
    numa: dict[int, frozenset[int]] = field(default_factory=dict)  # local rank -> its CPUs
    metrics: tuple[str, int] | None = None  # --metrics-host and --metrics-port
    notes: list[str] = field(default_factory=list)  # said once, as the run starts


def _handled_signals(ns: argparse.Namespace) -> tuple[signal.Signals, ...]:
    """The flag, else torchrun's environment variable, else aioproc's default."""
    if ns.signals_to_handle is not None:
        return tuple(ns.signals_to_handle)
    from_env = os.environ.get(SIGNALS_ENV, "").strip()
    if from_env:
        try:
            return _parse_signals(from_env)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{SIGNALS_ENV}: {e}") from None
    return (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)


def _grace_period(ns: argparse.Namespace) -> float:
    """``--shutdown-timeout`` (or its PET_ variable), else torch's variable, else 30 s."""
    if ns.grace_period is not None:
        return float(ns.grace_period)
    from_env = os.environ.get(SHUTDOWN_TIMEOUT_ENV)
    if from_env is None:
        return 30.0
    try:
        return float(_number(float, 0)(from_env))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}: {e}") from None


def _start_method(ns: argparse.Namespace) -> str:
    """The start method; torchrun's ``fork`` becomes the method that does what it does there.

    torchrun execs a script whatever the method, so its scripts are spawned
    here too; the only workers it forks are ``--run-path`` ones, which are
    forked here from the forkserver template, never from this command's
    process (its event loop and threads would be copied into every worker).
    """
    if ns.start_method != "fork":
        return str(ns.start_method)
    return "forkserver" if ns.run_path else "spawn"


def _entrypoint(ns: argparse.Namespace) -> tuple[Callable[..., Any] | str, list[str]]:
    """What each worker runs and its arguments, as torchrun's ``config_from_args`` builds them."""
    if ns.run_path:  # torchrun's precedence: over --no-python and -m
        from .torchrun import run_script_path

        if not os.path.exists(ns.script):
            raise ValueError(f"--run-path needs an existing script, got {ns.script!r}")
        return run_script_path, [ns.script, *ns.script_args]
    if ns.no_python and ns.module:
        raise ValueError("--no-python and -m/--module cannot be used together")
    if ns.no_python:
        return ns.script, list(ns.script_args)
    python = os.environ.get(PYTHON_EXEC_ENV) or sys.executable  # as torchrun reads it
    return python, ["-u", *(["-m"] if ns.module else []), ns.script, *ns.script_args]


def _make_logs_specs(ns: argparse.Namespace) -> tuple[LogsSpecs, bool]:
    """``--logs-specs``'s class (torchrun's entry point) made with the log flags; and live or not.

    The live view needs aioproc's own layout: with another class, output
    is plain.
    """
    from ..logs import DefaultLogsSpecs, LogsSpecs

    redirects, tee = ns.redirects, ns.tee  # argparse parses string defaults too
    factory: Callable[..., LogsSpecs] = DefaultLogsSpecs
    if ns.logs_specs is not None:
        from .torchrun import logs_specs_class

        factory = logs_specs_class(ns.logs_specs)
    if factory is DefaultLogsSpecs and not ns.no_live and _live_possible():
        from .live import LiveLogsSpecs

        return LiveLogsSpecs(ns.log_dir, redirects, tee, ns.local_ranks_filter), True
    try:
        specs = factory(
            log_dir=ns.log_dir,
            redirects=redirects,
            tee=tee,
            local_ranks_filter=ns.local_ranks_filter,
        )
    except Exception as e:
        raise ValueError(f"--logs-specs {ns.logs_specs!r}: {type(e).__name__}: {e}") from None
    if not isinstance(specs, LogsSpecs):
        raise ValueError(f"--logs-specs {ns.logs_specs!r} made {specs!r}, not a LogsSpecs")
    return specs, False


def _numa(ns: argparse.Namespace) -> tuple[dict[int, frozenset[int]], list[str]]:
    """``--numa-binding``: each local rank's CPUs, and what to tell the user about it."""
    if ns.numa_binding is None:
        return {}, []
    from .devices import numa_cpus, ranges

    cpus, note = numa_cpus(ns.numa_binding, ns.nproc_per_node)
    flag = f"--numa-binding {ns.numa_binding}"
    if not cpus:
        return {}, [f"{flag}: no worker is bound: {note}"]
    for rank, mine in sorted(cpus.items()):
        logger.info("%s: local rank %d runs on CPUs %s", flag, rank, ranges(mine))
    return cpus, [f"{flag}: {note}"] if note else []


def _limits(ns: argparse.Namespace) -> dict[int, Limits] | None:
    """``--memory-limit``, ``--cpu-limit`` and ``--pids-limit``: one ``Limits`` per local rank.

    The flags limit each rank on its own, not the ranks together, so every
    rank gets a placement of its own.
    """
    if ns.memory_limit is None and ns.cpu_limit is None and ns.pids_limit is None:
        return None
    from .. import Limits

    one = Limits(memory=ns.memory_limit, cpus=ns.cpu_limit, pids=ns.pids_limit)
    return dict.fromkeys(range(ns.nproc_per_node), one)


def _event_log(ns: argparse.Namespace) -> EventLog | None:
    """``--event-log-handler``'s recorder; None for torch's handlers that drop every event."""
    from .torchrun import EventLog, event_handler

    handler = event_handler(ns.event_log_handler)
    if type(handler) is logging.NullHandler:
        return None
    return EventLog(ns.event_log_handler, handler, ns.rdzv_backend)


def _make_run(ns: argparse.Namespace) -> _Run:
    from ..agent import RestartPolicy, WorkerSpec

    start_method = _start_method(ns)
    preload = [name for names in ns.preload for name in names]
    if preload and start_method != "forkserver":
        raise ValueError(
            f"--preload {','.join(preload)} needs --start-method forkserver "
            "(only the forkserver template preloads modules)"
        )
    if preload and ns.no_python and not ns.run_path:
        raise ValueError(
            "--preload needs a Python script or module: --no-python programs are spawned"
        )
    if ns.cpu_affinity is not None and ns.numa_binding is not None:
        raise ValueError(
            f"--cpu-affinity {_shown(ns.cpu_affinity)} and --numa-binding {ns.numa_binding} "
            "cannot be used together: both choose the ranks' CPUs"
        )
    entrypoint, args = _entrypoint(ns)
    grace_period = _grace_period(ns)
    logs_specs, live = _make_logs_specs(ns)
    numa, notes = _numa(ns)
    sigs = list(_handled_signals(ns))
    if ns.forward_sighup and signal.SIGHUP not in sigs:
        sigs.append(signal.SIGHUP)
    event_log = _event_log(ns)
    rdzv_handler = _make_rdzv_handler(ns)
    # torchrun gives the spec a master address of its own only with one host or a
    # fixed world; an elastic rendezvous publishes group rank 0's
    own_master = rdzv_handler is None or not rdzv_handler.elastic
    spec = WorkerSpec(
        role=ns.role,
        local_world_size=ns.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        redirects=ns.redirects,
        tee=ns.tee,
        local_ranks_filter=ns.local_ranks_filter,
        master_addr=ns.master_addr if own_master else None,
        master_port=ns.master_port if own_master else None,
        restart_policy=ns.backoff or RestartPolicy(),
        watchdog=ns.watchdog,
        duplicate_stdout_filters=ns.duplicate_stdout_filters or None,
        duplicate_stderr_filters=ns.duplicate_stderr_filters or None,
        preload=preload,
        # torchrun exports the list it handles; workers see the same variable
        env={SIGNALS_ENV: ",".join(sig.name for sig in sigs)},
        rdzv_handler=rdzv_handler,
        virtual_local_rank=ns.virtual_local_rank,
        limits=_limits(ns),
        cpus=ns.cpu_affinity,
    )
    template = ns.log_line_prefix_template
    if template is None:
        template = os.environ.get(PREFIX_TEMPLATE_ENV)  # as torchrun reads it
    return _Run(
        name=ns.script,
        spec=spec,
        logs_specs=logs_specs,
        run_id=ns.run_id,
        grace_period=grace_period,
        start_method=start_method,
        live=live,
        signals=tuple(sigs),
        log_line_prefix_template=template,
        show_log_dir=ns.log_dir is not None and ns.log_dir != os.devnull,
        event_log=event_log,
        numa=numa,
        notes=notes,
        metrics=None if ns.metrics_port is None else (ns.metrics_host, ns.metrics_port),
    )


def _shown(cpus: list[int] | str) -> str:
    """``--cpu-affinity``'s value, near enough as written (``0-3`` shows as ``0,1,2,3``)."""
    return cpus if isinstance(cpus, str) else ",".join(map(str, cpus))


def _make_rdzv_handler(ns: argparse.Namespace) -> RendezvousHandler | None:
    """The rendezvous handler for a run over several nodes; None for this host alone.

    The backend is looked up in the registry (aioproc's own, those other
    packages register); what its class says of itself (``elastic``,
    ``needs_endpoint``, ``needs_run_id``, ``hosts_store``) decides which
    flags it needs and what it is passed, as torchrun's ``config_from_args``
    passes ``--node-rank`` and the master's address to a fixed world only.
    ``--rdzv-id`` defaults to torchrun's ``none``.

    Raises:
        ValueError: flags that do not make a multi-node run, an unknown
            backend, or one that refuses its options (the message says which).
    """
    min_nodes, max_nodes = ns.nnodes
    if ns.standalone or max_nodes == 1:
        if ns.node_rank != 0:
            raise ValueError(f"--node-rank {ns.node_rank} needs --nnodes > 1")
        return None
    from ..rendezvous import RendezvousParameters, rendezvous_handler_registry

    backend = ns.rdzv_backend
    registry = rendezvous_handler_registry
    if backend not in registry.names(aliases=True):
        names = registry.names()
        raise ValueError(
            f"--rdzv-backend {backend!r} cannot join several nodes in aioproc; "
            f"use {', '.join(names[:-1])} or {names[-1]}"
        )
    try:
        cls = registry.backend(backend)
    except ImportError as e:
        raise ValueError(str(e)) from None
    conf: dict[str, Any] = dict(ns.rdzv_conf)
    if not cls.elastic:
        if min_nodes != max_nodes:
            elastic = [name for name in registry.names() if _elastic(name)]
            raise ValueError(
                f"--nnodes {min_nodes}:{max_nodes} is elastic: use --rdzv-backend "
                f"{' or '.join(elastic)}, or a fixed --nnodes N with --rdzv-backend {backend}"
            )
        if ns.node_rank >= max_nodes:
            raise ValueError(f"--node-rank {ns.node_rank} must be < --nnodes {max_nodes}")
        conf["node_rank"] = ns.node_rank
        conf["master_addr"] = ns.master_addr
        conf.setdefault("master_port", ns.master_port or 29500)
    if cls.needs_endpoint and not ns.rdzv_endpoint:
        raise ValueError(f"--rdzv-backend {backend} needs --rdzv-endpoint {cls.endpoint_help}")
    if cls.needs_run_id and ns.run_id is None:
        raise ValueError(f"--rdzv-backend {backend} needs --rdzv-id (the job's id)")
    if cls.hosts_store and ns.log_dir not in (None, os.devnull):
        conf.setdefault("data_dir", ns.log_dir)  # the hosted store's data, beside the logs
    params = RendezvousParameters(
        backend,
        ns.rdzv_endpoint,
        ns.run_id or "none",
        min_nodes,
        max_nodes,
        local_addr=ns.local_addr,
        **conf,
    )
    try:
        return registry.create_handler(params)
    except ImportError as e:
        raise ValueError(str(e)) from None


def _elastic(name: str) -> bool:
    """Whether the backend ``name`` forms its world itself; False if it cannot be loaded."""
    from ..rendezvous import rendezvous_handler_registry

    try:
        return rendezvous_handler_registry.backend(name).elastic
    except (ImportError, ValueError):
        return False


def _live_possible() -> bool:
    """Whether stdout is a terminal the live view can draw on (rich installed)."""
    try:
        if not sys.stdout.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    try:
        from rich.console import Console
    except ImportError:
        return False
    return Console().is_interactive
