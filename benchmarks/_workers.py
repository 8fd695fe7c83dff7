"""Worker-side code of the benchmarks: module-level functions, stdlib only
(``import_torch`` imports torch when it is called, never at import).

aioproc ships a function importable by name as ``(module, qualname)`` and the
worker imports this module; torch's spawn workers unpickle it by reference;
the raw baselines run it through ``python -c``.  So every variant runs the
very same code, and importing it costs a worker nothing but ``os`` and
``time`` (already loaded by the interpreter).  Keep it that way: an import
here is paid by every worker of every benchmark (hence no ``__future__``
import either).  ``run_all`` byte-compiles this file before the first
worker starts (see ``precompile``).
"""

import os
import sys
import time


def ret_rank(rank: int) -> int:
    """P1: return at once; the parent checks it gets every rank back."""
    return rank


def import_torch(rank: int) -> int:
    """P1t: what a training worker does first, ``import torch``; returns ``rank``
    through a tensor, so the worker has really used it.

    The import stays inside the function: no other benchmark's worker pays it.
    Under a forkserver whose template preloaded torch it finds the module
    already in ``sys.modules``.
    """
    import torch

    return int(torch.tensor([rank]).sum())


def fail_first(rank: int, delay: float, path: str) -> None:
    """P3: rank 0 dies with exit code 1 after ``delay`` s; the others sleep.

    Rank 0 writes ``time.time()`` to ``path`` as the very last thing before
    ``os._exit(1)``: the file is opened first, so only one ``write`` syscall
    separates the timestamp from the exit.  The parent compares it with
    ``time.time()`` taken when ``wait()`` returns (same host, same clock).
    The other ranks sleep with the default SIGTERM disposition, so the
    group stop ends them at once.
    """
    if rank != 0:
        time.sleep(60)
        return
    time.sleep(delay)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    stamp = time.time()
    os.write(fd, repr(stamp).encode())
    os._exit(1)


def ready_then_sleep(fifo: str, seconds: float = 60.0) -> None:
    """P6: announce "my function runs" with one byte on a FIFO, then sleep.

    A one-byte write to a pipe is atomic, and opening the FIFO for writing
    succeeds at once because the parent holds it open for reading.
    """
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"r")
    os.close(fd)
    time.sleep(seconds)


async def async_noop() -> None:
    """PC: the coroutine twin of the persistent-worker benchmarks' no-op: returns at once."""
    return None


async def async_sleep(seconds: float) -> float:
    """PC: sleep ``seconds`` on the worker's event loop (asyncio is loaded by then)."""
    import asyncio

    await asyncio.sleep(seconds)
    return seconds


def script(func: str, *args: str) -> list[str]:
    """argv running ``func`` of this module in a plain interpreter (raw baselines).

    Arguments are passed as strings; ``main`` converts them back.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import _workers; _workers.main()"
    return [sys.executable, "-c", code, func, *args]


def precompile() -> str:
    """Write this module's ``.pyc`` now; returns a note for the report.

    With ``PYTHONDONTWRITEBYTECODE=1`` (set on the machines this was written
    on) no worker would ever cache it, and each would compile this file again
    (about 1.5 ms on Python 3.11, 3 ms on 3.13, per worker): a cost of the
    benchmark's own worker module, not of aioproc, whose worker boot code is
    shipped precompiled.  ``py_compile`` writes the cache whatever that
    variable says; a read-only checkout just skips it.
    """
    import importlib.util
    import py_compile

    src = os.path.abspath(__file__)
    try:
        py_compile.compile(src, cfile=importlib.util.cache_from_source(src), doraise=True)
    except (OSError, py_compile.PyCompileError) as e:
        return f"could not byte-compile {src} ({e}): workers compile it on import"
    return ""


def main() -> None:
    """Entry of :func:`script`: ``argv = [-c, func, *args]``."""
    func, *args = sys.argv[1:]
    if func == "fail_first":
        fail_first(int(args[0]), float(args[1]), args[2])
    elif func == "ready_then_sleep":
        ready_then_sleep(args[0], float(args[1]))
    else:  # pragma: no cover - programming error
        raise SystemExit(f"unknown worker function {func!r}")
