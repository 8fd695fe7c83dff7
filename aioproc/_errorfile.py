"""error.json in torchelastic's format: stdlib only, shared by both sides.

The child side (``_bootstrap``) writes it when a function worker raises; the
parent side (``errors``) reads it into a ``ProcessFailure``.  The layout is
byte-compatible with what ``torch.distributed.elastic.multiprocessing.errors``
writes, so either side can be torch's own.
"""

from __future__ import annotations

import json
import time
import traceback

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs workers
if TYPE_CHECKING:
    from typing import Any

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


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
    own failure, so write errors are reported on stderr and swallowed.
    """
    try:
        with open(path, "w") as fp:
            json.dump(exception_data(exc), fp)
    except OSError as e:
        import sys

        print(f"aioproc: could not write error file {path!r}: {e}", file=sys.stderr)
