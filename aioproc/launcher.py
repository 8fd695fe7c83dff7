"""torch's ``torch.distributed.launcher.api`` on aioproc's agent: a tool switches by an import.

::

    # from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from aioproc.launcher import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, run_id="job")
    values = elastic_launch(config, train)(0.1)        # {rank: train(0.1)}, blocking
    elastic_launch(config, sys.executable)("-u", "train.py", "--epochs=3")

``LaunchConfig`` has torch 2.13's fields and defaults; ``elastic_launch``
and ``launch_agent`` block as torch's do, from plain code or from a thread
beside a running loop, return the workers' values by global rank and raise
``ChildFailedError`` when they fail.  ``await launch(config, entrypoint,
*args)`` is the real implementation, for coroutines; the blocking forms
run it on a loop of their own.  Every rendezvous backend of
``aioproc.rendezvous`` (``c10d``, ``etcd``, ``static``) takes a node into a
job over several hosts; with ``max_nodes == 1`` this host runs alone.

Each field means what the matching flag of ``aioproc run`` means: a config
is translated to that command's parsed flags and built by the same code
(``aioproc._launch``).
"""

from __future__ import annotations

from ._launch.blocking import elastic_launch as elastic_launch
from ._launch.blocking import launch_agent as launch_agent
from ._launch.config import LaunchConfig as LaunchConfig
from ._launch.launch import launch as launch

__all__ = ["LaunchConfig", "elastic_launch", "launch", "launch_agent"]

# Defined in the wing, named here: reprs and pickles show the path users import.
for _public in (LaunchConfig, elastic_launch, launch, launch_agent):
    _public.__module__ = __name__
del _public
