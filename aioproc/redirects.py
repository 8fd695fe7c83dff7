"""Redirect this process's stdout or stderr to a file, at the file-descriptor level.

torch's ``torch.distributed.elastic.multiprocessing.redirects``, for code
that ports from it: ``redirect(std, to_file)``, ``redirect_stdout(to_file)``
and ``redirect_stderr(to_file)`` are context managers that point fd 1 or 2
at ``to_file`` for the duration of the block, so whatever writes there goes
to the file: Python's ``print``, C's ``printf``, and child processes started
inside the block (they inherit the fd).

Usage::

    with redirect_stdout("/tmp/stdout.log"):
        print("python output")
        os.system("echo output of a child process")
    print("stdout is back")

Both Python's and C's buffers are flushed before the switch and before the
switch back, so nothing written before the block lands in the file and
nothing written inside it lands on the old stream. Lines written by Python
and by C inside the block may still appear in the file out of order: each
side buffers on its own, as in torch.

This is synchronous, process-wide state (fds 1 and 2 are shared by every
thread and by the event loop): use it around a stretch of code, not
concurrently from several tasks. It imports only the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["redirect", "redirect_stderr", "redirect_stdout"]

_FDS = {"stdout": 1, "stderr": 2}


@functools.lru_cache(maxsize=1)
def _c_fflush() -> Callable[[Any], int] | None:
    # fflush(NULL) flushes every C output stream of the process
    try:
        fflush: Callable[[Any], int] = ctypes.CDLL(None).fflush
    except (OSError, AttributeError):
        return None
    return fflush


def _flush(std: str) -> None:
    stream = getattr(sys, std, None)
    if stream is not None:
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing to flush
            pass
    fflush = _c_fflush()
    if fflush is not None:
        fflush(None)


@contextmanager
def redirect(std: str, to_file: str | os.PathLike[str]) -> Iterator[None]:
    """Point ``std``'s file descriptor at ``to_file`` for the block.

    ``to_file`` is created, or truncated if it exists (its directory must
    exist), as torch does. On leaving the block, also by an exception, the
    original descriptor is restored and the file closed.

    Args:
        std: ``"stdout"`` or ``"stderr"``.
        to_file: the file that receives the stream.

    Raises:
        ValueError: ``std`` is not ``"stdout"`` or ``"stderr"``.
        OSError: ``to_file`` cannot be opened for writing; nothing was
            redirected.
    """
    if std not in _FDS:
        raise ValueError(f"std must be 'stdout' or 'stderr', got {std!r}")
    fd = _FDS[std]
    with open(to_file, "wb") as dst:
        saved = os.dup(fd)
        try:
            _flush(std)
            os.dup2(dst.fileno(), fd)
            try:
                yield
            finally:
                _flush(std)
                os.dup2(saved, fd)
        finally:
            os.close(saved)


def redirect_stdout(to_file: str | os.PathLike[str]) -> Any:
    """``redirect("stdout", to_file)``: fd 1 goes to ``to_file`` for the block."""
    return redirect("stdout", to_file)


def redirect_stderr(to_file: str | os.PathLike[str]) -> Any:
    """``redirect("stderr", to_file)``: fd 2 goes to ``to_file`` for the block."""
    return redirect("stderr", to_file)
