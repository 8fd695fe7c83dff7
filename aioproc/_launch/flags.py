"""The one translation: what torch's launch API is given, as ``aioproc run``'s parsed flags.

``aioproc run`` parses each flag with its own value parser (``_cli.values``)
and turns the parsed flags into a job with the functions of ``_cli.run``:
the command and its arguments, the logs, the start method, the rendezvous
handler, the event log, the NUMA binding.  torch's launch API is given the
same things in two other shapes, and both are brought to that one:

- ``run_flags``: torchrun's ``Namespace`` (``get_args_parser()``'s dests,
  torch's strings) becomes the ``Namespace`` ``aioproc run`` parses, each
  value read by that command's own parser for the flag;
- ``config_flags``: a ``LaunchConfig`` becomes the parsed flags its launch
  needs (``aioproc run --nnodes MIN:MAX --rdzv-backend ...``).

So a flag, or a field, means exactly what it means to ``aioproc run``,
with no second copy of torchrun's semantics to drift from it.
"""

from __future__ import annotations

import argparse
from typing import Any

from .._cli.args import _build_parsers
from ..rendezvous.api import parse_endpoint
from .config import LaunchConfig, numa_mode, signals

__all__ = ["RENAMED", "config_flags", "flag_name", "run_flags"]

# torchrun's dests that ``aioproc run`` spells otherwise
RENAMED = {
    "rdzv_id": "run_id",
    "shutdown_timeout": "grace_period",
    "training_script": "script",
    "training_script_args": "script_args",
}


def flag_name(dest: str) -> str:
    """torchrun's flag for the dest ``dest``: ``rdzv_id`` is ``--rdzv-id``."""
    return "--" + dest.replace("_", "-")


def run_flags(args: argparse.Namespace, dests: list[str]) -> argparse.Namespace:
    """torchrun's parsed flags ``args`` as ``aioproc run``'s.

    Each of torchrun's ``dests`` is read from ``args`` by ``aioproc run``'s
    parser for that flag: a string as the command line gives it, a number,
    a switch's bool or a list of filters as torch's parser leaves them.
    ``aioproc run``'s own flags keep their defaults, but the live view:
    a library call prints plain output.

    Raises:
        ValueError: a value that flag does not take, naming the flag.
    """
    actions = {a.dest: a for a in _build_parsers()[1]._actions if a.dest != "help"}
    ns = argparse.Namespace(**{dest: action.default for dest, action in actions.items()})
    ns.no_live = True
    for dest in dests:
        value = getattr(args, dest)
        ours = RENAMED.get(dest, dest)
        if dest == "training_script_args":
            ns.script_args = [str(arg) for arg in value]
            continue
        setattr(ns, ours, _read(actions[ours], flag_name(dest), value))
    return ns


def _read(action: argparse.Action, flag: str, value: Any) -> Any:
    """One of torchrun's values as ``action`` (``aioproc run``'s flag) parses it."""
    if value is None:
        return None
    if action.nargs == 0:  # a switch: torch's parser leaves a bool
        return bool(value)
    if isinstance(value, (list, tuple)):  # filters: torch's parser splits them already
        text = ",".join(str(item).replace(",", ",,") for item in value)
    else:
        text = str(value)
    parse = action.type if callable(action.type) else str
    try:
        return parse(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise ValueError(f"{flag} {value!r}: {e}") from None


def config_flags(config: LaunchConfig, *, function: bool) -> argparse.Namespace:
    """The flags of ``aioproc run`` that launch what ``config`` describes.

    ``static`` takes the master's ``HOST:PORT`` from ``rdzv_endpoint`` and
    this node's rank from ``rdzv_configs["rank"]`` (torch's); with several
    nodes it is ``--node-rank R --master-addr HOST --master-port PORT``.

    Args:
        config: a config ``check_config`` has read.
        function: whether the workers run a function (``--run-path``'s kind
            of worker: torch's ``fork`` forks them from the template).

    Raises:
        ValueError: ``static`` without the master's ``HOST:PORT``.
    """
    conf = dict(config.rdzv_configs)
    master_addr: str | None = None
    master_port: int | None = None
    node_rank = 0
    if config.rdzv_backend == "static":
        node_rank = _rank(conf.pop("rank", conf.pop("node_rank", 0)))
        try:
            master_addr, master_port = parse_endpoint(config.rdzv_endpoint, -1)
        except ValueError:
            raise ValueError(
                f"LaunchConfig.rdzv_endpoint: the static rendezvous needs the master's "
                f"HOST:PORT, got {config.rdzv_endpoint!r}"
            ) from None
    return argparse.Namespace(
        nnodes=(config.min_nodes, config.max_nodes),
        standalone=False,
        nproc_per_node=config.nproc_per_node,
        node_rank=node_rank,
        rdzv_backend=config.rdzv_backend,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_conf=conf,
        run_id=config.run_id,
        local_addr=config.local_addr,
        master_addr=master_addr,
        master_port=master_port,
        log_dir=None,  # c10d's hosted store keeps its data in the temp dir
        start_method=config.start_method,
        run_path=function,
        grace_period=config.shutdown_timeout,
        signals_to_handle=signals(config.signals_to_handle),
        event_log_handler=config.event_log_handler,
        numa_binding=numa_mode(config.numa_options),
    )


def _rank(value: Any) -> int:
    try:
        rank = int(value)
    except (TypeError, ValueError):
        rank = -1
    if isinstance(value, bool) or rank < 0:
        raise ValueError(f"LaunchConfig.rdzv_configs['rank'] must be an int >= 0, got {value!r}")
    return rank
