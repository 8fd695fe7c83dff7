"""``aioproc.preimport()``: what a process's first group would import, imported now."""

from __future__ import annotations

from .._proc import exits as _exits


def preimport() -> None:
    """Import and compile now what the first ``start_processes`` of this process needs.

    ``import aioproc`` loads nothing heavy, so the first group a process
    starts pays for the rest inside one callback of the running loop: anyio's
    asyncio backend (imported by anyio on first use), ``multiprocessing``
    (whose authkey function workers are given), the boot code every function
    worker is sent (compiled once per process), the warm-start modules and
    ``ctypes`` (with which a worker's exit is read).
    That is 30-80 ms, during which the host's loop runs nothing else.  A
    service calls ``preimport()`` once at start-up, before it serves, so
    that its first start holds the loop no longer than any other.

    Synchronous and cheap to repeat: later calls find everything loaded.  It
    starts no process or thread, installs no signal handler and needs no
    running loop.
    """
    import importlib

    # the backend anyio loads on the first task group or cancel scope; the
    # same module serves uvloop, which anyio runs as asyncio
    importlib.import_module("anyio._backends._asyncio")
    from multiprocessing import process  # noqa: F401  (imported by init_frame)

    from .._func import boot, fork, template_exec  # noqa: F401  (fork: warm start)

    boot.boot_blob()
    template_exec._source()
    template_exec._script_runner()
    _exits._waitid_call()  # ctypes, for the usage of a worker that exits by itself
