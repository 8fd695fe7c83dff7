"""Functions test_shm.py runs in workers: large values (stdlib only; numpy if given one)."""

from __future__ import annotations

import os
import time
from typing import Any


def identity(value: Any) -> Any:
    return value


def append_line(path: str, line: str, value: Any = None) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def make_bytes(kind: str, size: int) -> Any:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(data)
    return data


def root(value: Any) -> str:
    """Type name of the object that owns the memory ``value`` views."""
    while True:
        base = getattr(value, "base", None)
        if base is None and isinstance(value, memoryview):
            base = value.obj
        if base is None:
            return type(value).__name__
        value = base


def describe(value: Any) -> tuple[str, str, bool]:
    """(type, owner of its memory, read-only) as the worker received it."""
    view = memoryview(value)
    return type(value).__name__, root(value), view.readonly


def memfds() -> int:
    """How many memfds this process holds."""
    return sum(
        "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    )


def announce_then_block(ready: str, value: Any = None) -> None:
    with open(ready, "w") as f:
        f.write("r")
    time.sleep(60)


def send_fd_then_block(ready: str, size: int) -> None:
    """Pass a memfd to the supervisor as a large result would, then hang before the frame."""
    from aioproc._child import boot as _bootstrap
    from aioproc._child import shm as _shm

    assert _bootstrap._FD_SOCKET is not None
    segment = _shm.Segment.create(size, [b"\0" * size], [])
    _shm.send(_shm.worker_socket(_bootstrap._FD_SOCKET), [segment])
    announce_then_block(ready)
