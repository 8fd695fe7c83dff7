"""error.json in torchelastic's format: stdlib only, shared by both sides.

The child side (``_child.boot``) writes it when a function worker raises; the
parent side (``errors``) reads it into a ``ProcessFailure``.  The layout is
byte-compatible with what ``torch.distributed.elastic.multiprocessing.errors``
writes, so either side can be torch's own.
"""

from __future__ import annotations

import json
import os
import time
import traceback

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from typing import Any

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

MAX_ERROR_FILE_SIZE = 1 << 20
"""Largest error file read, in bytes (1 MiB).

A real error.json is a few KiB; a bigger one is corrupt or hostile, and
reading it whole would cost the supervisor its memory and, on the event
loop, its responsiveness.  Only its first ``PREVIEW_SIZE`` bytes are read.
"""

PREVIEW_SIZE = 4096
"""Bytes of an oversized error file read to show what it begins with."""


def read_capped(path: str, max_size: int = MAX_ERROR_FILE_SIZE) -> tuple[bytes, int]:
    """Read an error file unless it is larger than ``max_size`` bytes.

    Returns:
        ``(data, size)``: the whole file and its size, or, when ``size`` is
        over ``max_size``, only its first ``PREVIEW_SIZE`` bytes.  Memory
        use is bounded by ``max_size`` whatever the file holds.

    Raises:
        OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as fp:
        size = os.fstat(fp.fileno()).st_size
        if size > max_size:
            return fp.read(PREVIEW_SIZE), size
        data = fp.read(max_size + 1)  # +1: notice a file that grew since fstat
    if len(data) > max_size:
        return data[:PREVIEW_SIZE], max(size, len(data))
    return data, len(data)


def exception_data(exc: BaseException) -> dict[str, Any]:
    """Return the error.json document for ``exc`` (torch's ``record`` layout)."""
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(time.time())),
            },
        }
    }


def dump_error_data(path: str, data: dict[str, Any]) -> None:
    """Write an error.json document ``data`` to ``path``, replacing the file.

    Serialised with ``json`` defaults, as torch does, so the bytes match.

    Raises:
        OSError: ``path`` could not be written.
    """
    with open(path, "w") as fp:
        json.dump(data, fp)


def write_error_file(path: str, exc: BaseException) -> None:
    """Write ``exc`` to ``path`` as error.json; never raises for I/O problems.

    A worker that fails to write its error file must still exit with its
    own failure, so write errors are reported on stderr and swallowed.  A
    file left half-written (a full disk: ENOSPC) is removed, so the
    supervisor reports the failure as having no error file (and uses what
    the worker told it otherwise) instead of a file that holds no message.
    """
    try:
        fp = open(path, "w")  # noqa: SIM115 - a failed open and a failed write differ
    except OSError as e:
        _report(path, e)
        return
    try:
        with fp:
            json.dump(exception_data(exc), fp)
    except OSError as e:
        try:
            os.unlink(path)  # ours, half-written
        except OSError:
            pass
        _report(path, e)


def _report(path: str, error: OSError) -> None:
    import sys

    try:
        print(f"aioproc: could not write error file {path!r}: {error}", file=sys.stderr)
    except (OSError, ValueError):
        pass  # stderr is on the same full disk, or closed
