"""``ChildFailedError``: the failure summary a group raises, with hints for common causes.

Standard library only; what only a failing supervisor needs is imported late.
"""

from __future__ import annotations

import functools
import os

from .failure import NO_ERROR_FILE_MESSAGE, NOT_AVAILABLE, ProcessFailure

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from typing import Any


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
        if signal_name != NOT_AVAILABLE:
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
                *([f"  oom       : {failure.oom}"] if failure.oom else []),
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
    if failure.error_file != NOT_AVAILABLE or failure.message != NO_ERROR_FILE_MESSAGE:
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
            text = message.get("message") or NOT_AVAILABLE
    # Continuation lines sit under the field names, like the rest of the block.
    return str(text).rstrip("\n").replace("\n", "\n  ")


@functools.lru_cache(maxsize=1)
def _local_hostname() -> str:
    # Imported here: only a failing supervisor needs it, never a worker.
    import socket

    return socket.getfqdn()
