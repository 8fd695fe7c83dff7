"""The local elastic agent: torchrun's job on one host, as a coroutine."""

from __future__ import annotations

from .events import AgentEvent as AgentEvent
from .local import LocalElasticAgent as LocalElasticAgent
from .local import open_agent as open_agent
from .spec import RestartPolicy as RestartPolicy
from .spec import RunResult as RunResult
from .spec import Worker as Worker
from .spec import WorkerGroup as WorkerGroup
from .spec import WorkerSpec as WorkerSpec
from .spec import WorkerState as WorkerState

__all__ = [
    "AgentEvent",
    "LocalElasticAgent",
    "RestartPolicy",
    "RunResult",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "open_agent",
]
