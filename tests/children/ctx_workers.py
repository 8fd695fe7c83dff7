"""Worker functions for tests/test_context.py that import only the standard library.

Workers import a function's module by name, so a worker running one of these
loads nothing but this file: what it finds in ``sys.modules`` is what aioproc's
child side itself imported.  The test puts this directory on ``sys.path``.
"""

from __future__ import annotations

import atexit
import os
import sys


def loaded_modules() -> list[str]:
    return sorted(sys.modules)


def record_modules_then_raise(path: str) -> None:
    """Raise; at interpreter exit (after aioproc reported the error) dump sys.modules."""

    def dump() -> None:
        with open(path, "w") as f:
            f.write("\n".join(sorted(sys.modules)))

    atexit.register(dump)
    raise ValueError("failing on purpose")


def wait_fifo(path: str, value: object = None) -> object:
    """Block until the test writes a byte to the FIFO at ``path``, then return ``value``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)
    return value


def fail_or_block(rank: int, bad_rank: int) -> str:
    """``bad_rank`` raises at once; every other rank blocks until it is stopped."""
    if rank == bad_rank:
        raise RuntimeError(f"rank {rank} gave up")
    import time

    time.sleep(60)
    return "slept"


def environment() -> dict[str, str]:
    return dict(os.environ)


def roundtrip(data: bytes) -> tuple[int, str, bytes]:
    """Return the argument's length and sha256, and the argument itself."""
    import hashlib

    return len(data), hashlib.sha256(data).hexdigest(), data


def exit_with(code: int) -> str:
    sys.exit(code)
    return "not reached"


def segfault() -> None:
    import ctypes

    ctypes.string_at(0)


def return_lock() -> object:
    import threading

    return threading.Lock()


def return_generator() -> object:
    return (i for i in range(3))


def square(x: int) -> int:
    return x * x


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


def _refuse_to_load() -> None:
    raise RuntimeError("this value refuses to be unpickled")


class Unloadable:
    """Pickles fine in the worker; unpickling it (in the supervisor) raises."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_refuse_to_load, ())


def return_unloadable() -> Unloadable:
    return Unloadable()
