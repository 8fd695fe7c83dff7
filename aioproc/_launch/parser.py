"""torchrun's argument parser: torch 2.13's flags, dests, defaults and ``PET_`` variables.

A tool that builds on ``torch.distributed.run`` reads the ``Namespace`` by
torch's dests (``training_script``, ``rdzv_id``, ``nnodes`` as a string,
...), so this parser keeps them, with torch's defaults and value types;
what each value means is ``aioproc run``'s (``flags.run_flags`` reads it
with that command's parser when the job is built).  The options' help is
``aioproc run``'s too, taken from its parser, so the two never tell
different stories.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from .._cli.args import _build_parsers, _HelpFormatter
from .._cli.devices import NUMA_MODES
from .._cli.values import EnvDefault, EnvSwitch, _parse_filters
from .config import START_METHODS
from .flags import RENAMED

__all__ = ["DESTS", "get_args_parser", "parse_args"]

_DESCRIPTION = """\
aioproc's torchrun: start NPROC workers of a script (a module, a program) on this
node, with torchrun's flags, environment variables and worker environment, on
aioproc's asyncio agent (aioproc.torchrun, a stand-in for torch.distributed.run).
"""


def _seconds(value: str) -> int | float:
    """``--shutdown-timeout``: torch's whole seconds, or a fraction (aioproc's)."""
    number = float(value)
    return int(number) if number.is_integer() else number


@dataclass(frozen=True)
class _Flag:
    """One of torchrun's options, as torch 2.13's parser has it."""

    strings: tuple[str, ...]
    dest: str
    default: Any = None
    type: Any = str
    switch: bool = False  # torch's check_env: off, or on by its PET_ variable
    env: bool = True  # torch's env action: the PET_<DEST> variable is the default
    choices: tuple[str, ...] | None = None


_FLAGS = (
    _Flag(("--nnodes",), "nnodes", "1:1"),
    _Flag(("--nproc-per-node", "--nproc_per_node"), "nproc_per_node", "1"),
    _Flag(("--rdzv-backend", "--rdzv_backend"), "rdzv_backend", "static"),
    _Flag(("--rdzv-endpoint", "--rdzv_endpoint"), "rdzv_endpoint", ""),
    _Flag(("--rdzv-id", "--rdzv_id"), "rdzv_id", "none"),
    _Flag(("--rdzv-conf", "--rdzv_conf"), "rdzv_conf", ""),
    _Flag(("--standalone",), "standalone", switch=True),
    _Flag(("--max-restarts", "--max_restarts"), "max_restarts", 0, int),
    _Flag(("--monitor-interval", "--monitor_interval"), "monitor_interval", 0.1, float),
    _Flag(("--start-method", "--start_method"), "start_method", "spawn", choices=START_METHODS),
    _Flag(("--event-log-handler", "--event_log_handler"), "event_log_handler", "null"),
    _Flag(("--role",), "role", "default"),
    _Flag(("-m", "--module"), "module", switch=True),
    _Flag(("--no-python", "--no_python"), "no_python", switch=True),
    _Flag(("--run-path", "--run_path"), "run_path", switch=True),
    _Flag(("--log-dir", "--log_dir"), "log_dir"),
    _Flag(("-r", "--redirects"), "redirects", "0"),
    _Flag(("-t", "--tee"), "tee", "0"),
    _Flag(("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", ""),
    _Flag(
        ("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
        "duplicate_stdout_filters",
        [],
        _parse_filters,
    ),
    _Flag(
        ("--duplicate-stderr-filters", "--duplicate_stderr_filters"),
        "duplicate_stderr_filters",
        [],
        _parse_filters,
    ),
    _Flag(("--node-rank", "--node_rank"), "node_rank", 0, int),
    _Flag(("--master-addr", "--master_addr"), "master_addr", "127.0.0.1"),
    _Flag(("--master-port", "--master_port"), "master_port", None, int),
    _Flag(("--local-addr", "--local_addr"), "local_addr"),
    _Flag(("--logs-specs", "--logs_specs"), "logs_specs", env=False),
    _Flag(("--numa-binding", "--numa_binding"), "numa_binding", env=False, choices=NUMA_MODES),
    _Flag(
        ("--signals-to-handle", "--signals_to_handle"),
        "signals_to_handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    ),
    _Flag(("--shutdown-timeout", "--shutdown_timeout"), "shutdown_timeout", None, _seconds),
    _Flag(("--virtual-local-rank", "--virtual_local_rank"), "virtual_local_rank", switch=True),
)

DESTS = [flag.dest for flag in _FLAGS] + ["training_script", "training_script_args"]
"""Every dest of torchrun's ``Namespace``, in torch's order."""

_DEFAULT_NOTE = re.compile(r"\s*\(default[^)]*\)")

_AIOPROC_RUN_ONLY = (
    ("each running 'aioproc run'", "each running this command"),
    ("a template interpreter that imported --preload once", "a template interpreter"),
)
"""Words of ``aioproc run``'s help that name that command or its own flags, as
this parser says them: torchrun's parser has none of aioproc's flags."""


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's parser (torch's ``get_args_parser``): its flags, dests and defaults.

    Every option defaults to its ``PET_<DEST>`` variable where torch's
    does; values keep torch's types (``nnodes`` and ``nproc_per_node`` are
    strings, ``max_restarts`` an int, ...).
    """
    helps = {a.dest: a.help or "" for a in _build_parsers()[1]._actions}
    parser = argparse.ArgumentParser(description=_DESCRIPTION, formatter_class=_HelpFormatter)
    for flag in _FLAGS:
        # aioproc run's help, less the default it names: this parser's default is torch's
        text = _DEFAULT_NOTE.sub("", helps.get(RENAMED.get(flag.dest, flag.dest), ""))
        for theirs, ours in _AIOPROC_RUN_ONLY:
            text = text.replace(theirs, ours)
        env = f"PET_{flag.dest.upper()}"
        if flag.switch:
            parser.add_argument(*flag.strings, dest=flag.dest, action=EnvSwitch, env=env, help=text)
        elif flag.env:
            parser.add_argument(
                *flag.strings,
                dest=flag.dest,
                action=EnvDefault,
                env=env,
                type=flag.type,
                default=flag.default,
                choices=flag.choices,
                help=text,
            )
        else:
            parser.add_argument(
                *flag.strings,
                dest=flag.dest,
                type=flag.type,
                default=flag.default,
                choices=flag.choices,
                help=text,
            )
    parser.add_argument(
        "training_script",
        type=str,
        help="the script to run on every worker (a module with -m, a program with --no-python)",
    )
    parser.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        help="the script's arguments",
    )
    return parser


def parse_args(args: list[str] | None) -> argparse.Namespace:
    """``args`` parsed by ``get_args_parser()`` (``None``: ``sys.argv[1:]``)."""
    return get_args_parser().parse_args(args)
