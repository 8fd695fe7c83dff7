"""Worker failures, their error.json files, and the ``@record`` decorator.

Every exception and warning aioproc raises on purpose, and where to import
it from::

    Exception
    ├── ChildFailedError                  one or more workers of a group failed
    ├── RemoteTraceback                   a worker's own traceback, as text (a __cause__)
    ├── SignalException                   a signal reached translate_signals() (aioproc.signals)
    ├── TimeoutError
    │   └── RunTimeoutError               run()'s timeout expired; carries the partial result
    └── RuntimeError
        ├── BrokenWorkerError             a persistent worker died during a call
        ├── UnexpectedSubprocessExitError a cluster task exited non-zero or by a signal
        │                                 (aioproc.cluster)
        ├── SubprocessTimeoutError        a cluster run's join() timed out (aioproc.cluster)
        ├── TemplateError                 the forkserver template could not start or fork
        │   └── TemplateLost              it died or was given up while forking
        │                                 (both aioproc.forkserver)
        └── RendezvousError               the agents' rendezvous failed (aioproc.rendezvous)
            ├── RendezvousTimeoutError        a round did not complete in time
            ├── RendezvousConnectionError     the store could not be reached
            ├── RendezvousClosedError         the rendezvous is closed
            ├── RendezvousGracefulExitError   the job finished while this agent was in it
            ├── RendezvousStateError          the job's keys in the store are corrupt
            ├── RendezvousLeaseLostError      this agent lost its lease and was fenced
            └── RendezvousJobFailedError      the job failed on another host
    RuntimeWarning
    └── ForcedKillWarning                 a worker ignored its stop signal and was SIGKILLed

Misuse raises the built-ins: ``TypeError`` and ``ValueError`` for a bad
argument (the value named), ``RuntimeError`` for a handle used out of turn
("already started", "closed").  ``SignalException`` lives in
``aioproc.signals`` with the signal machinery, the cluster errors in
``aioproc.cluster`` with the result they carry, the rendezvous errors in
``aioproc.rendezvous`` and the template's in ``aioproc.forkserver``;
``RunTimeoutError`` is defined in ``aioproc.results`` beside the result it
carries and importable from here too.

A worker decorated with :func:`record` writes its uncaught exception to the
file named by ``TORCHELASTIC_ERROR_FILE``, in torchelastic's error.json
layout. The supervisor reads it back into a :class:`ProcessFailure` and
raises :class:`ChildFailedError`, whose root cause is the first failure
observed. Both sides interoperate with torch's own ``@record``. Error files
are read with a cap (``MAX_ERROR_FILE_SIZE``, 1 MiB), and coroutines read
them off the event loop (``ProcessFailure.load``, ``load_error_file``).

This module is the public face of the ``_errors`` wing: the failure
(``_errors.failure``), the summary a group raises (``_errors.summary``) and
the worker side, ``@record`` (``_errors.record``).  Workers import it, so
all three import only the standard library: no asyncio, and nothing heavy
until a failure is formatted.
"""

from __future__ import annotations

from ._base import public_module
from ._child.errorfile import MAX_ERROR_FILE_SIZE
from ._errors.failure import NO_ERROR_FILE_MESSAGE as NO_ERROR_FILE_MESSAGE
from ._errors.failure import BrokenWorkerError as BrokenWorkerError
from ._errors.failure import ForcedKillWarning as ForcedKillWarning
from ._errors.failure import ProcessFailure as ProcessFailure
from ._errors.failure import RemoteTraceback as RemoteTraceback
from ._errors.failure import load_error_file as load_error_file
from ._errors.failure import read_error_file as read_error_file
from ._errors.record import ErrorHandler as ErrorHandler
from ._errors.record import get_error_handler as get_error_handler
from ._errors.record import record as record
from ._errors.summary import ChildFailedError as ChildFailedError

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers

if TYPE_CHECKING:
    from .results import RunTimeoutError as RunTimeoutError

__all__ = [
    "MAX_ERROR_FILE_SIZE",
    "BrokenWorkerError",
    "ChildFailedError",
    "ErrorHandler",
    "ForcedKillWarning",
    "ProcessFailure",
    "RemoteTraceback",
    "RunTimeoutError",
    "get_error_handler",
    "load_error_file",
    "record",
]

# Defined in the wing, named here: reprs, pickles and the docs show the path
# users import them from.
public_module(
    __name__,
    BrokenWorkerError,
    ChildFailedError,
    ErrorHandler,
    ForcedKillWarning,
    ProcessFailure,
    RemoteTraceback,
    get_error_handler,
    load_error_file,
    read_error_file,
    record,
)


def __getattr__(name: str) -> object:
    # ``results`` imports typing, which a worker importing ``record`` from
    # here should not pay for: the one name defined there loads on first use
    if name == "RunTimeoutError":
        from .results import RunTimeoutError

        globals()[name] = RunTimeoutError
        return RunTimeoutError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
