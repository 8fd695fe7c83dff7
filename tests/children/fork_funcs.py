"""Worker functions for tests/test_forkserver.py (standard library only).

Imported by name in the workers: the test puts this directory on ``sys.path``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def ident(x: object) -> tuple[object, int, int, int, int]:
    """``(x, pid, ppid, session id, process group id)``."""
    return x, os.getpid(), os.getppid(), os.getsid(0), os.getpgid(0)


def process_name() -> str:
    """This process's name (``comm``): what ``ps`` and ``top`` show."""
    with open("/proc/self/comm") as f:
        return f.read().rstrip("\n")


def fail(message: str) -> None:
    raise ValueError(message)


def exit_with(code: int) -> None:
    os._exit(code)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def talk(n: int) -> str:
    """Write ``n`` numbered lines to stdout and to stderr; return "done"."""
    for i in range(n):
        print(f"out {i}")
        print(f"err {i}", file=sys.stderr)
    return "done"


def preload_info(module: str) -> tuple[int, int, bool, int]:
    """``(pid that imported module, my pid, already imported before this call, my ppid)``."""
    was_loaded = module in sys.modules
    mod = __import__(module)
    return mod.IMPORT_PID, os.getpid(), was_loaded, os.getppid()


def with_grandchild(report: str) -> None:
    """Start a ``sleep`` grandchild, append "<my pid> <its pid>" to ``report``, block."""
    child = subprocess.Popen(["sleep", "1000"])
    fd = os.open(report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{os.getpid()} {child.pid}\n".encode())
    os.close(fd)
    time.sleep(1000)


def environment_and_cwd() -> tuple[dict[str, str], str, list[str], list[int]]:
    """The worker's os.environ, cwd, argv and open fds."""
    return (
        dict(os.environ),
        os.getcwd(),
        list(sys.argv),
        sorted(map(int, os.listdir("/proc/self/fd"))),
    )


def block() -> None:
    time.sleep(1000)


def flaky(path: str) -> int:
    """Record the template's pid; fail on the first attempt, succeed on the second."""
    import fork_preload_mod

    with open(path, "a") as f:
        f.write(f"{fork_preload_mod.IMPORT_PID}\n")
    with open(path) as f:
        if len(f.read().split()) < 2:
            raise RuntimeError("first attempt fails")
    return fork_preload_mod.IMPORT_PID


def register_exit_hooks(log_file: str) -> int:
    """Register this worker's own exit hooks and log through a file handler."""
    import atexit
    import logging
    import weakref

    import fork_exit_hooks_mod

    atexit.register(fork_exit_hooks_mod.note, "worker-atexit")
    obj = fork_exit_hooks_mod._Held()
    weakref.finalize(obj, fork_exit_hooks_mod.note, "worker-finalize")
    globals()["_kept"] = obj  # alive at exit: only the atexit pass runs it
    logger = logging.getLogger("fork-exit-hooks")
    logger.addHandler(logging.FileHandler(log_file, delay=False))
    logger.warning("logged by %d", os.getpid())  # flushed by logging.shutdown at exit
    return os.getpid()


def scribble(rank: int) -> tuple[bool, bool, int]:
    """Write ``rank`` into every 2 MiB of the preloaded ``fork_big_mod.BLOCK``.

    ``(found the preload's data, its numbers intact, this pid)``: a worker
    forked from the template must see the template's memory as it was at
    preload, whatever other workers wrote to their copies of it.
    """
    import fork_big_mod

    block = fork_big_mod.BLOCK
    import hashlib

    intact = hashlib.sha256(block).hexdigest() == fork_big_mod.DIGEST
    numbers = fork_big_mod.NUMBERS[123_456] == "123456" and len(fork_big_mod.NUMBERS) == 200_000
    for offset in range(0, len(block), 2 << 20):
        block[offset : offset + 4096] = bytes([rank + 1]) * 4096
    fork_big_mod.NUMBERS.append(str(rank))
    time.sleep(0.2)  # the group's workers scribble at the same time
    return intact, numbers, os.getpid()


def say_running(fifo: str) -> int:
    """Write "running <pid>" to the FIFO ``fifo`` (the function has begun); return the pid."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, f"running {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return os.getpid()


def say_running_then_sleep(fifo: str, seconds: float) -> int:
    """``say_running``, then sleep ``seconds`` (still running when the test acts)."""
    say_running(fifo)
    time.sleep(seconds)
    return os.getpid()
