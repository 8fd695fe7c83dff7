"""torch's ``torch.distributed.run`` on aioproc's agent: tools calling torchrun switch by an import.

::

    # from torch.distributed import run as distrib_run
    from aioproc import torchrun as distrib_run

    args = distrib_run.get_args_parser().parse_args(["--nproc-per-node=4", "train.py"])
    distrib_run.run(args)              # returns, or raises ChildFailedError naming the ranks

``get_args_parser()`` has torchrun 2.13's flags, dests and defaults (and
their ``PET_`` variables); ``config_from_args(args)`` gives torch's
``(LaunchConfig, cmd, cmd_args)``, ``run(args)`` runs the job and
``main(args=None)`` is the command, raising ``ValueError`` for a bad flag
or combination and ``ChildFailedError`` for a failed job, as torch's do.
Each flag means what it means to ``aioproc run``: both go through one
translation (``aioproc._launch.flags``), and the job runs on
``aioproc.launcher``.
"""

from __future__ import annotations

from ._base import public_module
from ._launch.parser import get_args_parser as get_args_parser
from ._launch.parser import parse_args as parse_args
from ._launch.torchrun import config_from_args as config_from_args
from ._launch.torchrun import determine_local_world_size as determine_local_world_size
from ._launch.torchrun import get_rdzv_endpoint as get_rdzv_endpoint
from ._launch.torchrun import get_use_env as get_use_env
from ._launch.torchrun import main as main
from ._launch.torchrun import parse_min_max_nnodes as parse_min_max_nnodes
from ._launch.torchrun import run as run
from ._launch.torchrun import run_script_path as run_script_path

__all__ = [
    "config_from_args",
    "determine_local_world_size",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]

# Defined in the wing, named here: reprs show the path users import.  Not
# run_script_path: it runs in --run-path's workers, which import it where it
# lives (light), not this module (the agent's imports).  Named, not
# __name__: run as ``python -m aioproc.torchrun`` this module is __main__.
public_module(
    "aioproc.torchrun",
    config_from_args,
    determine_local_world_size,
    get_args_parser,
    get_rdzv_endpoint,
    get_use_env,
    main,
    parse_args,
    parse_min_max_nnodes,
    run,
)

if __name__ == "__main__":  # python -m aioproc.torchrun, as python -m torch.distributed.run
    main()
