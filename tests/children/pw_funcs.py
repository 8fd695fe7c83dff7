"""Functions that tests/test_worker.py and tests/test_pool.py send to persistent workers.

Standard library only (``aioproc`` is imported lazily, inside the functions
that read the worker state, and in a worker that import only registers the
already-booted ``aioproc._child.boot``).  The tests put this directory on
``sys.path``, so functions travel by reference: ``(module, qualname)``.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import sys
import time
from typing import Any

COUNTER = 0
"""Set by :func:`set_counter` (a pool initializer), read by :func:`get_counter`."""


class InitFailed(Exception):
    """Raised by :func:`failing_init`; picklable by reference, so its type survives."""


class CallFailed(Exception):
    """Raised by :func:`raise_call_failed`."""


# ------------------------------------------------------------------ basics


def noop() -> None:
    return None


def pids() -> tuple[int, int]:
    return os.getpid(), os.getppid()


def getpid() -> int:
    return os.getpid()


def add(a: int, b: int) -> int:
    return a + b


def echo(value: Any) -> Any:
    return value


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def make_lock() -> Any:
    """Return something that cannot be pickled."""
    import threading

    return threading.Lock()


def fail_on_task(index: int) -> None:
    """A pool initializer that fails only in the TF task ``index``."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] == index:
        raise InitFailed(f"init failed in task {task['type']}:{task['index']}")


# -------------------------------------------------------------------- init


def slow_init(seconds: float) -> None:
    time.sleep(seconds)


def failing_init(reason: str) -> None:
    raise InitFailed(f"init failed: {reason}")  # the line the remote traceback must show


def pid_state() -> dict[str, int]:
    """An init: the worker state is the pid init ran in."""
    return {"init_pid": os.getpid()}


def read_state() -> Any:
    import aioproc

    return aioproc.worker_state()


# ------------------------------------------------------- checkpoint writer


class CheckpointWriter:
    """Per-worker state: a directory, this worker's rank and an open journal file.

    The open file makes the state unpicklable: it lives in the worker only.
    """

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank
        self.pid = os.getpid()
        self.journal = open(os.path.join(directory, f"journal_{rank}.log"), "a")  # noqa: SIM115

    def save(self, step: int, state: dict[str, list[float]]) -> str:
        path = os.path.join(self.directory, f"checkpoint_{self.rank}_step{step}.pt")
        with open(path + ".tmp", "wb") as f:
            pickle.dump({"step": step, "rank": self.rank, "state_dict": state}, f)
        os.replace(path + ".tmp", path)
        self.journal.write(f"{step} {os.getpid()} {os.path.basename(path)}\n")
        self.journal.flush()
        return path


def open_writer(directory: str, rank: int) -> CheckpointWriter:
    return CheckpointWriter(directory, rank)


def write_checkpoint(step: int, state: dict[str, list[float]]) -> tuple[str, int]:
    import aioproc

    writer: CheckpointWriter = aioproc.worker_state()
    return writer.save(step, state), os.getpid()


# ------------------------------------------------------------- failures


def raise_call_failed(message: str) -> None:
    raise CallFailed(message)  # the line the remote traceback must show


def announce_then_block(fifo: str, seconds: float = 60.0) -> None:
    """Print "about to block" to stderr, write one byte to ``fifo``, then sleep.

    The test opens the FIFO read-write before the call, so this ``open``
    never blocks; the byte tells the test the call is in progress.
    """
    print("about to block", file=sys.stderr, flush=True)
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, b"r")
    finally:
        os.close(fd)
    time.sleep(seconds)


def announce_pid_then_block(fifo: str, seconds: float = 60.0) -> None:
    """Like :func:`announce_then_block`, but the message is this worker's pid and a newline."""
    print("about to block", file=sys.stderr, flush=True)
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())  # one small write: atomic on a pipe
    finally:
        os.close(fd)
    time.sleep(seconds)


def wait_fifo(path: str, value: Any = None) -> Any:
    """Block until the test writes a byte to the FIFO at ``path``; return ``value``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)
    return value


# --------------------------------------------------------------- shutdown


def refuse_to_exit() -> int:
    """Make this worker ignore SIGTERM and hang at exit (an atexit handler sleeps).

    The bootstrap answers TERMINATE with ``sys.exit(0)``; the atexit handler
    keeps the interpreter from finishing, so only SIGKILL ends it.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    atexit.register(time.sleep, 60)
    return os.getpid()


# -------------------------------------------------------------------- pool


def set_counter(value: int) -> None:
    global COUNTER
    COUNTER = value


def get_counter() -> int:
    return COUNTER


def bump_counter() -> int:
    global COUNTER
    COUNTER += 1
    return COUNTER


def read_tf_config() -> dict[str, Any]:
    config = json.loads(os.environ["TF_CONFIG"])
    return {"task": config["task"], "cluster": config["cluster"], "pid": os.getpid()}


def square(i: int) -> tuple[int, int]:
    return i * i, os.getpid()


# ---------------------------------------------------------------- payloads


def payload_len(data: bytes) -> int:
    return len(data)


def make_bytes(n: int, seed: int) -> bytes:
    """``n`` bytes with a pattern that depends on ``seed`` (checked by the test)."""
    block = bytes((seed + i) % 256 for i in range(256))
    return (block * (n // 256 + 1))[:n]


def digest_and_reverse(data: bytes) -> tuple[int, str, bytes]:
    import hashlib

    return len(data), hashlib.sha256(data).hexdigest(), data[::-1]


# ---------------------------------------------------- pools for services


def _append_pid(path: str) -> int:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return os.getpid()


def record_call(path: str) -> int:
    """Append this worker's pid to ``path`` (one line per run) and return it."""
    return _append_pid(path)


def record_then_die(path: str) -> None:
    """Record the run, then die by SIGKILL in the middle of the call."""
    _append_pid(path)
    os.kill(os.getpid(), signal.SIGKILL)


def record_then_sleep(path: str, seconds: float) -> None:
    """Record the run, then block (until killed, in the tests)."""
    _append_pid(path)
    time.sleep(seconds)


def announce_then_wait(announce: str, release: str, value: Any) -> Any:
    """Write this pid and a newline to the FIFO ``announce``, wait for a byte on ``release``.

    The test holds both FIFOs open read-write, so neither ``open`` blocks:
    the line says the call is running, the byte lets it return ``value``.
    """
    fd = os.open(announce, os.O_WRONLY)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())  # one small write: atomic on a pipe
    finally:
        os.close(fd)
    return wait_fifo(release, value)


def takes_timeout(x: Any, timeout: Any = None) -> tuple[Any, Any]:
    """A function with a ``timeout`` keyword of its own."""
    return x, timeout


def flood_stderr_then_exit(n: int, code: int) -> None:
    """``n`` numbered lines to stderr in one write, then an exit during the call."""
    data = "".join(f"err {i:05d}\n" for i in range(n)).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(2, view) :]
    os._exit(code)


def modules_loaded(names: list[str]) -> list[bool]:
    """Whether each module named is imported in this worker."""
    return [name in sys.modules for name in names]
