"""torchrun's plug-in points: ``--logs-specs``, ``--event-log-handler`` and ``--run-path``.

``logs_specs_class`` resolves ``--logs-specs NAME`` as torchrun does: the
entry point ``NAME`` of the group ``torchrun.logs_specs`` (``default``:
``DefaultLogsSpecs``).  A class written for torch (a subclass of torch's
``LogsSpecs``) is driven through ``_TorchLogsSpecs``, which hands it
torch's ``Std`` values and reads back its ``LogsDest``.

``EventLog`` records torch's elastic events (``torchelastic.worker.status.*``,
one JSON object a line, torch's fields) through the handler that
``--event-log-handler`` names: torch's ``null``, ``console`` and
``dynamic_rendezvous``, or one registered in torch's
``events.handlers._log_handlers`` when torch can be imported.

``run_script_path`` is ``--run-path``'s function worker.  It runs in the
worker, so this module imports only the standard library and ``aioproc.logs``
(itself light) at its top.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any

from ..logs import DefaultLogsSpecs, LogsDest, LogsSpecs, Std
from .values import LOGS_SPECS_GROUP

if TYPE_CHECKING:
    from ..agent import AgentEvent, RunResult, WorkerGroup

_TORCH_DEFAULT_LOGS_SPECS = "torch.distributed.elastic.multiprocessing:DefaultLogsSpecs"
EVENT_HANDLERS = ("null", "console", "dynamic_rendezvous")
"""torch's registered event handlers (``torch.distributed.elastic.events.handlers``)."""


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` with ``runpy.run_path`` in this interpreter (torchrun's --run-path).

    ``sys.argv`` is the script and its arguments, and it runs as
    ``__main__``, as torch's ``run_script_path`` runs it.
    """
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")


# ------------------------------------------------------------ --logs-specs


def logs_specs_class(name: str) -> Callable[..., LogsSpecs]:
    """The ``LogsSpecs`` factory ``--logs-specs name`` names.

    Returns:
        A callable taking torchrun's keywords (``log_dir``, ``redirects``,
        ``tee``, ``local_ranks_filter``) and returning an aioproc ``LogsSpecs``.

    Raises:
        ValueError: no such entry point, one that cannot be loaded, or a
            class that is no ``LogsSpecs`` (the message says which).
    """
    found = [ep for ep in metadata.entry_points(group=LOGS_SPECS_GROUP) if ep.name == name]
    if not found:
        if name == "default":  # torch registers it; aioproc's is the same layout
            return DefaultLogsSpecs
        known = {ep.name for ep in metadata.entry_points(group=LOGS_SPECS_GROUP)}
        raise ValueError(
            f"--logs-specs {name!r}: no entry point {name!r} in group {LOGS_SPECS_GROUP!r} "
            f"(installed: {', '.join(sorted({'default', *known}))})"
        )
    entry = found[0]
    if entry.value.replace(" ", "") == _TORCH_DEFAULT_LOGS_SPECS:
        return DefaultLogsSpecs  # torch's own default: the same files, without importing torch
    try:
        cls = entry.load()
    except Exception as e:
        raise ValueError(
            f"--logs-specs {name!r}: cannot load {entry.value!r}: {type(e).__name__}: {e}"
        ) from None
    if isinstance(cls, type) and issubclass(cls, LogsSpecs):
        factory: Callable[..., LogsSpecs] = cls
        return factory
    if isinstance(cls, type) and callable(getattr(cls, "reify", None)):
        return functools.partial(_TorchLogsSpecs, cls)
    raise ValueError(f"--logs-specs {name!r}: {entry.value!r} is not a LogsSpecs class")


def _torch_std(value: Std | dict[int, Std]) -> Any:
    """aioproc's ``Std`` (or a per-rank map of it) as torch's ``Std``."""
    std = importlib.import_module("torch.distributed.elastic.multiprocessing").Std
    if isinstance(value, dict):
        return {rank: std(int(v)) for rank, v in value.items()}
    return std(int(value))


class _TorchLogsSpecs(LogsSpecs):
    """An instance of a torch ``LogsSpecs`` class ``cls``, driven by aioproc's agent.

    It is given torch's ``Std`` values, and its ``LogsDest`` is read back
    field by field (torch's and aioproc's have the same fields).
    """

    def __init__(
        self,
        cls: type,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._torch = cls(
            log_dir=log_dir,
            redirects=_torch_std(redirects),
            tee=_torch_std(tee),
            local_ranks_filter=local_ranks_filter,
        )

    def __repr__(self) -> str:
        return f"<torch LogsSpecs {self._torch!r}>"

    @property
    def root_log_dir(self) -> str:
        return str(self._torch.root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        theirs = self._torch.reify(envs)
        names = [f.name for f in dataclasses.fields(LogsDest)]
        return LogsDest(**{n: getattr(theirs, n) for n in names if hasattr(theirs, n)})


# ------------------------------------------------------ --event-log-handler


def event_handler(name: str) -> logging.Handler:
    """The ``logging.Handler`` torch registers under ``name``.

    Raises:
        ValueError: no handler of that name (torch's three, or, when torch
            can be imported, one registered in its handlers module).
    """
    if name in ("null", "dynamic_rendezvous"):
        return logging.NullHandler()
    if name == "console":
        from .report import _StderrHandler

        return _StderrHandler()  # torch's StreamHandler, above the live view when there is one
    try:
        handlers = importlib.import_module("torch.distributed.elastic.events.handlers")
        registered = getattr(handlers, "_log_handlers", {})
    except ImportError:
        registered = {}
    if name in registered and isinstance(registered[name], logging.Handler):
        handler: logging.Handler = registered[name]
        return handler
    raise ValueError(
        f"--event-log-handler {name!r}: no such event handler; torch registers "
        f"{', '.join(sorted(set(EVENT_HANDLERS) | set(registered)))}"
    )


class EventLog:
    """torch's elastic events of one ``aioproc run``, recorded as torch records them.

    Worker ``START`` events as each worker starts, ``RENDEZVOUS`` (with its
    duration) after each round over several hosts, each worker's final state
    (``SUCCEEDED``, ``FAILED`` or ``TERMINATED``) when the run ends, then the
    agent's ``SUCCEEDED`` (the run returned) or ``FAILED`` (it raised).

    Args:
        destination: the handler's name (the logger is torch's
            ``torchelastic-events-<destination>``, not propagated).
        handler: the handler itself.
        backend: the rendezvous backend named in each event.
    """

    def __init__(self, destination: str, handler: logging.Handler, backend: str) -> None:
        self._logger = logging.getLogger(f"torchelastic-events-{destination}")
        self._logger.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
        self._logger.propagate = False  # one record per event, as torch
        self._handler = handler
        self._logger.addHandler(handler)
        self._backend = backend
        self._host = socket.getfqdn()
        self._start = time.monotonic()
        self._rendezvous_since: float | None = None
        self._pids: dict[int, int] = {}  # local rank -> pid, torch's worker id

    def __repr__(self) -> str:
        return f"<EventLog {self._logger.name}>"

    def close(self) -> None:
        self._logger.removeHandler(self._handler)

    def on_event(self, event: AgentEvent, group: WorkerGroup, run_id: str) -> None:
        """Record what torch records for this agent event, if anything."""
        from ..agent import events as ev

        if event.kind == ev.RENDEZVOUS_STARTED:
            self._rendezvous_since = time.perf_counter()
        elif event.kind == ev.RENDEZVOUS_COMPLETED and self._rendezvous_since is not None:
            took = (time.perf_counter() - self._rendezvous_since) * 1000
            self._record("RENDEZVOUS", "AGENT", group, run_id, event.attempt, duration_ms=took)
        elif event.kind == ev.WORKER_STARTED and event.local_rank is not None:
            if event.pid is not None:
                self._pids[event.local_rank] = event.pid
            worker = group.workers[event.local_rank]
            worker_id = str(event.pid)
            self._record("START", "WORKER", group, run_id, event.attempt, worker, worker_id)

    def finished(self, group: WorkerGroup, run_id: str, attempt: int, result: RunResult) -> None:
        """Each worker's final state, then the agent's ``SUCCEEDED`` (its run returned)."""
        for worker in group.workers:
            failure = result.failures.get(worker.global_rank)
            if failure is not None and failure.stopped:
                failure = None  # stopped by aioproc: torch counts no failure for it
            # TERMINATED: torch's name for a worker its agent stopped
            state = "TERMINATED" if failure is None and result.is_failed() else result.state.value
            self._record(
                state,
                "WORKER",
                group,
                run_id,
                attempt,
                worker,
                str(self._pids.get(worker.local_rank)),
                raw_error=json.dumps(failure.error_file_data) if failure else None,
                exit_code=failure.exitcode if failure else None,
                worker_pid=failure.pid if failure else None,
            )
        self._record("SUCCEEDED", "AGENT", group, run_id, attempt)

    def failed(self, group: WorkerGroup, run_id: str, attempt: int, error: BaseException) -> None:
        """The agent's ``FAILED`` event: its run raised (a signal, a lost rendezvous)."""
        raw = f"{type(error).__name__}: {error}"
        self._record("FAILED", "AGENT", group, run_id, attempt, raw_error=raw)

    def _record(
        self,
        state: str,
        source: str,
        group: WorkerGroup,
        run_id: str,
        attempt: int,
        worker: Any = None,
        worker_id: str | None = None,
        *,
        raw_error: str | None = None,
        duration_ms: float | None = None,
        exit_code: int | None = None,
        worker_pid: int | None = None,
    ) -> None:
        """One event, with the fields and the order of torch's ``_construct_event``."""
        spec = group.spec
        md: dict[str, Any] = {
            "group_world_size": group.group_world_size,
            "entry_point": spec.get_entrypoint_name(),
        }
        if worker is not None:
            md["local_rank"] = [worker.local_rank]
            md["role_rank"] = [worker.role_rank]
            md["role_world_size"] = [worker.role_world_size]
            md["exit_code"] = [exit_code]
            md["worker_pid"] = [worker_pid]
        metadata_ = {
            "run_id": run_id,
            "global_rank": worker.global_rank if worker is not None else None,
            "group_rank": group.group_rank,
            "worker_id": worker_id if worker is not None else None,
            "role": spec.role,
            "hostname": self._host,
            "state": state,
            "total_run_time": int(time.monotonic() - self._start),
            "rdzv_backend": self._backend,
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": attempt,
            "duration_ms": duration_ms,
        }
        event = {
            "name": f"torchelastic.worker.status.{state}",
            "source": source,
            "timestamp": 0,
            "metadata": metadata_,
        }
        self._logger.info(json.dumps(event))
