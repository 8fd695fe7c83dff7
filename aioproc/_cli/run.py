"""Building one ``aioproc run`` from its parsed flags: the spec, the logs, the rendezvous.

``_make_run`` checks the flags that only make sense together, and turns
them into a ``_Run``: the agent's ``WorkerSpec`` (with the rendezvous
handler of a multi-node job), its ``LogsSpecs`` (the live view's when
stdout is a terminal), and what the supervision needs (signals, grace
period, prefix template).  Nothing starts here.  The agent, the logs and
the rendezvous are imported when a run is made, never for ``--help``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .values import MULTI_NODE_BACKENDS, SIGNALS_ENV, _parse_signals

if TYPE_CHECKING:
    from ..agent import WorkerSpec
    from ..logs import LogsSpecs

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


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


def _make_run(ns: argparse.Namespace) -> _Run:
    from ..agent import RestartPolicy, WorkerSpec
    from ..logs import DefaultLogsSpecs

    if ns.no_python and ns.module:
        raise ValueError("--no-python and -m/--module cannot be used together")
    preload = [name for names in ns.preload for name in names]
    if preload and ns.start_method != "forkserver":
        raise ValueError(
            f"--preload {','.join(preload)} needs --start-method forkserver "
            "(only the forkserver template preloads modules)"
        )
    if preload and ns.no_python:
        raise ValueError(
            "--preload needs a Python script or module: --no-python programs are spawned"
        )
    if ns.no_python:
        entrypoint: str = ns.script
        args: list[str] = list(ns.script_args)
    else:
        entrypoint = sys.executable
        args = ["-u", *(["-m"] if ns.module else []), ns.script, *ns.script_args]
    redirects, tee = ns.redirects, ns.tee  # argparse parses string defaults too
    live = not ns.no_live and _live_possible()
    logs_specs: LogsSpecs
    if live:
        from .live import LiveLogsSpecs

        logs_specs = LiveLogsSpecs(ns.log_dir, redirects, tee, ns.local_ranks_filter)
    else:
        logs_specs = DefaultLogsSpecs(ns.log_dir, redirects, tee, ns.local_ranks_filter)
    sigs = list(_handled_signals(ns))
    if ns.forward_sighup and signal.SIGHUP not in sigs:
        sigs.append(signal.SIGHUP)
    rdzv_handler = _make_rdzv_handler(ns)
    spec = WorkerSpec(
        role=ns.role,
        local_world_size=ns.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ns.local_ranks_filter,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        restart_policy=ns.backoff or RestartPolicy(),
        watchdog=ns.watchdog,
        preload=preload,
        # torchrun exports the list it handles; workers see the same variable
        env={SIGNALS_ENV: ",".join(sig.name for sig in sigs)},
        rdzv_handler=rdzv_handler,
    )
    template = ns.log_line_prefix_template
    if template is None:
        template = os.environ.get(PREFIX_TEMPLATE_ENV)  # as torchrun reads it
    return _Run(
        name=ns.script,
        spec=spec,
        logs_specs=logs_specs,
        run_id=ns.run_id,
        grace_period=ns.grace_period,
        start_method=ns.start_method,
        live=live,
        signals=tuple(sigs),
        log_line_prefix_template=template,
        show_log_dir=ns.log_dir is not None and ns.log_dir != os.devnull,
    )


def _make_rdzv_handler(ns: argparse.Namespace) -> Any:
    """The rendezvous handler for a run over several nodes; None for this host alone.

    Raises:
        ValueError: flags that do not make a multi-node run (the message says which).
    """
    min_nodes, max_nodes = ns.nnodes
    if ns.standalone or max_nodes == 1:
        if ns.node_rank != 0:
            raise ValueError(f"--node-rank {ns.node_rank} needs --nnodes > 1")
        return None
    from ..rendezvous import RendezvousParameters, create_handler

    backend = ns.rdzv_backend
    if backend not in MULTI_NODE_BACKENDS:
        raise ValueError(
            f"--rdzv-backend {backend!r} cannot join several nodes in aioproc; "
            f"use {' or '.join(MULTI_NODE_BACKENDS[::2])}"
        )
    conf: dict[str, Any] = dict(ns.rdzv_conf)
    if backend == "static":
        if min_nodes != max_nodes:
            raise ValueError(
                f"--nnodes {min_nodes}:{max_nodes} is elastic: use --rdzv-backend etcd, "
                f"or a fixed --nnodes N with --rdzv-backend static"
            )
        if ns.node_rank >= max_nodes:
            raise ValueError(f"--node-rank {ns.node_rank} must be < --nnodes {max_nodes}")
        conf["node_rank"] = ns.node_rank
        conf["master_addr"] = ns.master_addr
        conf.setdefault("master_port", ns.master_port or 29500)
        endpoint = ns.rdzv_endpoint
    else:
        if not ns.rdzv_endpoint:
            raise ValueError(
                f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (the etcd server)"
            )
        if ns.run_id is None:
            raise ValueError(f"--rdzv-backend {backend} needs --rdzv-id (the job's id)")
        endpoint = ns.rdzv_endpoint
    params = RendezvousParameters(
        backend,
        endpoint,
        ns.run_id or "none",
        min_nodes,
        max_nodes,
        local_addr=ns.local_addr,
        **conf,
    )
    try:
        return create_handler(params)
    except ImportError as e:
        raise ValueError(str(e)) from None


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
