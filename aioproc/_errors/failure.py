"""What a failed worker left behind: ``ProcessFailure`` and reading its error file.

Imported by workers (through ``aioproc.errors``): standard library only.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from .._child import errorfile as _errorfile
from .._child.errorfile import MAX_ERROR_FILE_SIZE

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from concurrent.futures import Executor
    from typing import Any


logger = logging.getLogger("aioproc.errors")  # the public module's name, as before

NOT_AVAILABLE = "<N/A>"

# signal number -> name: ``signal.Signals(n).name`` is an enum lookup of
# ~5 us, paid per failure when a close stops hundreds of workers
SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}

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
        oom: Why the kernel killed the worker when its OOM killer did,
            within a memory limit of ``limits=`` (``"killed by the kernel's
            OOM killer: memory limit 64 MiB reached"``); ``""`` otherwise.
            The summary shows it on a line of its own; ``message`` keeps
            torch's signal text. An aioproc extension to torch's fields.
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
    oom: str = field(init=False, default="", compare=False)
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
            self.error_file = NOT_AVAILABLE
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
        read off the loop (``load_error_file``) and capped as by the
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
            return NOT_AVAILABLE
        return SIGNAL_NAMES.get(-self.exitcode, NOT_AVAILABLE)

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
            self.message = too_large(self.error_file, content, size)
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
        if self.error_file == NOT_AVAILABLE:
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


def too_large(path: str, head: bytes, size: int) -> str:
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
    """Read an error file off the event loop, capped.

    Args:
        path: the error.json to read.
        max_size: files larger than this many bytes are not read whole.
        executor: where the read runs; by default aioproc's helper thread
            (``_base.offloop``), which exists only while aioproc has
            blocking work, so no thread outlives the read.

    Returns:
        ``(data, size)``: the whole file and its size, or, when ``size`` is
        over ``max_size``, only its first ``PREVIEW_SIZE`` bytes (4 KiB);
        None when ``path`` is not a regular file (no error file written).

    Raises:
        OSError: the file exists but cannot be read.

    Cancellation: on the helper thread, the read (a few system calls)
    finishes first and the cancellation is raised after it.
    """
    # imported here: workers import this module and must not load asyncio
    import asyncio

    from .._base.offloop import run_blocking

    if executor is not None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, _read_if_file, path, max_size)
    return await run_blocking(_read_if_file, path, max_size)


def _read_if_file(path: str, max_size: int) -> tuple[bytes, int] | None:
    # one read in one thread job: is it a file, its size, its bytes
    if not os.path.isfile(path):
        return None
    return _errorfile.read_capped(path, max_size)


ErrorFileContent = tuple[bytes, int] | OSError | None
"""What ``read_error_file`` returns."""


LIST_DIR_FROM = 8
"""Error files in one dir from which ``read_error_files`` lists the dir first."""


def read_error_files(paths: list[str]) -> list[ErrorFileContent]:
    """``read_error_file`` of each path (a stopped group's: most were never written).

    A dir holding many of them (``error_<rank>.json`` side by side) is
    listed once, and only the files in it are looked at: one system call
    instead of a ``stat`` per absent file.
    """
    by_dir: dict[str, list[str]] = {}
    for path in paths:
        by_dir.setdefault(os.path.dirname(path), []).append(path)
    absent: set[str] = set()
    for folder, inside in by_dir.items():
        if len(inside) >= LIST_DIR_FROM:
            try:
                present = set(os.listdir(folder))
            except OSError:
                continue  # looked at one by one below
            absent.update(p for p in inside if os.path.basename(p) not in present)
    return [None if path in absent else read_error_file(path) for path in paths]
