"""Worker failures, their error.json files, and the ``@record`` decorator.

Exception and warning tree::

    Exception
    ├── ChildFailedError      one or more workers of a group failed
    ├── RemoteTraceback       a worker's own traceback, as text (a __cause__)
    └── RuntimeError
        ├── BrokenWorkerError a persistent worker died during a call
        ├── UnexpectedSubprocessExitError   a cluster task exited non-zero or by a signal
        └── SubprocessTimeoutError          a cluster run's join() timed out
    RuntimeWarning
    └── ForcedKillWarning     a worker ignored its stop signal and was SIGKILLed

``SignalException`` (the supervisor received a termination signal) lives in
``aioproc.signals`` with the signal machinery; the two cluster errors in
``aioproc.cluster`` (``_cluster.result``) with the result they carry.

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

__all__ = [
    "MAX_ERROR_FILE_SIZE",
    "BrokenWorkerError",
    "ChildFailedError",
    "ErrorHandler",
    "ForcedKillWarning",
    "ProcessFailure",
    "RemoteTraceback",
    "get_error_handler",
    "load_error_file",
    "record",
]

# Defined in the wing, named here: reprs, pickles and the docs show the path
# users import them from.
for _public in (
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
):
    _public.__module__ = __name__
del _public
