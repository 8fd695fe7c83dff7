"""A pytest plugin that runs torch's own launcher tests on aioproc.

Loaded with ``-p aioproc_torch_shim`` by ``tests/test_torch_upstream.py``
in a pytest of the torch interpreter, before torch's test modules are
imported, it replaces torch's launcher entry points, in torch's own
modules, with aioproc's:

- ``torch.distributed.run.main(args)`` is ``aioproc.torchrun.main(args)``,
  in this process (as torch's ``main`` runs in the caller's), so the
  environment, ``PET_*`` variables, redirected ``sys.stdout`` and mocked
  device counts the tests set up reach it.  It raises what torch's raises:
  ``ValueError`` for a bad flag or combination, and for a failed job
  ``ChildFailedError``, aioproc's turned into torch's class (the tests
  catch torch's).
- ``torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler``
  builds aioproc's handler (``aioproc.rendezvous.create_handler``) from
  torch's ``RendezvousParameters``: the c10d backend is aioproc's c10d, and
  torch's two etcd backends (``etcd`` and ``etcd-v2``, both on etcd's v2
  API) are aioproc's etcd backend (etcd's v3 API), against the same server
  (torch's own ``EtcdServer``, an etcd that serves both APIs).
- ``torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent``
  is ``BlockingAgent``: torch's blocking agent API over
  ``aioproc.agent.LocalElasticAgent``, which it builds from torch's
  ``WorkerSpec`` and ``DefaultLogsSpecs``.

Nothing else of torch is touched: the tests' workers, assertions, mocks
and helpers are torch's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed.elastic.agent.server.local_elastic_agent as torch_agent_module
import torch.distributed.elastic.rendezvous.registry as torch_registry
import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs as TorchDefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import aioproc
import aioproc.torchrun
from aioproc.agent import LocalElasticAgent as AioprocAgent
from aioproc.agent import RunResult, WorkerGroup
from aioproc.agent import WorkerSpec as AioprocSpec
from aioproc.rendezvous import RendezvousParameters, create_handler

ROUTED = (
    "torch.distributed.run.main",
    "torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler",
    "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent",
)
"""What this plugin replaces, by torch's names."""


# ------------------------------------------------------------------ torchrun


class JobFailed(ChildFailedError):
    """aioproc's ``ChildFailedError`` as torch's class: the tests catch torch's.

    torch's ``__init__`` formats torch's failures; the message is aioproc's
    summary, the attributes aioproc's failures.
    """

    def __init__(self, error: aioproc.ChildFailedError) -> None:
        Exception.__init__(self, str(error))
        self.name = error.name
        self.failures = error.failures


def run_main(args: Sequence[str] | None = None) -> None:
    """torch's ``torch.distributed.run.main(args)``: ``aioproc.torchrun.main(args)``.

    Raises:
        ChildFailedError: torch's class, for aioproc's (``JobFailed``).
        ValueError: a bad flag or combination, as torch's ``main`` raises it.
    """
    try:
        aioproc.torchrun.main(None if args is None else list(args))
    except aioproc.ChildFailedError as e:
        raise JobFailed(e) from e


# -------------------------------------------------------------- rendezvous


class BlockingHandler:
    """An aioproc rendezvous handler with torch's blocking ``shutdown()``.

    Attributes:
        handler: the aioproc handler, which ``BlockingAgent`` gives its spec.
    """

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    def __repr__(self) -> str:
        return f"<blocking {self.handler!r}>"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handler, name)

    def get_backend(self) -> str:
        return str(self.handler.get_backend())

    def shutdown(self) -> bool:
        return bool(asyncio.run(self.handler.shutdown()))


# torch's backends on etcd's v2 API, and aioproc's backend for them (etcd's v3 API)
ETCD_BACKENDS = {"etcd": "etcd", "etcd-v2": "etcd"}


def get_rendezvous_handler(params: Any) -> BlockingHandler:
    """torch's ``registry.get_rendezvous_handler``: aioproc's handler for torch's parameters."""
    ours = RendezvousParameters(
        ETCD_BACKENDS.get(params.backend, params.backend),
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    return BlockingHandler(create_handler(ours))


# ------------------------------------------------------------------- agent


def _std(value: Any) -> Any:
    """torch's ``Std`` (or a per-rank map of it) as aioproc's."""
    if isinstance(value, dict):
        return {rank: aioproc.Std(int(v)) for rank, v in value.items()}
    return aioproc.Std(int(value))


def _logs_specs(specs: Any) -> aioproc.LogsSpecs | None:
    """torch's ``DefaultLogsSpecs`` as aioproc's: the same directory, redirects and tee."""
    if specs is None:
        return None
    if not isinstance(specs, TorchDefaultLogsSpecs):
        raise TypeError(f"the shim maps torch's DefaultLogsSpecs only, got {specs!r}")
    # torch's LogsSpecs keeps its arguments in these attributes
    return aioproc.DefaultLogsSpecs(
        log_dir=specs.root_log_dir,
        redirects=_std(specs._redirects),
        tee=_std(specs._tee),
        local_ranks_filter=specs._local_ranks_filter,
    )


class BlockingAgent:
    """torch's ``LocalElasticAgent`` (blocking ``run()``) over aioproc's agent.

    Built with torch's arguments: a torch ``WorkerSpec`` (its rendezvous
    handler from ``get_rendezvous_handler`` above) and a torch
    ``DefaultLogsSpecs``.  ``run()`` is ``asyncio.run(agent.run())``.
    ``_remaining_restarts`` is aioproc's agent's, ``_total_execution_time``
    the whole seconds ``run()`` took (torch's agent keeps both).
    """

    def __init__(
        self,
        spec: Any,
        logs_specs: Any = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
    ) -> None:
        handler = spec.rdzv_handler
        if isinstance(handler, BlockingHandler):
            handler = handler.handler
        ours = AioprocSpec(
            role=spec.role,
            local_world_size=spec.local_world_size,
            entrypoint=spec.entrypoint,
            args=tuple(spec.args),
            max_restarts=spec.max_restarts,
            monitor_interval=spec.monitor_interval,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            rdzv_handler=handler,
        )
        self._agent = AioprocAgent(
            ours,
            _logs_specs(logs_specs),
            start_method,
            exit_barrier_timeout,
            log_line_prefix_template,
        )
        self._total_execution_time = 0

    def __repr__(self) -> str:
        return f"<blocking {self._agent!r}>"

    @property
    def _remaining_restarts(self) -> int:
        return int(self._agent._remaining_restarts)

    def run(self, role: str = "default") -> RunResult:
        started = time.monotonic()
        try:
            return asyncio.run(self._agent.run())
        finally:
            self._total_execution_time = int(time.monotonic() - started)

    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._agent.get_worker_group(role)


# ------------------------------------------------------------------ plugin

torch_run.main = run_main
torch_registry.get_rendezvous_handler = get_rendezvous_handler
torch_agent_module.LocalElasticAgent = BlockingAgent  # type: ignore[misc]
