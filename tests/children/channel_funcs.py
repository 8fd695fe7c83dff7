"""Functions that tests/test_channel.py runs in function and persistent workers.

Standard library only; the tests put this directory on ``sys.path`` so the
functions travel by reference.  A worker's control channel is the only
stream socket it has (stdin is /dev/null, stdout and stderr are pipes or
files; the fd socket for shared memory is a SOCK_SEQPACKET one), so
:func:`channel_fd` finds it without any help from aioproc.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
from typing import Any


def channel_fd() -> int:
    """The fd of this worker's end of its control channel."""
    socks = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                with socket.socket(fileno=os.dup(int(name))) as sock:
                    if sock.type == socket.SOCK_STREAM:
                        socks.append(int(name))
        except OSError:
            continue  # the fd listdir itself used, closed by now
    assert len(socks) == 1, f"expected one stream socket, found fds {socks}"
    return socks[0]


def forge_header(kind: int, length: int) -> str:
    """Write a frame header claiming ``kind`` and ``length``, and no body."""
    os.write(channel_fd(), kind.to_bytes(1, "big") + length.to_bytes(8, "big"))
    return "sent"


def forge_frame(kind: int, body: bytes, value: Any = "sent") -> Any:
    """Write a whole frame of ``kind`` with ``body``; return ``value``."""
    os.write(channel_fd(), kind.to_bytes(1, "big") + len(body).to_bytes(8, "big") + body)
    return value


def forge_header_then_block(kind: int, length: int) -> None:
    """Like :func:`forge_header`, then wait forever (until killed)."""
    forge_header(kind, length)
    while True:
        signal.pause()


def make_bytes(n: int) -> bytes:
    return b"x" * n


def write_to_proxy(proxy: Any, key: str, value: Any) -> int:
    """Write into a multiprocessing Manager proxy (a dict or a queue)."""
    if hasattr(proxy, "put"):
        proxy.put((key, value))
    else:
        proxy[key] = value
    return os.getpid()


def authkey() -> bytes:
    import multiprocessing

    return bytes(multiprocessing.current_process().authkey)


def huge_error_file_then_exit(size: int) -> None:
    """Leave a sparse ``size``-byte error.json, then fail without rewriting it."""
    path = os.environ["TORCHELASTIC_ERROR_FILE"]
    with open(path, "wb") as f:
        f.write(b'{"message": "huge"')
    os.truncate(path, size)
    os._exit(3)


def imported_at_startup() -> tuple[bool, bytes]:
    """Whether sitecustomize imported multiprocessing, and the authkey now."""
    import sys

    site = sys.modules.get("sitecustomize")
    early = site is not None and "multiprocessing.process" in sys.modules
    return early, authkey()
