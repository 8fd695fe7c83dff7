"""aioproc: an asyncio-native process orchestrator.

Public names are re-exported lazily: ``import aioproc`` (and importing a
submodule such as ``aioproc.errors`` from inside a worker) loads no event loop
machinery until a name that needs it is first used.  Worker processes rely on
this to stay free of asyncio, anyio and uvloop.

The public modules are faces over private wings, each importing only the
ones below it (checked by ``tests/test_layers.py``)::

    _child    inside workers and the template; the standard library only
    _base     loop helpers, shielding, Owner, the helper thread, input checks
    _errors   failures and @record; the standard library only
    _output   pipe bytes -> lines -> sinks
    _limits   resource limits (cgroups, rlimits), usage, the process budget
    _proc     one OS process: spawn, exit, channel, guardian, stop and release
    _func     function workers, parent side
    _group    what a PContext is made of
    _cli, _cluster, _pool, _plugin    behind aioproc.cli, .cluster, .pool, .pytest_plugin
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers

if TYPE_CHECKING:
    from typing import Any

    from ._child.boot import worker_state as worker_state
    from ._limits.capacity import Capacity as Capacity
    from ._limits.spec import Limits as Limits
    from ._limits.usage import Usage as Usage
    from .agent import AgentEvent as AgentEvent
    from .agent import LocalElasticAgent as LocalElasticAgent
    from .agent import RestartPolicy as RestartPolicy
    from .agent import RunResult as RunResult
    from .agent import WorkerSpec as WorkerSpec
    from .agent import WorkerState as WorkerState
    from .agent import open_agent as open_agent
    from .context import PContext as PContext
    from .context import preimport as preimport
    from .errors import BrokenWorkerError as BrokenWorkerError
    from .errors import ChildFailedError as ChildFailedError
    from .errors import ErrorHandler as ErrorHandler
    from .errors import ForcedKillWarning as ForcedKillWarning
    from .errors import ProcessFailure as ProcessFailure
    from .errors import record as record
    from .forkserver import Forkserver as Forkserver
    from .forkserver import open_forkserver as open_forkserver
    from .logs import DefaultLogsSpecs as DefaultLogsSpecs
    from .logs import LogsDest as LogsDest
    from .logs import LogsSpecs as LogsSpecs
    from .logs import Std as Std
    from .logs import to_map as to_map
    from .pool import PoolStats as PoolStats
    from .pool import WorkerPool as WorkerPool
    from .pool import open_pool as open_pool
    from .results import RunProcsResult as RunProcsResult
    from .runner import run as run
    from .runner import start_processes as start_processes
    from .signals import SignalException as SignalException
    from .signals import translate_signals as translate_signals
    from .sinks import CallbackSink as CallbackSink
    from .sinks import ConsoleSink as ConsoleSink
    from .sinks import FileSink as FileSink
    from .sinks import LoggingSink as LoggingSink
    from .sinks import OutputLine as OutputLine
    from .sinks import OutputStream as OutputStream
    from .sinks import Sink as Sink
    from .tail import TailLog as TailLog
    from .tail import open_tail_log as open_tail_log
    from .worker import WorkerProcess as WorkerProcess
    from .worker import open_worker as open_worker

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "AgentEvent": "agent",
    "LocalElasticAgent": "agent",
    "RestartPolicy": "agent",
    "RunResult": "agent",
    "WorkerSpec": "agent",
    "WorkerState": "agent",
    "open_agent": "agent",
    "PContext": "context",
    "preimport": "context",
    "RunProcsResult": "results",
    "run": "runner",
    "start_processes": "runner",
    "ChildFailedError": "errors",
    "ErrorHandler": "errors",
    "ForcedKillWarning": "errors",
    "ProcessFailure": "errors",
    "record": "errors",
    "DefaultLogsSpecs": "logs",
    "LogsDest": "logs",
    "LogsSpecs": "logs",
    "Std": "logs",
    "to_map": "logs",
    "SignalException": "signals",
    "translate_signals": "signals",
    "CallbackSink": "sinks",
    "ConsoleSink": "sinks",
    "FileSink": "sinks",
    "LoggingSink": "sinks",
    "OutputLine": "sinks",
    "OutputStream": "sinks",
    "Sink": "sinks",
    "TailLog": "tail",
    "open_tail_log": "tail",
    "BrokenWorkerError": "errors",
    "PoolStats": "pool",
    "WorkerPool": "pool",
    "open_pool": "pool",
    "WorkerProcess": "worker",
    "open_worker": "worker",
    "worker_state": "_child.boot",
    "Capacity": "_limits.capacity",
    "Limits": "_limits.spec",
    "Usage": "_limits.usage",
    "Forkserver": "forkserver",
    "open_forkserver": "forkserver",
}

__all__ = sorted(_EXPORTS)


_SUBMODULES = frozenset({"cluster"})
"""Public submodules reachable as attributes (``aioproc.cluster.run``), loaded on first use."""


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        __import__(f"{__name__}.{name}")
        return sys.modules[f"{__name__}.{name}"]
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'aioproc' has no attribute {name!r}") from None
    # plain __import__: importlib would cost every worker an import
    __import__(f"{__name__}.{module}")
    value = getattr(sys.modules[f"{__name__}.{module}"], name)
    if module.startswith("_"):
        value.__module__ = __name__  # defined in a wing, imported from here
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
