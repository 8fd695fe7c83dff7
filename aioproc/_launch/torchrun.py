"""torchrun's Python entry points: ``config_from_args``, ``run``, ``main`` and torch's helpers.

``config_from_args`` reads torchrun's ``Namespace`` as ``aioproc run``
reads its flags (``flags.run_flags``) and builds the command, its
arguments and the logs with that command's own functions (``_cli.run``),
then the ``LaunchConfig`` torch builds from them; ``run`` is torch's
``run``: the single-node and ``--standalone`` defaults, then
``elastic_launch(config, cmd)(*cmd_args)``, raising what it raises.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

from .._cli.run import PREFIX_TEMPLATE_ENV, _entrypoint, _make_logs_specs
from .._cli.torchrun import run_script_path
from .._cli.values import _parse_nnodes, parse_nproc
from .._errors.record import record
from .blocking import elastic_launch
from .config import LaunchConfig
from .flags import run_flags
from .parser import DESTS, get_args_parser, parse_args

__all__ = [
    "config_from_args",
    "determine_local_world_size",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]

logger = logging.getLogger("aioproc.torchrun")

LOCAL_RANK_MACRO = "${local_rank}"
"""Replaced by each worker's local rank in its arguments (torch's ``macros.local_rank``)."""


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` as ``(min_nodes, max_nodes)``.

    Raises:
        ValueError: not a number of nodes (0 < MIN <= MAX).
    """
    try:
        return _parse_nnodes(str(nnodes))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--nnodes {nnodes!r}: {e}") from None


def determine_local_world_size(nproc_per_node: str) -> int:
    """``--nproc-per-node``: a number, or ``auto``, ``cpu``, ``gpu``, ``xpu`` as torch counts them.

    Raises:
        ValueError: an unknown kind, or a device kind this host has none of.
    """
    try:
        return parse_nproc(str(nproc_per_node))
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--nproc-per-node {nproc_per_node!r}: {e}") from None


def get_rdzv_endpoint(args: argparse.Namespace) -> str:
    """The rendezvous endpoint: ``--rdzv-endpoint``, else the static master's ``ADDR:PORT``."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return str(args.rdzv_endpoint)


def get_use_env(args: argparse.Namespace) -> bool:
    """Whether the workers learn their local rank from the environment only.

    ``False`` only for a ``Namespace`` of torch's legacy
    ``torch.distributed.launch`` whose ``use_env`` is off: the script then
    gets ``--local-rank=<local rank>`` before its own arguments.
    """
    return bool(getattr(args, "use_env", True))


def config_from_args(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """torchrun's parsed flags as a launch: its config, the command and its arguments.

    Args:
        args: a ``Namespace`` with ``get_args_parser()``'s dests (one
            missing takes that parser's default).

    Returns:
        ``(config, cmd, cmd_args)``: ``cmd`` is the Python interpreter
        (``PYTHON_EXEC``, else this one) with ``-u [-m] script args``, the
        program itself with ``--no-python``, or ``run_script_path`` with
        ``--run-path``.

    Raises:
        ValueError: a bad value (naming the flag), ``--no-python`` with
            ``--module``, or ``--run-path`` without an existing script.
            Nothing was started.
    """
    known = {a.dest: a.default for a in get_args_parser()._actions if a.dest != "help"}
    full = argparse.Namespace(**{**known, **vars(args)})
    if not full.training_script:
        raise ValueError("training_script is missing: the script (or program) to run")
    full.training_script_args = list(full.training_script_args or ())
    flags = run_flags(full, DESTS)
    if not get_use_env(full):
        flags.script_args = [f"--local-rank={LOCAL_RANK_MACRO}", *flags.script_args]
    cmd, cmd_args = _entrypoint(flags)
    logs_specs, _ = _make_logs_specs(flags)
    min_nodes, max_nodes = flags.nnodes
    rdzv_configs: dict[str, Any] = dict(flags.rdzv_conf)
    if flags.rdzv_backend == "static":
        rdzv_configs["rank"] = flags.node_rank
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=flags.nproc_per_node,
        logs_specs=logs_specs,
        run_id=flags.run_id,
        role=flags.role,
        rdzv_endpoint=get_rdzv_endpoint(full),
        rdzv_backend=flags.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=flags.max_restarts,
        monitor_interval=flags.monitor_interval,
        start_method=flags.start_method,
        log_line_prefix_template=os.environ.get(PREFIX_TEMPLATE_ENV),  # as torchrun reads it
        local_addr=flags.local_addr,
        event_log_handler=flags.event_log_handler,
        numa_options=flags.numa_binding,
        signals_to_handle=",".join(sig.name for sig in flags.signals_to_handle),
        duplicate_stdout_filters=flags.duplicate_stdout_filters,
        duplicate_stderr_filters=flags.duplicate_stderr_filters,
        virtual_local_rank=flags.virtual_local_rank,
        shutdown_timeout=flags.grace_period,
    )
    return config, cmd, list(cmd_args)


def run(args: argparse.Namespace) -> None:
    """Run the job ``args`` describes, and return when it succeeded (torch's ``run``).

    As torch's: ``--standalone``, and the static backend on one node with
    no master port, run on a rendezvous of their own (``c10d`` on
    ``localhost:0``, a random id); the master port defaults to 29500.
    ``--standalone`` is this host alone whatever ``--nnodes`` says, as with
    ``aioproc run``.  ``args`` is changed accordingly, as torch changes it.

    Raises:
        ChildFailedError: the workers failed after the restarts.
        ValueError: a bad flag or combination (see ``config_from_args``);
            nothing was started.
        SignalException: in the main thread, one of ``--signals-to-handle``
            arrived; the workers were stopped with it.
        RendezvousError: the node could not join its job, or lost it.
    """
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        args.nnodes = "1"  # aioproc run's --standalone: this host alone
        logger.info(
            "--standalone: --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --rdzv-id=%s",
            args.rdzv_id,
        )
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    elastic_launch(config, cmd)(*cmd_args)


@record
def main(args: list[str] | None = None) -> None:
    """torchrun: parse ``args`` (default: ``sys.argv[1:]``) and run the job (torch's ``main``).

    Raises:
        ChildFailedError: the workers failed; with ``TORCHELASTIC_ERROR_FILE``
            set, the root cause's error file is copied there (``@record``).
        ValueError: a bad flag or combination, such as ``--no-python`` with
            ``--module``, before anything starts.
        SystemExit: ``--help``, or a usage error of the parser (status 2).
    """
    run(parse_args(args))
