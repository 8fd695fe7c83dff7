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
``aioproc.cluster`` (``_cluster_result``) with the result they carry.

A worker decorated with :func:`record` writes its uncaught exception to the
file named by ``TORCHELASTIC_ERROR_FILE``, in torchelastic's error.json
layout. The supervisor reads it back into a :class:`ProcessFailure` and
raises :class:`ChildFailedError`, whose root cause is the first failure
observed. Both sides interoperate with torch's own ``@record``. Error files
are read with a cap (``MAX_ERROR_FILE_SIZE``, 1 MiB), and coroutines read
them off the event loop (``ProcessFailure.load``, ``load_error_file``).

Workers import this module, so it imports only the standard library: no
asyncio, and nothing heavy until a failure is formatted.
"""

from __future__ import annotations

import contextvars
import faulthandler
import functools
import inspect
import itertools
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from aioproc._child import errorfile as _errorfile
from aioproc._child.errorfile import MAX_ERROR_FILE_SIZE

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Executor
    from typing import Any, TypeVar, overload

    _F = TypeVar("_F", bound=Callable[..., Any])

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

logger = logging.getLogger(__name__)

_NOT_AVAILABLE = "<N/A>"

# signal number -> name: ``signal.Signals(n).name`` is an enum lookup of
# ~5 us, paid per failure when a close stops hundreds of workers
_SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}

NO_ERROR_FILE_MESSAGE = (
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
)
"""``ProcessFailure.message`` of a worker that exited with a code (not a
signal) and wrote no error file: torch's exact text, so code that matches
on it keeps working.  ``ChildFailedError``'s summary adds a hint."""


def _no_error_file_data() -> dict[str, Any]:
    # torch's placeholder for "no error file"; a fresh dict for every failure
    return {"message": "<NONE>"}


# Breaks ties between failures noticed at the same time.time() value, which
# a coarse clock can return twice in a row.
_sequence = itertools.count()


class ForcedKillWarning(RuntimeWarning):
    """A worker did not exit within the grace period and was sent SIGKILL."""


class BrokenWorkerError(RuntimeError):
    """A persistent worker process died while a call was in flight.

    The message names the worker, its pid, its exit code or signal and the
    last lines of its stderr.  The call's result is lost; in a pool the
    worker is replaced and later calls work.
    """


class RemoteTraceback(Exception):
    """A traceback formatted in a worker process, shown as this error's text.

    Set as the ``__cause__`` of an exception rebuilt from a worker, so the
    worker's own frames print above the supervisor's (like
    ``multiprocessing.pool.RemoteTraceback``); also stands in for a worker
    exception that could not be unpickled.

    Args:
        tb: The formatted traceback (or ``"Type: message"``).
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


# What ``ProcessFailure.load`` read for the construction it is making: when
# the exit was noticed, and the error file's (bytes, size), or the error
# reading it, or None when it is not a file.  None: the constructor reads.
_Preread = tuple[float, "tuple[bytes, int] | OSError | None"]
_PREREAD: contextvars.ContextVar[_Preread | None] = contextvars.ContextVar(
    "aioproc_preread", default=None
)


@dataclass
class ProcessFailure:
    """The failure of one worker process, with what its error file says.

    Construct it as soon as the exit is noticed: the construction time orders
    failures, so the earliest one is the root cause.

    The error file may be in either of torch's layouts: ``{"message":
    {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
    (written by ``@record``), where ``message`` becomes the inner dict, or
    ``{"message": "...", "timestamp": ...}``, where it stays a string. Unlike
    torch, an error file that cannot be read or parsed does not raise (that
    would lose the failure itself): its stripped raw text becomes the message
    and a warning is logged. An error file larger than
    ``MAX_ERROR_FILE_SIZE`` (1 MiB) is not read: the message says so, with
    its path, its size and the text it begins with.

    Constructing one reads the error file (capped) in the calling thread, as
    torch does; a coroutine uses ``await ProcessFailure.load(...)`` instead,
    which reads it off the event loop.

    Attributes:
        local_rank: Rank of the worker on this host.
        pid: Process id of the worker.
        exitcode: Exit status; ``-N`` when killed by signal ``N``.
        error_file: Path of the worker's error.json, or ``"<N/A>"`` when the
            worker wrote none.
        stopped: True when aioproc itself stopped this worker (another rank
            failed, or the group was closed), so it is collateral rather than
            a cause. An aioproc extension to torch's fields.
        message: The error message: the error file's ``message`` (a dict for
            the ``@record`` layout, else a string), or, as in torch, ``"Signal
            N (SIGX) received by PID P"`` for a signal and
            :data:`NO_ERROR_FILE_MESSAGE` for an exit code without an error
            file.
        timestamp: Seconds since the epoch: the error file's own timestamp
            when it has one, else when the exit was noticed.
        error_file_data: The parsed error file; torch's ``{"message":
            "<NONE>"}`` when there is none (plus torch's ``errorTraits`` for
            an exit code); ``{}`` for a file that is not a JSON object.
        stdout_log, stderr_log: Paths of the worker's ``stdout.log`` and
            ``stderr.log`` (``""`` when the stream was not written to a
            file); set by the supervisor, shown in the summary while the
            file exists. An aioproc extension to torch's fields.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    stopped: bool = False
    message: str | dict[str, Any] = field(init=False)
    timestamp: int = field(init=False)
    error_file_data: dict[str, Any] = field(init=False)
    stdout_log: str = field(init=False, default="", compare=False)
    stderr_log: str = field(init=False, default="", compare=False)
    # When the supervisor noticed the exit; sub-second, unlike `timestamp`.
    _observed_at: float = field(init=False, repr=False, compare=False)
    _seq: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # set by ``load`` around this construction (subclasses keep torch's
        # argument-less __post_init__, so it cannot be an InitVar)
        _preread = _PREREAD.get()
        self._observed_at = time.time() if _preread is None else _preread[0]
        self._seq = next(_sequence)
        self.message = ""
        self.timestamp = int(self._observed_at)
        self.error_file_data = {}
        content = read_error_file(self.error_file) if _preread is None else _preread[1]
        if content is None:
            self.error_file = _NOT_AVAILABLE
            self.error_file_data = _no_error_file_data()
        elif isinstance(content, OSError):
            logger.warning(
                "could not read error file %s of local_rank %d (pid %d): %s",
                self.error_file,
                self.local_rank,
                self.pid,
                content,
            )
        else:
            self._apply_error_file(*content)
        if not self.message:
            self.message = self._describe_exit()

    @classmethod
    async def load(
        cls,
        local_rank: int,
        pid: int,
        exitcode: int,
        error_file: str,
        stopped: bool = False,
        *,
        executor: Executor | None = None,
    ) -> ProcessFailure:
        """Like the constructor, but read the error file off the event loop.

        Call it as soon as the exit is noticed: the failure is ordered by
        when ``load`` was called, not by when the read finished. The file is
        read with ``aiofiles`` (in a worker thread) and capped as by the
        constructor.

        Returns:
            The failure, as ``ProcessFailure(local_rank, pid, exitcode,
            error_file, stopped)`` would build it.
        """
        observed = time.time()
        content: tuple[bytes, int] | OSError | None
        try:
            content = await load_error_file(error_file, executor=executor)
        except OSError as e:
            content = e
        return cls._from_content(observed, content, local_rank, pid, exitcode, error_file, stopped)

    @classmethod
    def _from_content(
        cls,
        observed: float,
        content: tuple[bytes, int] | OSError | None,
        local_rank: int,
        pid: int,
        exitcode: int,
        error_file: str,
        stopped: bool = False,
    ) -> ProcessFailure:
        """Like the constructor, with the error file already read by ``read_error_file``.

        For a supervisor that reads the files of many exits off the loop in
        its own way; ``observed`` (``time.time()`` when the exit was
        noticed) orders the failure, as ``load``'s call time does.
        """
        token = _PREREAD.set((observed, content))
        try:
            return cls(local_rank, pid, exitcode, error_file, stopped)
        finally:
            _PREREAD.reset(token)

    def signal_name(self) -> str:
        """Return the name of the signal that killed the worker (``"SIGSEGV"``).

        Returns:
            The signal's name, or ``"<N/A>"`` for a normal exit or a signal
            number this platform does not name.
        """
        if self.exitcode >= 0:
            return _NOT_AVAILABLE
        return _SIGNAL_NAMES.get(-self.exitcode, _NOT_AVAILABLE)

    def timestamp_isoformat(self) -> str:
        """Return :attr:`timestamp` as local time, ``YYYY-MM-DD_HH:MM:SS``."""
        from datetime import datetime  # only when formatting, never in workers

        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def _order_key(self) -> tuple[int, float, int]:
        # The file's own second comes first so the order agrees with what the
        # workers wrote; the precise observation time and the sequence number
        # order failures within that second.
        return (self.timestamp, self._observed_at, self._seq)

    def _apply_error_file(self, content: bytes, size: int) -> None:
        if size > MAX_ERROR_FILE_SIZE:
            self.message = _too_large(self.error_file, content, size)
            logger.warning(
                "error file %s of local_rank %d (pid %d) is %d bytes, over the %d byte "
                "limit; it was not read",
                self.error_file,
                self.local_rank,
                self.pid,
                size,
                MAX_ERROR_FILE_SIZE,
            )
            return
        raw = content.decode("utf-8", errors="replace")
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if isinstance(data, dict):
            self.error_file_data = data
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(message, str):
            raw_timestamp = data.get("timestamp")
        elif isinstance(message, dict):
            extra = message.get("extraInfo")
            raw_timestamp = extra.get("timestamp") if isinstance(extra, dict) else None
        else:
            logger.warning(
                "error file %s of local_rank %d (pid %d) is not a torchelastic "
                "error.json; keeping its raw text as the message",
                self.error_file,
                self.local_rank,
                self.pid,
            )
            self.message = raw.strip()
            return
        self.message = message
        if raw_timestamp is None:
            return  # keep the observation time
        try:
            self.timestamp = int(raw_timestamp)
        except (TypeError, ValueError):
            logger.warning(
                "error file %s has an invalid timestamp %r; using the time the exit was noticed",
                self.error_file,
                raw_timestamp,
            )

    def _describe_exit(self) -> str:
        if self.exitcode < 0:
            # Signals usually leave no error file; the exact wording is torch's.
            return f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
        if self.error_file == _NOT_AVAILABLE:
            # torch's text and traits; the summary adds how to get a traceback
            self.error_file_data["errorTraits"] = {
                "category": "system_terminated_error",
                "retryability": "False",
            }
            return NO_ERROR_FILE_MESSAGE
        return (
            f"Process {self.pid} exited with code {self.exitcode}; its error file "
            f"{self.error_file} holds no message"
        )


def _too_large(path: str, head: bytes, size: int) -> str:
    # a preview a terminal can show: a sparse or binary file is mostly NULs
    text = head.decode("utf-8", errors="replace")
    shown = "".join(c for c in text if c.isprintable() or c in "\n\t").strip()
    begins = f"its first {len(head)} bytes:\n{shown}" if shown else "it begins with no text"
    return (
        f"error file {path} is too large to read: {size} bytes, over the "
        f"{MAX_ERROR_FILE_SIZE}-byte limit (aioproc.errors.MAX_ERROR_FILE_SIZE); {begins}"
    )


def read_error_file(path: str) -> tuple[bytes, int] | OSError | None:
    """Read an error file in the calling thread, capped, as the constructor does.

    Returns:
        ``(data, size)`` as ``load_error_file`` returns it; None when
        ``path`` is not a regular file (no error file written); the
        ``OSError`` that reading it raised, for the failure to report.
    """
    if not os.path.isfile(path):
        return None
    try:
        return _errorfile.read_capped(path)
    except OSError as e:
        return e


async def load_error_file(
    path: str, max_size: int = MAX_ERROR_FILE_SIZE, *, executor: Executor | None = None
) -> tuple[bytes, int] | None:
    """Read an error file off the event loop, capped (``aiofiles``).

    Args:
        path: the error.json to read.
        max_size: files larger than this many bytes are not read whole.
        executor: where the reads run (default: the loop's default
            executor); a supervisor passes its own, shut down at close, so
            no thread outlives the group.

    Returns:
        ``(data, size)``: the whole file and its size, or, when ``size`` is
        over ``max_size``, only its first ``PREVIEW_SIZE`` bytes (4 KiB);
        None when ``path`` is not a regular file (no error file written).

    Raises:
        OSError: the file exists but cannot be read.
    """
    # imported here: workers import this module and must not load asyncio
    import aiofiles
    import aiofiles.os

    if not await aiofiles.os.path.isfile(path, executor=executor):
        return None
    async with aiofiles.open(path, "rb", executor=executor) as fp:
        size = os.fstat(fp.fileno()).st_size  # an open fd's metadata: no disk read
        if size > max_size:
            return await fp.read(_errorfile.PREVIEW_SIZE), size
        data = await fp.read(max_size + 1)  # +1: notice a file that grew since fstat
    if len(data) > max_size:
        return data[: _errorfile.PREVIEW_SIZE], max(size, len(data))
    return data, len(data)


class ChildFailedError(Exception):
    """One or more worker processes of a group failed.

    Raised by the supervisor; also raise it from a ``@record`` entrypoint to
    pass the root cause's error file up as this process's own.

    ``str()`` gives :meth:`format_msg`. The exception pickles with its name
    and failures.

    Args:
        name: Name of the group (the entrypoint), shown in the title.
        failures: The failed processes by global rank; must not be empty.
        log_dir: The run's log directory, named at the end of the summary
            (an aioproc extension; ``""`` when no files were kept).
        host: The host the failures happened on (default: this one).

    Raises:
        ValueError: ``failures`` is empty.
    """

    def __init__(
        self,
        name: str,
        failures: dict[int, ProcessFailure],
        log_dir: str = "",
        *,
        host: str | None = None,
    ) -> None:
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}) needs at least one failure, got {{}}")
        # args carry everything __init__ needs, so the default pickling works.
        super().__init__(name, failures, log_dir)
        self.name = name
        self.failures = failures
        self.log_dir = log_dir
        # The host where the failures were seen (a job over several hosts
        # names the failing one); this host's name after unpickling.
        self._host = host or _local_hostname()

    def __str__(self) -> str:
        return self.format_msg()

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """Return the root cause: the earliest failure, with its rank.

        Earliest by the error file's timestamp when there is one, then by
        when the exit was noticed, to the sub-second, so there are no ties.

        Returns:
            ``(rank, failure)`` of the first failure.
        """
        return min(self.failures.items(), key=lambda item: item[1]._order_key())

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """Describe every failure, root cause last, in torchelastic's layout.

        Args:
            boarder_delim: Character of the outer rules (torch's spelling).
            section_delim: Character of the rules between sections.

        Returns:
            A multi-line report that starts with a newline.
        """
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root_block = ""
        other_blocks: list[str] = []
        width = len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            block = self._format_failure(idx, rank, failure)
            width = max(width, *(len(line) for line in block.split("\n")))
            if rank == root_rank:
                root_block = block
            else:
                other_blocks.append(block)
        width = min(width, 60)  # a long traceback line must not widen the rules
        border = boarder_delim * width
        section = section_delim * width
        kept = bool(self.log_dir) and os.path.isdir(self.log_dir)
        logs = [f"Logs: {self.log_dir}"] if kept else []
        return "\n".join(
            [
                "",
                border,
                title,
                section,
                "Failures:",
                "\n".join(other_blocks) or "  <NO_OTHER_FAILURES>",
                section,
                "Root Cause (first observed failure):",
                root_block,
                *logs,
                border,
            ]
        )

    def _format_failure(self, idx: int, rank: int, failure: ProcessFailure) -> str:
        stopped = " (stopped by aioproc)" if failure.stopped else ""
        signal_name = failure.signal_name()
        if signal_name != _NOT_AVAILABLE:
            stopped = f" ({signal_name}){stopped}"
        return "\n".join(
            [
                f"[{idx}]:",
                f"  time      : {failure.timestamp_isoformat()}",
                f"  host      : {self._host}",
                f"  rank      : {rank} (local_rank: {failure.local_rank})",
                f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){stopped}",
                f"  error_file: {failure.error_file}",
                *(
                    f"  {label}    : {path}"
                    for label, path in (
                        ("stdout", failure.stdout_log),
                        ("stderr", failure.stderr_log),
                    )
                    if _has_content(path)
                ),
                f"  traceback : {_failure_text(failure.message)}",
                *_hint(failure),
            ]
        )


FULL_DISK_BELOW = 64 << 10
"""Free bytes under which the disk holding a failed worker's log counts as full.

A write that does not fit fails with ENOSPC and leaves the disk at (about)
zero free blocks; a buffered flush needs several KiB."""


def _full_disk(failure: ProcessFailure) -> tuple[str, int] | None:
    """A log of ``failure`` on a disk that is full now, with its free bytes.

    A worker whose own log is on a full disk (a redirect: the worker writes
    the file itself) loses its last output, its traceback included, and
    usually fails on that very write (ENOSPC) without any trace the
    supervisor could read: only the disk's state can tell.
    """
    if failure.stopped or failure.exitcode == 0:
        return None
    for path in (failure.stderr_log, failure.stdout_log):
        if not path:
            continue
        try:
            st = os.statvfs(path if os.path.exists(path) else os.path.dirname(path) or ".")
        except OSError:
            continue  # gone, or formatted on another host
        # root may write into the blocks reserved for it; others may not
        blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
        if st.f_blocks and blocks * st.f_frsize < FULL_DISK_BELOW:
            return path, blocks * st.f_frsize
    return None


def _hint(failure: ProcessFailure) -> list[str]:
    # torch's message only links to its docs; say what to do, in place
    full = _full_disk(failure)
    if full is not None:
        path, free = full
        return [
            f"  hint      : the disk holding {path} is full (ENOSPC, {free} bytes free): "
            "the worker could not write its own log there, so its last output is lost "
            "(writing it may be what failed); free space there or use another log "
            "directory"
        ]
    if failure.error_file != _NOT_AVAILABLE or failure.message != NO_ERROR_FILE_MESSAGE:
        return []
    return [
        f"  hint      : exited with code {failure.exitcode} and wrote no error file; "
        "decorate its entrypoint with @aioproc.record (or torch's @record) to capture "
        "its traceback"
    ]


def _has_content(path: str) -> bool:
    # a log worth pointing at: it exists and the worker wrote to it
    try:
        return bool(path) and os.path.getsize(path) > 0
    except OSError:
        return False


def _failure_text(message: str | dict[str, Any]) -> str:
    # Prefer the traceback, then the one-line message, as torch shows them.
    text: object = message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        text = extra.get("py_callstack") if isinstance(extra, dict) else None
        if not text:
            text = message.get("message") or _NOT_AVAILABLE
    # Continuation lines sit under the field names, like the rest of the block.
    return str(text).rstrip("\n").replace("\n", "\n  ")


@functools.lru_cache(maxsize=1)
def _local_hostname() -> str:
    # Imported here: only a failing supervisor needs it, never a worker.
    import socket

    return socket.getfqdn()


class ErrorHandler:
    """Writes a process's failure to its error.json, in torchelastic's layout.

    The file is named by the ``TORCHELASTIC_ERROR_FILE`` environment
    variable; without it nothing is written. Subclass it and override
    :meth:`initialize` and :meth:`record_exception` to report elsewhere.
    """

    _entrypoint_fn_name: str | None = None

    def set_entrypoint_fn_name(self, fn_name: str) -> None:
        """Name the entrypoint this handler reports for (newer torch's method).

        ``@record`` calls it with the decorated function's name. The base
        handler only logs the name (at DEBUG, with a success or an
        exception); it is never written into the error file, whose
        ``extraInfo`` holds strings that downstream readers know.

        Args:
            fn_name: the entrypoint's name.
        """
        self._entrypoint_fn_name = fn_name

    def record_success(self) -> None:
        """Note that the entrypoint returned normally (newer torch's method).

        Writes no error file. The base handler logs the entrypoint's name at
        DEBUG, and does nothing when no name was set; subclasses report
        successes elsewhere.
        """
        if self._entrypoint_fn_name is not None:
            logger.debug("entrypoint %s succeeded", self._entrypoint_fn_name)

    def _get_error_file_path(self) -> str | None:
        """Return where this process's error.json goes, or None for nowhere."""
        return os.environ.get(_errorfile.ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Prepare to capture failures: dump Python stacks on fatal signals.

        Enables :mod:`faulthandler` on stderr for all threads, as torch does,
        also when it is already enabled (it then writes to stderr, for all
        threads). A failure to enable it is a warning, never an error: it
        must not stop the worker.
        """
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:  # e.g. sys.stderr is None or has no fd
            import warnings

            warnings.warn(
                f"could not enable faulthandler: {type(e).__name__}: {e}",
                RuntimeWarning,
                stacklevel=2,
            )

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` and its traceback to this process's error file.

        Byte-compatible with torch's ``ErrorHandler.record_exception``. When
        no error file is configured, a warning is logged instead. Write
        errors are reported on stderr and swallowed, so that the original
        exception is the one that propagates.

        Args:
            e: The exception to record.
        """
        if self._entrypoint_fn_name is not None:
            logger.debug("entrypoint %s raised %s", self._entrypoint_fn_name, type(e).__name__)
        path = self._get_error_file_path()
        if not path:
            logger.warning(
                "%s is not set, so %s was not written to an error file",
                _errorfile.ERROR_FILE_ENV,
                type(e).__name__,
            )
            return
        _errorfile.write_error_file(path, e)

    def override_error_code_in_rootcause_data(
        self,
        rootcause_error_file: str,
        rootcause_error: dict[str, Any],
        error_code: int = 0,
    ) -> None:
        """Set ``errorCode`` in a child's error data to its real exit code.

        A child killed by a signal cannot record its own exit code. Only the
        ``@record`` layout (a dict ``message``) has room for it; other
        layouts are left unchanged, with a warning.

        Args:
            rootcause_error_file: Where the data came from, for the warning.
            rootcause_error: The parsed error file, modified in place.
            error_code: The exit code to record.
        """
        message = rootcause_error.get("message")
        if isinstance(message, dict):
            message["errorCode"] = error_code
        else:
            logger.warning(
                "child error file %s has no dict 'message' to hold errorCode %d; "
                "copying it unchanged",
                rootcause_error_file,
                error_code,
            )

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file.

        Lets a launcher report its failed child's root cause as its own.
        An existing error file of ours is logged and replaced.

        Args:
            rootcause_error_file: The child's error.json.
            error_code: The child's exit code, written as ``errorCode``
                when nonzero.

        Raises:
            OSError: The child's error file cannot be read.
            ValueError: The child's error file is not a JSON object, or is
                larger than ``MAX_ERROR_FILE_SIZE``.
        """
        content, size = _errorfile.read_capped(rootcause_error_file)
        if size > MAX_ERROR_FILE_SIZE:
            raise ValueError(
                f"child error file {rootcause_error_file} is {size} bytes, over the "
                f"{MAX_ERROR_FILE_SIZE}-byte limit (aioproc.errors.MAX_ERROR_FILE_SIZE)"
            )
        rootcause_error = json.loads(content)
        if not isinstance(rootcause_error, dict):
            raise ValueError(
                f"child error file {rootcause_error_file} holds "
                f"{type(rootcause_error).__name__}, not a JSON object"
            )
        if error_code:
            self.override_error_code_in_rootcause_data(
                rootcause_error_file, rootcause_error, error_code
            )
        my_error_file = self._get_error_file_path()
        if not my_error_file:
            logger.error(
                "%s is not set, so child error file %s was not copied",
                _errorfile.ERROR_FILE_ENV,
                rootcause_error_file,
            )
            return
        self._discard_existing(my_error_file)
        try:
            _errorfile.dump_error_data(my_error_file, rootcause_error)
        except OSError as e:
            logger.warning("could not write error file %s: %s", my_error_file, e)
        else:
            logger.info("copied child error file %s to %s", rootcause_error_file, my_error_file)

    def _discard_existing(self, path: str) -> None:
        # A child that inherited our TORCHELASTIC_ERROR_FILE may have written
        # to it before getting its own; log what is lost, then replace it.
        if not os.path.isfile(path):
            return
        try:
            content, size = _errorfile.read_capped(path)
            if size > MAX_ERROR_FILE_SIZE:
                original = _too_large(path, content, size)
            else:
                original = content.decode("utf-8", errors="replace")
            logger.warning("error file %s exists and is replaced; it held:\n%s", path, original)
            os.remove(path)
        except OSError as e:
            logger.warning("could not replace existing error file %s: %s", path, e)


def get_error_handler() -> ErrorHandler:
    """Return the handler ``@record`` uses when given none (torch's name).

    Returns:
        A new :class:`ErrorHandler`.
    """
    return ErrorHandler()


if TYPE_CHECKING:

    @overload
    def record(fn: _F, error_handler: ErrorHandler | None = None) -> _F: ...

    @overload
    def record(
        fn: None = None, error_handler: ErrorHandler | None = None
    ) -> Callable[[_F], _F]: ...


def record(
    fn: _F | None = None, error_handler: ErrorHandler | None = None
) -> _F | Callable[[_F], _F]:
    """Record an uncaught exception of ``fn`` in this process's error.json.

    Use it once per process, on the entrypoint: ``@record``, ``@record()``
    or ``@record(error_handler=...)``. Coroutine functions are supported.
    The call:

    - names the entrypoint to the handler (``set_entrypoint_fn_name``) and
      initializes it (faulthandler on);
    - on a normal return, calls the handler's ``record_success()``;
    - on :class:`ChildFailedError`, copies the root cause's error file into
      this process's, with its exit code, so the child's traceback is what
      reaches the scheduler;
    - on any other ``Exception``, records it with
      :meth:`ErrorHandler.record_exception`;
    - always re-raises, except ``SystemExit`` with code ``0``, which returns
      None as in torch (so a ``runpy``-run script's ``sys.exit(0)`` does not
      end its launcher). Other ``BaseException`` subclasses (another
      ``SystemExit``, including ``sys.exit()`` with no code as in torch,
      ``KeyboardInterrupt``, cancellation) pass through and write nothing.

    Args:
        fn: The function to wrap; omit it to get a decorator.
        error_handler: Handler to use; :func:`get_error_handler` if None.

    Returns:
        The wrapped function, or a decorator when ``fn`` is None.
    """
    handler = error_handler if error_handler is not None else get_error_handler()

    # The ignores below: functools.wraps keeps f's signature, mypy cannot tell.
    def decorate(f: _F) -> _F:
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                _name_entrypoint(handler, f)
                handler.initialize()
                try:
                    value = await f(*args, **kwargs)
                except SystemExit as e:
                    if e.code == 0:  # torch's test, so False counts and None does not
                        _record_success(handler)
                        return None
                    raise
                except ChildFailedError as e:
                    _dump_root_cause(handler, e)
                    raise
                except Exception as e:
                    handler.record_exception(e)
                    raise
                _record_success(handler)
                return value

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _name_entrypoint(handler, f)
            handler.initialize()
            try:
                value = f(*args, **kwargs)
            except SystemExit as e:
                if e.code == 0:  # torch's test, so False counts and None does not
                    _record_success(handler)
                    return None
                raise
            except ChildFailedError as e:
                _dump_root_cause(handler, e)
                raise
            except Exception as e:
                handler.record_exception(e)
                raise
            _record_success(handler)
            return value

        return wrapper  # type: ignore[return-value]

    if fn is None:
        return decorate
    return decorate(fn)


def _name_entrypoint(handler: ErrorHandler, f: Callable[..., Any]) -> None:
    # torch 2.13's handlers (which record also accepts) have no such method
    setter = getattr(handler, "set_entrypoint_fn_name", None)
    if setter is not None:
        setter(getattr(f, "__name__", repr(f)))


def _record_success(handler: ErrorHandler) -> None:
    success = getattr(handler, "record_success", None)
    if success is not None:
        success()


def _dump_root_cause(handler: ErrorHandler, error: ChildFailedError) -> None:
    # Problems copying are logged, never raised: they must not replace the
    # ChildFailedError that is propagating.
    rank, failure = error.get_first_failure()
    if failure.error_file == _NOT_AVAILABLE:
        logger.info(
            "rank %d (local_rank %d) failed without an error file; decorate its "
            "entrypoint with @aioproc.record to capture its traceback",
            rank,
            failure.local_rank,
        )
        return
    try:
        handler.dump_error_file(failure.error_file, failure.exitcode)
    except (OSError, ValueError) as e:
        logger.warning("could not copy error file %s of rank %d: %s", failure.error_file, rank, e)
